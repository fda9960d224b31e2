"""What clients see of the server's text: every private folder made relative, echoed names left alone."""

from __future__ import annotations

import os
from pathlib import Path

import nereid
import nereid.backends
from nereid.client_paths import ClientPaths
from nereid.errors import MESSAGE_LIMIT, PublicText


def paths(tmp_path: Path) -> tuple[ClientPaths, Path, Path]:
    """ClientPaths for a nereid.yaml in ``tmp_path`` whose ml_backends_path is the folder inside it."""
    root, scratch = tmp_path / "ml-backends", tmp_path / "scratch"
    root.mkdir()
    scratch.mkdir()
    return ClientPaths(root, scratch, tmp_path / "nereid.yaml"), root, scratch


def test_each_private_folder_is_rewritten_and_ml_backends_path_wins_over_the_folder_holding_it(tmp_path):
    clients, root, scratch = paths(tmp_path)
    sep = os.sep
    assert clients.public_text(f"cannot read {root}{sep}m{sep}weights.bin") == f"cannot read m{sep}weights.bin"
    # (nereid.yaml's folder holds ml_backends_path: the longer prefix must win, or "ml-backends/m" would show.)
    assert clients.public_text(f"{tmp_path}{sep}other.txt") == "other.txt"
    assert clients.public_text(f"{scratch}{sep}m{sep}run") == f"<scratch>/m{sep}run"
    installed = Path(nereid.__file__).resolve().parent
    assert clients.public_text(f"{installed}{sep}scheduler.py") == "<nereid>/scheduler.py"
    backends = Path(nereid.backends.__file__).resolve().parent
    assert clients.public_text(f"{backends}{sep}xla{sep}model.py") in (
        f"<nereid.backends>/xla{sep}model.py",  # installed apart from nereid (the repository's layout)
        f"<nereid>/backends{sep}xla{sep}model.py")  # a wheel's layout: inside nereid's folder


def test_a_private_folder_named_alone_is_named_by_its_setting(tmp_path):
    """The secrets hunt: "ml_backends_path /srv/models: cannot list it", a RepositoryIndex reason, showed clients
    the folder itself, which only the paths inside it were rewritten from."""
    clients, root, scratch = paths(tmp_path)
    assert clients.public_text(f"ml_backends_path {root}: cannot list it: No such file or directory") == (
        "ml_backends_path <ml_backends_path>: cannot list it: No such file or directory")
    assert clients.public_text(f"cannot write '{scratch}' (full)") == "cannot write '<scratch>' (full)"
    # A longer name that only starts with it, or a path that only ends with it, is another folder.
    assert "<ml_backends_path>" not in clients.public_text(f"{root}2: x") + clients.public_text(f"/mnt{root}: x")


def test_the_interpreter_s_own_folders_are_named_by_what_they_are(tmp_path):
    """The secrets hunt: a python model's traceback through json (or numpy) showed clients the service user's home
    and the Python build."""
    import json

    import numpy

    clients, _, _ = paths(tmp_path)
    sep = os.sep
    assert clients.public_text(f'File "{json.__file__}", line 3') == f'File "<python>/json{sep}__init__.py", line 3'
    assert clients.public_text(f'File "{numpy.__file__}"') == f'File "<site-packages>/numpy{sep}__init__.py"'


def test_a_symlinked_ml_backends_path_is_rewritten_as_written_and_as_resolved(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    clients = ClientPaths(tmp_path / "link", tmp_path / "scratch", tmp_path / "elsewhere" / "nereid.yaml")
    assert clients.public_text(f"{tmp_path}/link/m/a and {real}/m/b") == "m/a and m/b"


def test_text_the_client_sent_is_only_capped_never_rewritten(tmp_path):
    clients, root, _ = paths(tmp_path)
    echoed = PublicText(f"unknown model '{root}/m'")
    assert clients.public_text(echoed) == f"unknown model '{root}/m'"
    assert len(clients.public_text(PublicText("x" * (MESSAGE_LIMIT * 2)))) <= MESSAGE_LIMIT


def test_a_long_message_is_capped_after_its_paths_are_rewritten(tmp_path):
    clients, root, _ = paths(tmp_path)
    text = clients.public_text(f"{root}/m: " + "y" * (MESSAGE_LIMIT * 2))
    assert text.startswith("m: y") and len(text) <= MESSAGE_LIMIT


def test_a_version_folder_of_a_model_from_a_store_reads_as_the_models_folder(tmp_path) -> None:
    from nereid.client_paths import ClientPaths

    root = tmp_path / "cache" / "repositories" / "abc"
    paths = ClientPaths(root, tmp_path / "scratch", tmp_path / "etc" / "nereid.yaml")
    version = root / "m" / ".nereid-versions" / "0123456789abcdef" / "m"
    assert paths.public_text(f'File "{version}/main.py", line 3') == 'File "m/main.py", line 3'
    assert paths.public_text(f"{version} has no manifest.yaml") == "m has no manifest.yaml"
    assert paths.public_text(f"{root}/m/main.py") == "m/main.py"


def test_a_configuration_file_linked_the_configmap_way_is_named_relative_as_its_folder_names_it(tmp_path):
    """Found by the review hunt: with prod.yaml -> ..data/prod.yaml and ..data -> ..v1 (a Kubernetes ConfigMap),
    only the resolved folder (..v1) was made relative, and settings' origins name the file as linked: a reason
    showed the config folder's absolute path to clients."""
    config = tmp_path / "configmap"
    (config / "..v1").mkdir(parents=True)
    (config / "..v1" / "prod.yaml").write_text("")
    (config / "..data").symlink_to("..v1")
    (config / "prod.yaml").symlink_to("..data/prod.yaml")
    clients = ClientPaths(tmp_path / "ml-backends", tmp_path / "scratch", config / "prod.yaml")
    origin = f"{config / 'prod.yaml'}: models[0].runtime.warm_startt: unknown option"
    assert clients.public_text(origin) == "prod.yaml: models[0].runtime.warm_startt: unknown option"
