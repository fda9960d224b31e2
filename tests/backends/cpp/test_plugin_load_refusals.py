"""backends/cpp/plugin.py: what a cpp model refuses at load, before any compile: runtime options (it has
none), a FIFO for main.cpp.

Run through ``nereid check``, which loads each model as the server does; no compiler is needed.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from nereid.cli import main as cli_main

EXAMPLES = Path(__file__).resolve().parents[3] / "ml-backends"


def check(repo, capsys, models_yaml: str, extra: str = "") -> dict[str, str]:
    """``nereid check``'s line per model (it fails: every model here has a problem)."""
    config = repo.write_config(models_yaml)
    if extra:
        config.write_text(config.read_text() + extra)
    assert cli_main(["check", "--config", str(config)]) == 1
    return {line.split(":")[0]: line for line in capsys.readouterr().out.splitlines()}


def test_runtime_options_and_backend_defaults_are_refused(repo, capsys) -> None:
    """``runtime: {warm_start: false, typo_option: 1}`` and ``backends: {cpp: {typo_default: 2}}`` were accepted
    silently, while the README says runtime options are checked by the backend."""
    shutil.copytree(EXAMPLES / "cpp_scale", repo.models_dir / "scale", ignore=shutil.ignore_patterns(".cache"))
    lines = check(repo, capsys, "- {name: scale, runtime: {warm_start: false}}\n")
    assert lines["scale"] == (f"scale: UNAVAILABLE: model 'scale': {repo.root / 'nereid.yaml'}: models[0].runtime."
                              "warm_start: unknown option of the cpp backend (it has no runtime options), got false")
    assert not (repo.models_dir / "scale" / ".cache").exists()  # refused before the compile
    lines = check(repo, capsys, "- {name: scale}\n", "backends:\n  cpp: {typo_default: 2}\n")
    assert lines["scale"] == (f"scale: UNAVAILABLE: model 'scale': {repo.root / 'nereid.yaml'}: backends.cpp."
                              "typo_default: unknown option of the cpp backend (it has no runtime options), got 2")


def test_a_fifo_for_main_cpp_is_named_as_such(repo, capsys) -> None:
    """It was no file at all to the claim: "no backend claims the folder"."""
    folder = repo.models_dir / "scale"
    shutil.copytree(EXAMPLES / "cpp_scale", folder)
    (folder / "main.cpp").unlink()
    os.mkfifo(folder / "main.cpp")
    lines = check(repo, capsys, "- {name: scale}\n")
    assert lines["scale"] == f"scale: UNAVAILABLE: model 'scale': {folder / 'main.cpp'}: is a FIFO, not a regular file"


@pytest.mark.timeout(30)
def test_a_header_main_cpp_includes_that_is_a_fifo_is_refused_at_once(repo, capsys) -> None:
    """Defect: the build key skipped a header that is not a regular file, and the compiler then waited on the
    FIFO at its #include until the 600 s compile limit, holding the load."""
    folder = repo.models_dir / "scale"
    shutil.copytree(EXAMPLES / "cpp_scale", folder, ignore=shutil.ignore_patterns(".cache"))
    (folder / "include").mkdir()
    os.mkfifo(folder / "include" / "x.h")
    (folder / "main.cpp").write_text('#include "include/x.h"\n' + (folder / "main.cpp").read_text())
    lines = check(repo, capsys, "- {name: scale}\n")
    assert lines["scale"] == (f"scale: UNAVAILABLE: model 'scale': {folder / 'include' / 'x.h'}: is a FIFO, not a "
                              "regular file; the build reads every C++ source and header in the model folder: make it "
                              "a regular file or remove it")
    assert not (folder / ".cache").exists()  # refused before any compile
