"""What one of dynamic mode's file watches follows: paths, what each resolves to, and the links on the way.

inotify watches an inode, never a name. A folder replaced under its name (``mv
new ml-backends``, a symlink switched, a Kubernetes ConfigMap's ``..data``
link swapped) or a model folder that is a symlink is followed only by a watch
started anew on what the path leads to now: the watcher
(:mod:`nereid.watch`) compares these to know when.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from nereid.storage import StorageError, local_model_folders


def links_on_the_way(path: Path) -> set[str]:
    """The symlinks met while resolving the absolute ``path`` (unresolved, as strings).

    For a ConfigMap's ``cfg/nereid.yaml -> ..data/nereid.yaml`` with ``..data ->
    ..v1``, that is ``cfg/nereid.yaml`` and ``cfg/..data``: replacing either
    changes what the path reads.
    """
    links: set[str] = set()
    pending = list(path.parts[1:])
    current = Path(path.anchor)
    hops = 0
    while pending and hops < 40:  # the kernel's own limit on links in one path (a loop ends here too)
        part = pending.pop(0)
        current = current.parent if part == ".." else current / part
        try:
            target = os.readlink(current)
        except OSError:  # not a link (or not there): go on
            continue
        hops += 1
        links.add(str(current))
        target_path = Path(target)
        pending = list(target_path.parts[1:] if target_path.is_absolute() else target_path.parts) + pending
        current = Path(target_path.anchor) if target_path.is_absolute() else current.parent
    return links


Identity = tuple[int, int]  # (st_dev, st_ino) of what a path resolves to


def identity_of(path: Path) -> Identity | None:
    """(st_dev, st_ino) of what ``path`` resolves to, None when nothing is there."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


@dataclass(frozen=True)
class WatchedPaths:
    """What one file watch follows: its paths, and what each resolved to when it started.

    inotify watches an inode, never a name: a folder replaced under the same
    name (``mv new ml-backends``, a symlink switched, ``rm -rf`` and a fresh
    copy) is followed only by a new watch, so a change of identity restarts it.
    """

    paths: tuple[Path, ...]
    identities: tuple[Identity | None, ...]

    @staticmethod
    def of(paths: Iterable[Path]) -> WatchedPaths:
        unique = tuple(sorted(set(paths)))
        return WatchedPaths(unique, tuple(identity_of(path) for path in unique))

    def differences(self, other: WatchedPaths) -> str:
        """What ``other`` follows that this does not, in words, for the log."""
        before = dict(zip(self.paths, self.identities))
        after = dict(zip(other.paths, other.identities))
        words = [f"{path} is another folder now" for path in after if path in before and before[path] != after[path]]
        words += [f"{path} added" for path in after if path not in before]
        words += [f"{path} no longer followed" for path in before if path not in after]
        return "; ".join(words)


def symlinked_folders(root: Path, follow_symlinks: bool) -> tuple[Path, ...]:
    """Where the model folders under ``root`` that are symlinks lead (resolved), for a watch of their own.

    A watch of ``root`` does not follow a link made after it started, nor a
    link re-pointed, nor (through the path it reports) one into a hidden
    folder of ``root``. Without ``follow_symlinks`` only targets inside
    ``root`` count (a model leading elsewhere is refused at load anyway); a
    target holding ``root`` is never watched (that would watch ``root``'s
    whole surroundings).
    """
    try:
        names = local_model_folders(root)
        real_root = root.resolve(strict=True)
    except (StorageError, OSError):
        return ()
    targets = set()
    for name in names:
        link = root / name
        try:
            if not link.is_symlink():
                continue
            target = link.resolve(strict=True)
        except (OSError, RuntimeError):  # gone, or a loop of links
            continue
        if target.is_dir() and _followed(target, real_root, follow_symlinks):
            targets.add(target)
    return tuple(sorted(targets))


def _followed(target: Path, real_root: Path, follow_symlinks: bool) -> bool:
    """Whether a model folder link's (resolved) ``target`` is followed: inside the resolved root, or anywhere with
    ``follow_symlinks``, but never a folder holding the root (that would watch its whole surroundings)."""
    return (target.is_relative_to(real_root) or follow_symlinks) and not real_root.is_relative_to(target)


def awaited_targets(root: Path, follow_symlinks: bool) -> tuple[Path, ...]:
    """Where the model folder links under ``root`` that lead nowhere yet would lead (resolved as far as can be).

    No watch can be started on a folder that is not there, and a listing of
    ``root`` skips the link: without these, a link made before its target was
    deployed (or whose target was removed and deployed again) was never
    loaded. Without ``follow_symlinks`` only targets inside ``root`` count, as
    for :func:`symlinked_folders`; a target inside ``root`` is given as the
    path under ``root`` too, as its events name it.
    """
    try:
        real_root = root.resolve(strict=True)
        with os.scandir(root) as listing:
            links = [Path(entry.path) for entry in listing if not entry.name.startswith(".") and entry.is_symlink()]
    except (OSError, RuntimeError):
        return ()
    awaited: set[Path] = set()
    for link in links:
        if os.path.exists(link):
            continue  # (a folder is watched where it leads: see symlinked_folders)
        target = Path(os.path.realpath(link))
        if os.path.lexists(target):
            continue  # a loop of links: resolving ends on one of them, where no folder is to arrive
        if not _followed(target, real_root, follow_symlinks):
            continue
        awaited.add(target)
        if target.is_relative_to(real_root):
            awaited.add(root / target.relative_to(real_root))
    return tuple(sorted(awaited))


def nearest_folder(path: Path) -> Path | None:
    """The nearest folder that is there among ``path``'s parents (None: none, which a real path never meets)."""
    for parent in path.parents:
        if parent.is_dir():
            return parent
    return None
