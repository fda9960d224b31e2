"""Best-effort reproducibility metadata for an exported bundle.

The manifest's ``provenance`` block records the git remote, commit, tree and
branch of the exporting code, whether the work tree was dirty, the versions of
Python, nereid, jax, jaxlib and numpy, and when the bundle was exported. On a
dirty tree the uncommitted changes (tracked edits and untracked files) go to
``working_tree.patch`` beside the manifest rather than into it, so that
``git checkout <git_commit> && git apply --binary working_tree.patch``
reconstructs the exported code exactly.
"""

from __future__ import annotations

import datetime
import platform
import subprocess
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

PATCH_FILE = "working_tree.patch"
_VERSIONED = ("nereid", "jax", "jaxlib", "numpy", "ml_dtypes")


@dataclass(frozen=True)
class Provenance:
    """The manifest's provenance fields and, for a dirty tree, the patch text."""

    fields: dict[str, Any] = field(default_factory=dict)
    patch: bytes | None = None


def collect_provenance(repo_dir: Path | str | None = None, *, include_patch: bool = True) -> Provenance:
    """Provenance of the code in ``repo_dir`` (default: the working directory). Never raises.

    Outside a git repository the git fields are simply absent.
    ``include_patch=False`` records the dirty flag without the diff.
    """
    directory = Path(repo_dir) if repo_dir is not None else Path.cwd()
    fields: dict[str, Any] = {}
    patch: bytes | None = None
    top = _git(directory, "rev-parse", "--show-toplevel")
    if top is not None:
        root = Path(top.decode().strip())
        for name, args in (("git_remote", ("config", "--get", "remote.origin.url")),
                           ("git_commit", ("rev-parse", "HEAD")),
                           ("git_tree", ("rev-parse", "HEAD^{tree}")),
                           ("git_branch", ("rev-parse", "--abbrev-ref", "HEAD"))):
            value = _git(root, *args)
            if value is not None and value.strip():
                fields[name] = value.decode(errors="replace").strip()
        status = _git(root, "status", "--porcelain")
        if status is not None:
            fields["git_dirty"] = bool(status.strip())
            if fields["git_dirty"] and include_patch:
                patch = _working_tree_patch(root)
                if patch:
                    fields["working_tree_patch"] = PATCH_FILE
    fields["python"] = platform.python_version()
    for package in _VERSIONED:
        try:
            fields[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    fields["exporter"] = "nereid.backends.xla.export"
    fields["exported_at"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return Provenance(fields, patch)


def _working_tree_patch(root: Path) -> bytes | None:
    """Tracked changes against HEAD plus every untracked, non-ignored file, as one binary patch."""
    tracked = _git(root, "diff", "--binary", "HEAD")
    if tracked is None:
        return None
    parts = [tracked]
    untracked = _git(root, "ls-files", "--others", "--exclude-standard", "-z")
    for name in (untracked or b"").split(b"\0"):
        if name:
            # --no-index exits 1 when the files differ, which they always do here.
            diff = _git(root, "diff", "--binary", "--no-index", "--", "/dev/null", name.decode(),
                        ok_codes=(0, 1))
            if diff:
                parts.append(diff)
    return b"".join(parts) or None


def _git(directory: Path, *args: str, ok_codes: tuple[int, ...] = (0,)) -> bytes | None:
    try:
        result = subprocess.run(["git", "-C", str(directory), *args], capture_output=True, timeout=60,
                                check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout if result.returncode in ok_codes else None
