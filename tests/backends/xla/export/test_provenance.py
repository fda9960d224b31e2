"""collect_provenance: git commit + working_tree.patch reconstruct the exported code exactly."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml

from nereid.backends.xla.export import collect_provenance, export_bundle

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def git(directory: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(directory), "-c", "user.name=t", "-c", "user.email=t@example.com",
                           *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture
def project(tmp_path) -> Path:
    root = tmp_path / "project"
    root.mkdir()
    git(root, "init", "-q", "-b", "main")
    git(root, "remote", "add", "origin", "https://example.com/project.git")
    (root / "train.py").write_text("lr = 0.1\n")
    git(root, "add", ".")
    git(root, "commit", "-q", "-m", "first")
    return root


def test_clean_tree(project) -> None:
    provenance = collect_provenance(project)
    fields = provenance.fields
    assert fields["git_commit"] == git(project, "rev-parse", "HEAD").strip()
    assert fields["git_remote"] == "https://example.com/project.git" and fields["git_branch"] == "main"
    assert fields["git_dirty"] is False and provenance.patch is None
    assert {"python", "nereid", "jax", "jaxlib", "numpy", "exported_at"} <= set(fields)


def test_dirty_tree_patch_reconstructs_the_code(project, tmp_path) -> None:
    (project / "train.py").write_text("lr = 0.01\n")
    (project / "new_layer.py").write_text("width = 64\n")
    (project / "blob.bin").write_bytes(bytes(range(256)))
    bundle = export_bundle(lambda x, w: x * w, [np.zeros(2, np.float32)], {"w": np.ones(2, np.float32)},
                           directory=tmp_path / "bundles" / "mul", provenance=collect_provenance(project))
    manifest = yaml.safe_load((bundle / "manifest.yaml").read_text())
    assert manifest["provenance"]["git_dirty"] is True
    assert manifest["provenance"]["working_tree_patch"] == "working_tree.patch"
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(project), str(clone)], check=True)
    git(clone, "checkout", "-q", manifest["provenance"]["git_commit"])
    git(clone, "apply", "--binary", str(bundle / "working_tree.patch"))
    for name in ("train.py", "new_layer.py", "blob.bin"):
        assert (clone / name).read_bytes() == (project / name).read_bytes(), name


def test_outside_a_repository(tmp_path) -> None:
    fields = collect_provenance(tmp_path).fields
    assert "git_commit" not in fields and "exported_at" in fields


def mul_bundle(directory: Path | str, **kwargs) -> Path:
    return export_bundle(lambda x, w: x * w, [np.zeros(2, np.float32)], {"w": np.ones(2, np.float32)},
                         directory=directory, **kwargs)


def test_a_re_export_leaves_its_own_folder_out_of_the_provenance(project, tmp_path, monkeypatch) -> None:
    """Exported twice into the work tree (the README's directory="ml-backends/my_model"), the second export
    recorded the first as an uncommitted change: git_dirty, and a working_tree.patch holding the old weights,
    manifest and patch, growing with every export."""
    monkeypatch.chdir(project)
    for _ in range(2):  # untracked bundle files of the previous export
        bundle = mul_bundle("ml-backends/mul")
        provenance = yaml.safe_load((bundle / "manifest.yaml").read_text())["provenance"]
        assert provenance["git_dirty"] is False, provenance
        assert "working_tree_patch" not in provenance and not (bundle / "working_tree.patch").exists()
    git(project, "add", ".")
    git(project, "commit", "-q", "-m", "the bundle")
    (project / "train.py").write_text("lr = 0.01\n")
    bundle = mul_bundle(project / "ml-backends" / "mul")  # tracked files, changed by the re-export
    provenance = yaml.safe_load((bundle / "manifest.yaml").read_text())["provenance"]
    assert provenance["git_dirty"] is True and provenance["working_tree_patch"] == "working_tree.patch"
    patch = (bundle / "working_tree.patch").read_text()
    assert "a/train.py" in patch and "ml-backends/mul" not in patch
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(project), str(clone)], check=True)
    git(clone, "checkout", "-q", provenance["git_commit"])
    git(clone, "apply", "--binary", str(bundle / "working_tree.patch"))
    assert (clone / "train.py").read_text() == "lr = 0.01\n"


def test_large_untracked_binaries_are_left_out_of_the_patch_and_named(project, tmp_path) -> None:
    """Another bundle's untracked weights went whole into the patch (1 MiB of weights, over 1 MiB of patch)."""
    (project / "other").mkdir()
    (project / "other" / "weights.safetensors").write_bytes(bytes(range(256)) * 8)  # 2048 bytes, binary
    (project / "notes.txt").write_text("text, not binary\n" * 200)  # as large, but text: kept
    (project / "small.bin").write_bytes(bytes(16))  # binary, under the limit: kept
    # Noticed by the stop 56 exporter hunt: a text data set of any size went whole into the patch.
    (project / "data.csv").write_text("1.0,2.0\n" * 1000)  # 8000 bytes of text, over its own limit: left out
    provenance = collect_provenance(project, max_untracked_binary_bytes=1024, max_untracked_text_bytes=4096)
    assert provenance.fields["git_dirty"] is True
    assert provenance.fields["working_tree_patch_left_out"] == ["data.csv (8000 bytes)",
                                                                "other/weights.safetensors (2048 bytes)"]
    assert b"notes.txt" in provenance.patch and b"small.bin" in provenance.patch
    assert b"weights.safetensors" not in provenance.patch and b"data.csv" not in provenance.patch
    (project / "data.csv").unlink()
    for index in range(22):  # named up to 20, then counted: the manifest stays small
        (project / f"blob{index:02d}.bin").write_bytes(bytes(2000))
    left_out = collect_provenance(project, max_untracked_binary_bytes=1024).fields["working_tree_patch_left_out"]
    assert len(left_out) == 21 and left_out[0] == "blob00.bin (2000 bytes)"
    assert left_out[-1] == "... and 3 more (6048 bytes)"


def test_regenerating_the_examples_twice_is_not_dirty(project, capsys) -> None:
    """The example bundles of the previous run counted as uncommitted changes of the next."""
    from nereid.backends.xla.export.examples import main

    root = project / "ml-backends"
    root.mkdir()
    for _ in range(2):
        assert main([str(root)]) == 0
        for name in ("mlp_bundle", "circle_select"):
            provenance = yaml.safe_load((root / name / "manifest.yaml").read_text())["provenance"]
            assert provenance["git_dirty"] is False, name


def test_a_remote_url_s_credentials_are_left_out(project) -> None:
    """Found by the exporter hunt: a CI checkout's https://oauth2:TOKEN@host/... remote went into every bundle."""
    git(project, "remote", "set-url", "origin", "https://oauth2:glpat-SECRET@gitlab.example.com/team/model.git")
    assert collect_provenance(project).fields["git_remote"] == "https://gitlab.example.com/team/model.git"
    git(project, "remote", "set-url", "origin", "git@github.com:team/model.git")  # (scp-like: no credentials)
    assert collect_provenance(project).fields["git_remote"] == "git@github.com:team/model.git"


def test_the_patch_applies_whatever_the_user_s_git_config_says(project, tmp_path) -> None:
    """Found by the exporter hunt: diff.noprefix, color.ui=always or diff.external in the user's git config made a
    working_tree.patch that `git apply` refused."""
    for key, value in (("diff.noprefix", "true"), ("color.ui", "always"), ("diff.external", "false")):
        git(project, "config", key, value)
    (project / "train.py").write_text("lr = 0.02\n")
    (project / "extra.py").write_text("depth = 3\n")
    bundle = export_bundle(lambda x, w: x * w, [np.zeros(2, np.float32)], {"w": np.ones(2, np.float32)},
                           directory=tmp_path / "bundles" / "mul", provenance=collect_provenance(project))
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(project), str(clone)], check=True)
    git(clone, "apply", "--binary", str(bundle / "working_tree.patch"))
    for name in ("train.py", "extra.py"):
        assert (clone / name).read_bytes() == (project / name).read_bytes(), name
