"""The xla plugin's hooks: which folders it claims, which files of a bucket it streams, its defaults' check.

(``nereid bundle check``, the command it adds: test_plugin_bundle_check*.py.)
"""

from __future__ import annotations

import os

import pytest

from nereid.backends.xla import plugin
from nereid.backends.xla.bundle import open_bundle
from nereid.backends.xla.model import create_model
from nereid.errors import ConfigError
from nereid.plugins import claim_folder, make_plugin_manager, streamed_files

SHARD = "weights-00001-of-00003.safetensors"


def test_the_plugin_claims_folders_with_a_manifest(tmp_path, add_bundle) -> None:
    manager = make_plugin_manager(load_entry_points=False)
    bundle = add_bundle(tmp_path, "mlp_bundle")
    assert claim_folder(manager, bundle).backend_name == "xla"
    other = tmp_path / "other"
    other.mkdir()
    (other / "main.py").write_text("")
    assert claim_folder(manager, other).backend_name == "python"
    declared = claim_folder(manager, other, "xla")
    assert declared.backend_name == "xla"
    with pytest.raises(ConfigError, match="missing manifest.yaml"):
        open_bundle(other)


def test_a_manifest_that_is_not_a_file_is_claimed_and_named(tmp_path, add_bundle) -> None:
    """A FIFO or folder as manifest.yaml left the folder "unclaimed" ("no backend claims the folder")."""
    manager = make_plugin_manager(load_entry_points=False)
    for kind, make in (("a FIFO", os.mkfifo), ("a directory", os.mkdir)):
        folder = add_bundle(tmp_path, "mlp_bundle", kind.split()[1].lower())
        (folder / "manifest.yaml").unlink()
        make(folder / "manifest.yaml")
        assert claim_folder(manager, folder).backend_name == "xla"
        with pytest.raises(ConfigError) as info:
            open_bundle(folder)
        assert str(info.value) == f"{folder / 'manifest.yaml'}: is {kind}, not a regular file"
    dangling = add_bundle(tmp_path, "mlp_bundle", "dangling")
    (dangling / "manifest.yaml").unlink()
    (dangling / "manifest.yaml").symlink_to("gone.yaml")
    assert claim_folder(manager, dangling).backend_name == "xla"
    with pytest.raises(ConfigError, match=r"manifest.yaml: is a symlink to a file that does not exist$"):
        open_bundle(dangling)


def test_the_xla_backend_streams_a_bundle_s_safetensors_and_none_of_a_meta_model_s() -> None:
    """Its nereid_streamed_files: every listed *.safetensors of a folder whose manifest.yaml is no meta model's
    (shards and subfolders too; an index, or weights named otherwise, are fetched), as the mirror did before
    it asked the backends; nothing of a meta model's folder (meta: true) or one without a manifest."""
    decide = streamed_files(make_plugin_manager(load_entry_points=False), "m")
    listing = ("manifest.yaml", "model.py", SHARD, "sub/part.safetensors", "weights.safetensors.index.json",
               "weights.bin")
    weights = {SHARD, "sub/part.safetensors"}

    def reading(manifest: bytes | None):
        return lambda path: manifest if path == "manifest.yaml" else None

    assert decide(listing, reading(b"format_version: '2.1'\n")) == weights
    assert decide(listing, reading(b"format_version: '2.1'\nmeta: true\n")) == frozenset()
    assert decide(listing[1:], reading(None)) == frozenset()
    # One that cannot be read (over 1 MiB, not UTF-8, not YAML) is a bundle's, as locally: its load names why.
    for unreadable in (None, b"\xff\xfe", b"meta: [true\n"):
        assert decide(listing, reading(unreadable)) == weights

def test_a_meta_models_manifest_is_not_claimed_unless_declared(tmp_path) -> None:
    """A manifest saying meta: true is the meta backend's; with none at all, only ``backend: xla`` claims."""
    assert plugin.nereid_claim_model(tmp_path, False) is None
    assert plugin.nereid_claim_model(tmp_path, True).create is create_model
    (tmp_path / "manifest.yaml").write_text("meta: true\n")
    assert not plugin.has_bundle_manifest(tmp_path) and plugin.nereid_claim_model(tmp_path, False) is None
    (tmp_path / "manifest.yaml").write_text("format_version: '2.1'\n")
    assert plugin.has_bundle_manifest(tmp_path) and plugin.nereid_claim_model(tmp_path, False).create is create_model
    assert plugin.nereid_claim_signs() == "manifest.yaml"


def test_a_fifo_manifest_is_claimed_without_being_opened(tmp_path) -> None:
    """Reading a FIFO would block the claim for good: it is claimed on its name alone."""
    os.mkfifo(tmp_path / "manifest.yaml")
    assert plugin.has_bundle_manifest(tmp_path)


@pytest.mark.parametrize("defaults, problem", [
    ({"batch_sizes": "smallest"}, "backends.xla.batch_sizes: must be one of all, largest, got 'smallest'"),
    ({"compile_everything": True}, "backends.xla.compile_everything: unknown option of the xla backend"),
    ({"weights_read_threads": 0}, "backends.xla.weights_read_threads: must be an integer >= 1, got 0"),
])
def test_a_mistake_in_the_backends_defaults_is_refused_naming_the_key(defaults, problem) -> None:
    with pytest.raises(ConfigError) as caught:
        plugin.nereid_check_defaults(defaults, "backends.xla")
    assert str(caught.value).startswith(problem), caught.value


def test_good_defaults_pass_the_check() -> None:
    assert plugin.nereid_check_defaults({"batch_sizes": "largest", "executable_cache": False}, "backends.xla") is None
