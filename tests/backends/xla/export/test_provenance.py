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
