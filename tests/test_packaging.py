"""The wheel holds every subpackage under `nereid`, and nothing installs top-level `core` or `backends`."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_wheel_maps_core_and_backends_under_nereid(tmp_path: Path) -> None:
    # Built from a copy: setuptools builds in the source tree, and left a build/ folder in the checkout whose
    # stale copies of every module turned up in searches of the code.
    source = tmp_path / "source"
    shutil.copytree(REPO_ROOT, source, ignore=shutil.ignore_patterns(".git", "build", "dist", "*.egg-info",
                                                                        "__pycache__", ".cache", ".pytest_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
                    "-w", str(tmp_path), str(source)], check=True, timeout=300, cwd=tmp_path)
    (wheel,) = tmp_path.glob("nereid-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    packages = {name.rsplit("/", 1)[0] for name in names if name.endswith("/__init__.py")}
    expected = {str(p.parent.relative_to(REPO_ROOT)).replace("core", "nereid", 1).replace(
        "backends", "nereid/backends", 1) for p in [*REPO_ROOT.glob("core/**/__init__.py"),
                                                     *REPO_ROOT.glob("backends/**/__init__.py")]}
    assert packages == expected
    assert not [name for name in names if name.startswith(("core/", "backends/"))]
    assert "nereid/_proto/grpc_service_pb2.py" in names


def test_core_imports_no_backend() -> None:
    """Backends own their code: nothing under core/ imports nereid.backends (built-ins are registered by name)."""
    import ast

    core = Path(__file__).resolve().parents[1] / "core"
    offenders = []
    for path in core.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(core)}: {name}" for name in names if name.startswith("nereid.backends")]
    assert offenders == []


def test_the_protocol_modules_only_convert() -> None:
    """The gRPC and HTTP surfaces go through the data plane alone: they import neither the repository nor the
    scheduler, nor reach the repository through the data plane (they once did, for its path redaction)."""
    import ast

    protocol = Path(__file__).resolve().parents[1] / "core" / "protocol"
    offenders = []
    for path in protocol.glob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}: imports {name}" for name in names
                          if name in ("nereid.repository", "nereid.scheduler")]
            if isinstance(node, ast.Attribute) and node.attr == "repository":
                offenders.append(f"{path.name}:{node.lineno}: reaches .repository")
    assert offenders == []
