"""What the dynamic repository compares: each model folder's state, and the changes between two looks.

A local folder's state is its files' stamps (names, sizes, mtimes, inodes,
ctimes) and a content identity that survives a copy; a store's folder's is
its objects' names, sizes and ETags. :func:`plan_changes` turns two looks into
renames, removals, additions and edits. Only reads: the watcher
(:mod:`nereid.watch`) decides what to do, and the repository stamps a folder
before each load with :func:`folder_stamp`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from nereid.files import MAX_FOLDER_DEPTH, folder_depth, folder_gone
from nereid.storage import StoreURL, local_model_folders

if TYPE_CHECKING:
    from nereid.storage.mirror import RemoteFolder

SAMPLE_BYTES = 64 * 1024  # hashed from each end of a file for the content identity
# What a transfer's temporary file is named: rsync's ``.name.XXXXXX`` (six random letters and digits).
TRANSFER_TEMPORARY = re.compile(r"\..+\.[A-Za-z0-9]{6}")


def ignored_name(name: str) -> bool:
    """Files and folders that never make a model change: hidden ones and editor leftovers."""
    return (name.startswith(".") or name.startswith("#") or name.endswith("~")
            or name.endswith((".swp", ".swx", ".tmp")) or name == "__pycache__" or name.endswith(".pyc"))


# One file of a local folder as a scan saw it: (relative path, size, mtime_ns, inode, ctime_ns). The inode and
# ctime catch a file replaced by one with the same size and mtime (tar, zip, OCI layers and reproducible builds
# fix mtimes, to 1980 say): utime() and tar can set mtime but never ctime, and a new file has a new inode.
FileStamp = tuple[str, int, int, int, int]
Stamp = tuple[tuple[object, ...], ...]


@dataclass(frozen=True)
class FolderState:
    """What a scan saw of one model folder.

    ``stamp`` changes whenever a file is written or replaced (names, sizes,
    mtimes, inodes, ctimes); ``identity`` is the same for two copies of the
    same files (names, sizes and a hash of each file's first and last bytes),
    so that a ``mv`` and a copy-then-delete are both recognised as a rename.
    ``hidden_mtime_ns`` is the newest mtime of the folder's hidden files (not
    ``.cache/``): never a change by itself, but a hidden file written just now
    (rsync's ``.name.XXXXXX`` being filled) means a transfer is under way.
    """

    stamp: Stamp
    identity: str
    hidden_mtime_ns: int = field(default=0, compare=False)
    # Whether ``identity`` covers every byte (a local folder whose files are all within two samples; a store's
    # folder, named by its objects' ETags): only then does an equal identity prove a copy equal (see plan_changes).
    complete: bool = field(default=True, compare=False)


def folder_stamp(folder: Path) -> tuple[tuple[FileStamp, ...], int] | None:
    """The stamp of one local model folder and the newest mtime of its hidden files (None when it vanished).

    Only ``stat`` calls: cheap enough to take before every load (see
    :meth:`ModelRepository.loaded_stamp`). Subfolders deeper than
    :data:`~nereid.files.MAX_FOLDER_DEPTH` are left out.
    """
    files: list[FileStamp] = []
    hidden_mtime_ns = 0
    for directory, subdirs, names in os.walk(folder):
        subdirs[:] = sorted(d for d in subdirs if not ignored_name(d))
        if folder_depth(os.fspath(folder), directory) >= MAX_FOLDER_DEPTH:
            subdirs[:] = []  # (not walked deeper: the model's load refuses the folder, naming the depth)
        for name in subdirs:
            path = os.path.join(directory, name)
            if os.path.islink(path):  # (not walked into) the link itself: re-pointed (ln -sfn), it is a new link
                with contextlib.suppress(OSError):
                    files.append(_file_stamp(folder, path, os.lstat(path)))
        for name in sorted(names):
            path = os.path.join(directory, name)
            if ignored_name(name):
                if TRANSFER_TEMPORARY.fullmatch(name):
                    # A transfer's temporary file (rsync's .name.XXXXXX): when was it last written? Only one named
                    # so: a hidden file a model writes itself (.last_run.txt, as the README advises) held up every
                    # edit of its folder for 20 settle times while the model served (found by a hunt).
                    with contextlib.suppress(OSError):
                        hidden_mtime_ns = max(hidden_mtime_ns, os.stat(path).st_mtime_ns)
                continue
            info = _file_info(path)
            if info is not None:
                files.append(_file_stamp(folder, path, info))
    # Only the folder itself gone means it vanished (os.walk of a missing folder yields nothing): a file inside
    # that cannot be stat-ed (a link to nothing, one removed meanwhile) is a change of the folder, not its end.
    if folder_gone(folder):  # (one that cannot be looked at is there: its load says why it cannot be read)
        return None
    return tuple(files), hidden_mtime_ns


def _file_stamp(folder: Path, path: str, info: os.stat_result) -> FileStamp:
    """The stamp of the file ``path`` in ``folder``, from its stat ``info``."""
    return os.path.relpath(path, folder), info.st_size, info.st_mtime_ns, info.st_ino, info.st_ctime_ns


def _file_info(path: str) -> os.stat_result | None:
    """The file's stat, or the link's own where it leads nowhere (yet); None when the name is gone."""
    try:
        return os.stat(path)
    except OSError:
        try:
            return os.lstat(path)
        except OSError:
            return None


def scan_folder(folder: Path) -> FolderState | None:
    """The state of one model folder (None when it vanished during the scan).

    The content identity is computed again only when the stamp changed: a file with the same name, size,
    mtime, inode and ctime has the same bytes. Every scan read the ends of every file of every model folder
    (4.3 s of CPU in 5 s for a folder of 30,000 files and a file written beside it every 0.1 s; a bug hunt).
    """
    stamped = folder_stamp(folder)
    if stamped is None:
        return None
    files, hidden_mtime_ns = stamped
    key = os.fspath(folder)
    with _IDENTITIES_LOCK:
        known = _IDENTITIES.get(key)
    if known is not None and known[0] == files:
        return FolderState(files, known[1], hidden_mtime_ns, known[2])
    state = _identified(folder, files, hidden_mtime_ns)
    with _IDENTITIES_LOCK:  # (scans run on I/O threads, several at once)
        _IDENTITIES[key] = (files, state.identity, state.complete)
    return state


# The last identity computed for each folder (by path), with the stamp it was computed for (see scan_folder). Kept
# for every folder a scan of its repository finds, and forgotten with the folder (see scan_repository): a cap that
# dropped the oldest missed every folder, scanned in the same order each time, past its size (the hunt of this).
_IDENTITIES: dict[str, tuple[tuple[FileStamp, ...], str, bool]] = {}
_IDENTITIES_LOCK = threading.Lock()


def _identified(folder: Path, files: tuple[FileStamp, ...], hidden_mtime_ns: int) -> FolderState:
    """The state of ``folder`` whose files have the stamps ``files``: their content identity read from them."""
    digest = hashlib.sha256()
    complete = True
    for relative, size, *_ in files:
        # (A file name that is not UTF-8 is read with surrogate escapes; its own bytes go into the digest.)
        digest.update(f"{relative}\0{size}\0".encode("utf-8", "surrogateescape"))
        path = folder / relative
        try:
            regular = stat.S_ISREG(os.stat(path).st_mode)
        except OSError:
            regular = False
        # Never opened unless a regular file: even a non-blocking open of a FIFO wakes a writer waiting for a
        # reader, whose next write then fails (EPIPE) once the scan closes it again; a device is no model file.
        digest.update(_sampled_bytes(path, size) if regular else b"\0not a regular file")
        complete = complete and not (regular and size > 2 * SAMPLE_BYTES)
    return FolderState(files, digest.hexdigest(), hidden_mtime_ns, complete)


def _sampled_bytes(path: Path, size: int) -> bytes:
    """The first and last :data:`SAMPLE_BYTES` of a regular file; a marker for anything else.

    Opened without blocking and read only once known to be a regular file (the
    caller checked; this guards against a swap since): a FIFO in a model folder
    (a control pipe, say) would otherwise block the scan until some process
    wrote to it, and the watcher with it. An unreadable file is marked, not
    taken for the folder's end.
    """
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as err:
        return f"\0unreadable:{err.errno}".encode()
    with os.fdopen(descriptor, "rb") as f:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            return b"\0not a regular file"
        try:
            head = f.read(SAMPLE_BYTES)
            if size > 2 * SAMPLE_BYTES:
                f.seek(size - SAMPLE_BYTES)
                return head + f.read(SAMPLE_BYTES)
            return head + f.read() if size > SAMPLE_BYTES else head
        except OSError as err:
            return f"\0unreadable:{err.errno}".encode()


def scan_repository(root: Path) -> dict[str, FolderState]:
    """Every model folder under ``root`` and its state (StorageError when ``root`` cannot be listed).

    Hidden folders are skipped, and so are folders whose names are not UTF-8
    (logged once): they cannot be model names. So is a folder of no file but
    ignored ones (nereid's ``.cache/``, ``__pycache__``, an editor's): one a
    ``git checkout`` or an ``rm -rf m/*`` emptied of its model's files, keeping
    the ``.cache/`` git ignores, is the model's removal, not an edit (a failed
    reload that left the removed model serving; the storm hunt), and an empty
    folder just made is a folder once its first file lands.
    """
    states = {}
    for name in local_model_folders(root):
        state = scan_folder(root / name)
        if state is not None and state.stamp:
            states[name] = state
    prefix = os.path.join(os.fspath(root), "")
    found = {os.fspath(root / name) for name in states}
    with _IDENTITIES_LOCK:
        for gone in [key for key in _IDENTITIES if key.startswith(prefix) and key not in found]:
            del _IDENTITIES[gone]
    return states


def scan_store(location: StoreURL) -> dict[str, FolderState]:
    """Every model folder under ``location`` and its state, from one listing (StorageError on failure).

    A folder's stamp is its objects' names, sizes and ETags (no mtimes: a store
    has none worth comparing), and that is also its identity; the folder
    objects inside it (zero-byte keys ending in ``/``, which a load does not
    fetch) are none of them, as in the stamp of what a load fetched (see
    :func:`loaded_store_stamp`). The folders are those the repository's listing
    has: one holding only ignored files, or only folder objects (a console's
    "Create folder"), is there with nothing in its stamp, as an empty local
    folder is.
    """
    from nereid.storage.mirror import ancestor_paths, folder_objects, list_objects

    objects: dict[str, list[tuple[str, int, int | str]]] = {}
    lone: dict[str, str] = {}  # objects directly under location: a file, or a folder's own object "<name>/"
    listed = [entry for entry in list_objects(location) if not entry[0].startswith(".")]
    # The listing drops a key's trailing "/": a folder object shows as a zero-byte object named like its folder.
    # One with keys below it is one (as the mirror drops it); one without is asked of the store, once per ETag.
    parents = ancestor_paths(relative for relative, _, _ in listed)
    empty_leaves: dict[str, str] = {}
    for relative, size, etag in listed:
        name, _, rest = relative.partition("/")
        if not rest:
            lone[name] = str(etag)
        elif size == 0 and relative in parents:
            objects.setdefault(name, [])  # a folder object of a folder with keys below it: no file
        elif not any(ignored_name(part) for part in rest.split("/")):
            if size == 0:
                empty_leaves[relative] = str(etag)
            objects.setdefault(name, []).append((rest, size, etag))
        else:
            objects.setdefault(name, [])
    asked = {name: etag for name, etag in lone.items() if name not in objects} | empty_leaves
    markers = folder_objects(location, asked)
    for name in markers:
        folder, _, rest = name.partition("/")
        if not rest:
            objects[folder] = []
        else:  # (a folder object inside a folder, with nothing below it: no file of it either)
            objects[folder] = [file for file in objects[folder] if file[0] != rest]
    states = {}
    for name, files in sorted(objects.items()):
        stamp = tuple(sorted(files))
        states[name] = FolderState(stamp, hashlib.sha256(repr(stamp).encode()).hexdigest())
    return states


def loaded_store_stamp(remote: RemoteFolder) -> tuple:
    """The stamp :func:`scan_store` gives a store's folder, of the objects a load of it fetched or left in the store
    to stream: equal to the watcher's when the folder holds the very objects that load read (a RepositoryModelLoad
    of a folder just uploaded, which the watcher then loaded again; the repository read hunt)."""
    files = [(relative, item.size, item.etag or item.modified or "")
             for relative, item in (*remote.fetched.items(), *remote.streamed.items())
             if not any(ignored_name(part) for part in relative.split("/"))]
    return tuple(sorted(files))


@dataclass(frozen=True)
class Plan:
    """What one scan asks of the repository, in the order it is carried out."""

    renames: tuple[tuple[str, str], ...] = ()
    removed: tuple[str, ...] = ()
    added: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.renames or self.removed or self.added or self.changed)


def moved_files_unloaded(loaded: object, known: FolderState | None, moved: FolderState) -> bool:
    """Whether a model moved with its folder (a rename the watcher paired by content) runs other files than the
    new folder holds, and must load them after the move.

    ``loaded``: the stamp of the files its running version loaded (anything else: not known); ``known``: the
    old folder as the watcher last acted on it; ``moved``: the new folder now. A ``mv`` keeps every file, inodes
    and times included, so any difference from ``loaded`` is an edit made before the move (one the watcher may
    never have seen: same size, same ends). A copy (the original deleted after) has new files throughout and
    matches no stamp: it holds what was loaded when the running version had loaded the old folder as the watcher
    knew it (a reload of it that failed, the files moved away, left the version before: that one is stale).
    """
    if not isinstance(loaded, tuple) or loaded == moved.stamp:
        return False
    copied = not {file[3] for file in loaded} & {file[3] for file in moved.stamp}  # no inode in common
    return not (copied and known is not None and loaded == known.stamp)


def _shares_a_file(before: FolderState, after: FolderState) -> bool:
    """Whether two local folder states hold a file in common (an inode): one was moved to the other."""
    return bool({file[3] for file in before.stamp} & {file[3] for file in after.stamp})


def plan_changes(before: dict[str, FolderState], after: dict[str, FolderState], renames_too: bool = True) -> Plan:
    """Compare two scans: renames (same identity, one name gone, one new), removals, additions, edits."""
    gone = [name for name in before if name not in after]
    new = [name for name in after if name not in before]
    renames = []
    for old in list(gone) if renames_too else ():
        # A copy proves equal only where the identity covers every byte: a file past two samples can differ in
        # its middle alone (a fine-tune's weights, a constant in a long main.py), and the copy, paired, was moved
        # in place serving the old files (two bug hunts). A ``mv`` keeps the files, inodes included.
        same = [name for name in new if after[name].identity == before[old].identity
                and (after[name].complete or _shares_a_file(before[old], after[name]))]
        # A folder moved keeps its files' stamps; a copy of it made beside the move has new ones: the move wins.
        match = next((name for name in same if after[name].stamp == before[old].stamp), same[0] if same else None)
        if match is not None:
            renames.append((old, match))
            gone.remove(old)
            new.remove(match)
    changed = [name for name in after if name in before and after[name].stamp != before[name].stamp]
    return Plan(tuple(renames), tuple(gone), tuple(new), tuple(changed))
