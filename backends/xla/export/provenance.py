"""Best-effort reproducibility metadata for an exported bundle.

The manifest's ``provenance`` block records the git remote, commit, tree and
branch of the exporting code, whether the work tree was dirty, the versions of
Python, nereid, jax, jaxlib and numpy, and when the bundle was exported. On a
dirty tree the uncommitted changes (tracked edits and untracked files) go to
``working_tree.patch`` beside the manifest rather than into it, so that
``git checkout <git_commit> && git apply --binary working_tree.patch``
reconstructs the exported code exactly.

Two kinds of files are kept out of the patch. The folders being exported to
(``exclude``) are left out of the dirty check and the patch altogether: else a
re-export would record the previous export (its weights and its own patch) as an
uncommitted change, and the patch would grow with every export. Untracked binary
files larger than ``max_untracked_binary_bytes`` (other bundles' weights, data
sets), and untracked text files larger than ``max_untracked_text_bytes`` (a CSV
data set, a log), are left out of the patch and named, with their sizes, in the
``working_tree_patch_left_out`` field: the patch then reconstructs everything else.
"""

from __future__ import annotations

import datetime
import os
import platform
import stat
import subprocess
import urllib.parse
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable

PATCH_FILE = "working_tree.patch"
# Untracked binary files above this size are left out of the patch (and named in LEFT_OUT_FIELD): a source
# tree's own binaries are small, where model weights and data sets would make the patch as big as they are.
MAX_UNTRACKED_BINARY_BYTES = 1 << 20
# Untracked text files above this size are left out too: sources are far smaller, where a CSV data set or a log of
# gigabytes went whole into every bundle's patch (and through git diff's memory).
MAX_UNTRACKED_TEXT_BYTES = 16 << 20
LEFT_OUT_FIELD = "working_tree_patch_left_out"
# The files left out are named up to this many: the manifest stays a few kilobytes whatever the tree holds.
MAX_LEFT_OUT_NAMED = 20
# git's own test of a binary file: a NUL byte among the first 8000.
_BINARY_SNIFF_BYTES = 8000
_VERSIONED = ("nereid", "jax", "jaxlib", "numpy", "ml_dtypes")


@dataclass(frozen=True)
class Provenance:
    """The manifest's provenance fields and, for a dirty tree, the patch text."""

    fields: dict[str, Any] = field(default_factory=dict)
    patch: bytes | None = None


def collect_provenance(repo_dir: Path | str | None = None, *, include_patch: bool = True,
                       exclude: Iterable[Path | str] = (),
                       max_untracked_binary_bytes: int = MAX_UNTRACKED_BINARY_BYTES,
                       max_untracked_text_bytes: int = MAX_UNTRACKED_TEXT_BYTES) -> Provenance:
    """Provenance of the code in ``repo_dir`` (default: the working directory). Never raises.

    Outside a git repository the git fields are simply absent.
    ``include_patch=False`` records the dirty flag without the diff.
    ``exclude``: folders (the bundle being exported) that are neither part of the
    dirty check nor of the patch, wherever they lie inside the work tree (a
    relative path is taken from the working directory, as ``open`` takes it).
    Untracked binary files over ``max_untracked_binary_bytes``, and text files over
    ``max_untracked_text_bytes``, are left out of the patch and named in
    ``working_tree_patch_left_out``.
    """
    directory = Path(repo_dir) if repo_dir is not None else Path.cwd()
    fields: dict[str, Any] = {}
    patch: bytes | None = None
    top = _git(directory, "rev-parse", "--show-toplevel")
    if top is not None:
        root = Path(top.decode().strip())
        pathspec = _excluding(root, exclude)
        for name, args in (("git_remote", ("config", "--get", "remote.origin.url")),
                           ("git_commit", ("rev-parse", "HEAD")),
                           ("git_tree", ("rev-parse", "HEAD^{tree}")),
                           ("git_branch", ("rev-parse", "--abbrev-ref", "HEAD"))):
            value = _git(root, *args)
            if value is not None and value.strip():
                fields[name] = value.decode(errors="replace").strip()
        if "git_remote" in fields:
            fields["git_remote"] = _without_credentials(fields["git_remote"])
        status = _git(root, "status", "--porcelain", "--", *pathspec)
        if status is not None:
            fields["git_dirty"] = bool(status.strip())
            if fields["git_dirty"] and include_patch:
                patch, left_out = _working_tree_patch(root, pathspec, max_untracked_binary_bytes,
                                                      max_untracked_text_bytes)
                if patch:
                    fields["working_tree_patch"] = PATCH_FILE
                if left_out:
                    fields[LEFT_OUT_FIELD] = _named(left_out)
    fields["python"] = platform.python_version()
    for package in _VERSIONED:
        try:
            fields[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    fields["exporter"] = "nereid.backends.xla.export"
    fields["exported_at"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return Provenance(fields, patch)


def _excluding(root: Path, folders: Iterable[Path | str]) -> list[str]:
    """git pathspecs leaving out each of ``folders`` that lies inside the work tree at ``root``.

    ``top`` makes the path relative to the root whatever git's working directory,
    ``literal`` keeps a ``*`` or ``[`` in a folder's name from being a pattern.
    A folder outside the work tree (or the whole tree) has nothing to leave out.
    """
    specs: list[str] = []
    real_root = root.resolve()
    for folder in folders:
        try:
            relative = Path(folder).resolve().relative_to(real_root)
        except (OSError, RuntimeError, ValueError):  # outside the work tree, or a symlink loop
            continue
        if relative.parts:
            specs.append(f":(top,literal,exclude){relative.as_posix()}")
    return specs


# What makes `git diff` write a patch `git apply` takes, whatever the user's git config says (diff.noprefix,
# color.ui=always, diff.external, a textconv driver, diff.relative): each made a patch that did not apply (the
# exporter hunt).
_PLAIN_DIFF = ("--no-color", "--no-ext-diff", "--no-textconv", "--no-relative", "--src-prefix=a/",
               "--dst-prefix=b/")


def _without_credentials(remote: str) -> str:
    """``remote`` without the user and password of a URL (``https://oauth2:TOKEN@host/repo.git``, a CI checkout's):
    the token went into every bundle (the exporter hunt). An scp-like ``git@host:repo`` has none, and stays."""
    parts = urllib.parse.urlsplit(remote)
    if not parts.scheme or "@" not in parts.netloc:
        return remote
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=host))


# (name, size in bytes) of each untracked file left out of the patch.
LeftOut = list[tuple[str, int]]


def _working_tree_patch(root: Path, pathspec: list[str], max_binary_bytes: int,
                        max_text_bytes: int) -> tuple[bytes | None, LeftOut]:
    """Tracked changes against HEAD plus the untracked, non-ignored files, as one binary patch, restricted to
    ``pathspec``; and the untracked files left out of it (binary over ``max_binary_bytes``, text over
    ``max_text_bytes``), with their sizes."""
    tracked = _git(root, "diff", *_PLAIN_DIFF, "--binary", "HEAD", "--", *pathspec)
    if tracked is None:
        return None, []
    parts = [tracked]
    left_out: LeftOut = []
    untracked = _git(root, "ls-files", "--others", "--exclude-standard", "-z", "--", *pathspec)
    for name in (untracked or b"").split(b"\0"):
        if not name:
            continue
        size = _too_large_size(root / os.fsdecode(name), max_binary_bytes, max_text_bytes)
        if size is not None:
            # Named in the manifest, which YAML must be able to write: undecodable bytes are replaced.
            left_out.append((name.decode(errors="replace"), size))
            continue
        # --no-index exits 1 when the files differ, which they always do here.
        diff = _git(root, "diff", *_PLAIN_DIFF, "--binary", "--no-index", "--", "/dev/null", os.fsdecode(name),
                    ok_codes=(0, 1))
        if diff:
            parts.append(diff)
    return b"".join(parts) or None, left_out


def _too_large_size(path: Path, max_binary_bytes: int, max_text_bytes: int) -> int | None:
    """The size of ``path`` if it is a regular binary file over ``max_binary_bytes`` or a text file over
    ``max_text_bytes``, else None (it goes in the patch).

    Only a regular file is read, checked once opened (without blocking, without following a symlink): a FIFO
    would block the export. One that cannot be read is left to git.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size <= min(max_binary_bytes, max_text_bytes):
            return None
        head = os.read(fd, _BINARY_SNIFF_BYTES)
    except OSError:
        return None
    finally:
        os.close(fd)
    return info.st_size if info.st_size > (max_binary_bytes if b"\0" in head else max_text_bytes) else None


def _named(left_out: LeftOut) -> list[str]:
    """``"path (N bytes)"`` for each file left out, the first MAX_LEFT_OUT_NAMED, then how many more."""
    named = [f"{name} ({size} bytes)" for name, size in left_out[:MAX_LEFT_OUT_NAMED]]
    rest = left_out[MAX_LEFT_OUT_NAMED:]
    if rest:
        named.append(f"... and {len(rest)} more ({sum(size for _, size in rest)} bytes)")
    return named


def _git(directory: Path, *args: str, ok_codes: tuple[int, ...] = (0,)) -> bytes | None:
    try:
        result = subprocess.run(["git", "-C", str(directory), *args], capture_output=True, timeout=60,
                                check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout if result.returncode in ok_codes else None
