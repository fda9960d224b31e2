"""Model folders written by an attacker: every loader fails fast, names the file and the problem,
never quotes megabytes back, and never blocks on something that is not a file."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from nereid.backends.xla.bundle import open_bundle
from nereid.backends.xla.manifest import load_manifest, parse_manifest_text
from nereid.config_document import load_yaml
from nereid.errors import ConfigError
from nereid.signature import MAX_DECLARED_TENSORS, MAX_RANK, load_textproto_signature

REPO_ROOT = Path(__file__).resolve().parents[2]

ALIAS_BOMB = """
a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x"]
b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
format_version: [*g, *g, *g, *g, *g, *g, *g, *g, *g]
"""


def test_yaml_alias_bomb_in_a_manifest_is_refused_at_once(tmp_path):
    """A 1 KB alias bomb froze the server for 8.6 s; its 312 MB repr became the reason."""
    started = time.thread_time()  # (CPU time: a loaded machine's waits do not count)
    with pytest.raises(ConfigError) as info:
        parse_manifest_text(ALIAS_BOMB, tmp_path / "manifest.yaml")
    assert time.thread_time() - started < 1
    message = str(info.value)
    assert "manifest.yaml" in message and "anchors (&a) are not allowed" in message
    assert len(message) < 4096


def test_aliases_are_refused_in_nereid_yaml_too(tmp_path):
    with pytest.raises(ConfigError, match=r"aliases \(\*grace\) are not allowed"):
        load_yaml("x: 1\ny: *grace\n", tmp_path / "nereid.yaml")


def test_a_long_value_in_a_config_error_is_cut(tmp_path):
    document = "format_version: " + "v" * 100_000 + "\n"
    with pytest.raises(ConfigError) as info:
        parse_manifest_text(document, tmp_path / "manifest.yaml")
    assert "format_version: unsupported bundle format" in str(info.value)
    assert len(str(info.value)) <= 4096 and "characters cut" in str(info.value)


def test_an_integer_too_long_to_convert_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="manifest.yaml: not valid YAML: an integer of 100000 digits is too long"):
        parse_manifest_text("format_version: " + "9" * 100_000 + "\n", tmp_path / "manifest.yaml")


def test_a_textproto_with_100k_inputs_is_refused_fast_with_the_limit(tmp_path):
    """A 100k-input textproto took 85 s to check (a names.count per name)."""
    path = tmp_path / "model_inference.textproto"
    path.write_text("".join(f'input {{ name: "i{i}" data_type: "FP32" dims: [1] }}\n' for i in range(100_000)))
    started = time.thread_time()  # (CPU time: a loaded machine's waits do not count)
    with pytest.raises(ConfigError, match=r"model_inference.textproto: is \d+ bytes, more than the 1048576-byte"):
        load_textproto_signature(path)
    assert time.thread_time() - started < 2


def test_declared_inputs_and_rank_are_capped(tmp_path):
    path = tmp_path / "model_inference.textproto"
    count = MAX_DECLARED_TENSORS + 1
    path.write_text("".join(f'input{{name:"{i}" data_type:"FP32" dims:1}}' for i in range(count)))
    with pytest.raises(ConfigError, match=f"declares {count} inputs; at most {MAX_DECLARED_TENSORS}"):
        load_textproto_signature(path)
    path.write_text(f'input {{ name: "x" data_type: "FP32" dims: [{", ".join(["1"] * (MAX_RANK + 1))}] }}')
    with pytest.raises(ConfigError, match=f"declares {MAX_RANK + 1} dims; at most {MAX_RANK}"):
        load_textproto_signature(path)


def test_duplicate_names_among_many_inputs_are_found_in_linear_time(tmp_path):
    path = tmp_path / "model_inference.textproto"
    names = [f"i{i}" for i in range(MAX_DECLARED_TENSORS - 1)] + ["i7"]
    path.write_text("".join(f'input{{name:"{n}" data_type:"FP32" dims:1}}' for n in names))
    started = time.thread_time()  # (CPU time: a loaded machine's waits do not count)
    with pytest.raises(ConfigError, match="duplicate input name"):
        load_textproto_signature(path)
    assert time.thread_time() - started < 2


def test_a_binary_textproto_names_the_file_and_the_problem(tmp_path):
    """A binary textproto gave a bare UTF-8 decode error, quoting the bad byte."""
    path = tmp_path / "model_inference.textproto"
    path.write_bytes(b"input_shape: [4]\n\xff\xfe\x00\x01")
    with pytest.raises(ConfigError) as info:
        load_textproto_signature(path)
    assert str(info.value) == (f"{path}: not UTF-8 text (invalid byte at offset 17); is it a binary file?")


def test_a_fifo_in_place_of_a_textproto_is_refused_without_blocking(tmp_path):
    path = tmp_path / "model_inference.textproto"
    os.mkfifo(path)
    with pytest.raises(ConfigError, match="model_inference.textproto: is a FIFO, not a regular file"):
        load_textproto_signature(path)


def test_a_fifo_in_place_of_a_program_file_is_named_as_such(tmp_path):
    """A FIFO as model.b1.mlir gave 'missing model.b1.mlir (program files present: model.b1.mlir)'."""
    bundle = tmp_path / "mlp_bundle"
    shutil.copytree(REPO_ROOT / "ml-backends" / "mlp_bundle", bundle)
    (bundle / "model.b1.mlir").unlink()
    os.mkfifo(bundle / "model.b1.mlir")
    with pytest.raises(ConfigError) as info:
        open_bundle(bundle)
    assert str(info.value) == f"{bundle / 'model.b1.mlir'}: is a FIFO, not a regular file (the program for batch size 1)"


def test_a_fifo_in_place_of_the_manifest_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "manifest.yaml")
    with pytest.raises(ConfigError, match="manifest.yaml: is a FIFO, not a regular file"):
        load_manifest(tmp_path / "manifest.yaml")
    with pytest.raises(ConfigError, match="manifest.yaml: is a FIFO, not a regular file"):
        open_bundle(tmp_path)


def test_a_huge_manifest_is_refused_by_size(tmp_path):
    path = tmp_path / "manifest.yaml"
    with open(path, "wb") as out:
        out.truncate(2 << 20)
    with pytest.raises(ConfigError, match=r"manifest.yaml: is 2097152 bytes, more than the 1048576-byte limit"):
        load_manifest(path)


def test_a_deeply_nested_textproto_names_the_file(tmp_path):
    path = tmp_path / "model_inference.textproto"
    path.write_text("input { " * 50_000)
    with pytest.raises(ConfigError) as info:
        load_textproto_signature(path)
    assert str(info.value).startswith(f"{path}") and len(str(info.value)) < 4096


def test_a_binary_or_fifo_nereid_yaml_is_a_config_error(tmp_path):
    from nereid.settings import load_settings

    config = tmp_path / "nereid.yaml"
    config.write_bytes(b"server:\n  bind_addr: \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"nereid.yaml: not UTF-8 text \(invalid byte at offset 21\)"):
        load_settings(config)
    config.unlink()
    os.mkfifo(config)
    with pytest.raises(ConfigError, match="nereid.yaml: is a FIFO, not a regular file"):
        load_settings(config)


def test_a_symlink_leading_outside_is_refused_without_revealing_its_target(repo, serve, tmp_path_factory):
    """The refusal used to print the link's absolute target ("... is a symlink to /srv/secret/slow")."""
    import subprocess

    from support import NEREID, textproto_single

    outside = tmp_path_factory.mktemp("private-place")  # neither in ml_backends_path nor beside nereid.yaml
    (outside / "model_inference.textproto").write_text(textproto_single())
    (outside / "main.py").write_text("print()\n")
    (repo.models_dir / "outlink").symlink_to(outside)
    folder = repo.add("inlink", None, main_py="print()\n")
    (folder / "model_inference.textproto").symlink_to(outside / "model_inference.textproto")
    server = serve(repo.write_config())
    reasons = {m.name: m.reason for m in server.client.get_model_repository_index().models}
    assert reasons["outlink"].startswith("outlink is a symlink to a path outside ml_backends_path; set "
                                         "server.follow_symlinks: true"), reasons["outlink"]
    assert reasons["inlink"].startswith("inlink/model_inference.textproto is a symlink to a path outside "
                                        "ml_backends_path"), reasons["inlink"]
    result = subprocess.run([*NEREID, "check", "--config", str(repo.root / "nereid.yaml")], capture_output=True,
                            text=True, timeout=60)
    assert "outlink: UNAVAILABLE:" in result.stdout and "inlink: UNAVAILABLE:" in result.stdout
    for text in (*reasons.values(), result.stdout):
        assert "private-place" not in text, text
