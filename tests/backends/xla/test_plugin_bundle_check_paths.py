"""``nereid bundle check PATH`` (the plugin's check_bundles): a path that is no folder is said to be so (exit 2),
not reported as a bundle."""

from __future__ import annotations

from pathlib import Path

import pytest

from nereid.backends.xla.export import examples
from nereid.cli import main


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    return examples.write_mlp(tmp_path_factory.mktemp("bundles"), provenance=False)


def run(capsys, *paths: Path) -> tuple[int, list[str], list[str]]:
    code = main(["bundle", "check", *map(str, paths)])
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err.splitlines()


def test_a_mistyped_path_is_no_such_folder(tmp_path, bundle, capsys) -> None:
    """It was "UNSERVABLE: ... missing manifest.yaml" and exit 1, as if a bundle were there; the other paths
    are still checked."""
    missing = tmp_path / "my_bundel"
    code, out, err = run(capsys, missing, bundle)
    assert code == 2
    assert err == [f"error: {missing}: no such file or folder"]
    assert out[0].startswith(f"{bundle}: servable:") and out[-1] == "1 bundle(s), 0 unservable"


@pytest.mark.parametrize("file_name,expected", [
    ("notes.txt", "is a file, not a folder: name a bundle's folder, or a folder of bundles"),
    ("manifest.yaml", "is a file, not a folder: name the bundle's folder ({parent}), not its manifest.yaml"),
])
def test_a_file_is_not_a_folder(tmp_path, capsys, file_name, expected) -> None:
    path = tmp_path / file_name
    path.write_text("name: x\n")
    code, out, err = run(capsys, path)
    assert code == 2 and out == ["0 bundle(s), 0 unservable"]
    assert err == [f"error: {path}: {expected.format(parent=tmp_path)}"]


def test_a_dangling_symlink_names_its_target(tmp_path, capsys) -> None:
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    code, _, err = run(capsys, link)
    assert code == 2 and err == [f"error: {link}: is a symlink to {tmp_path / 'gone'}, which does not exist"]
