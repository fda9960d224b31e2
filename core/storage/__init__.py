"""Where model folders come from: a local folder, or an object store (``s3://``, ``gs://``, ``az://``).

The repository asks this module two things, whatever ``server.ml_backends_path`` is:

* :func:`list_model_folders`: the names of the model folders;
* :func:`materialize_model_folder`: make a model folder ready to load, and
  return its local path.

For a local folder both are what they always were (a directory listing; the
folder itself). For an object store, the folders are the prefixes one level
below the URL, and materializing fetches the folder's files into the
local cache (see :mod:`nereid.storage.mirror`), but for those the backend that
claims it reads from the store itself (a bundle's weights), which stay there,
streamed at load (:mod:`nereid.storage.client`): the caller says which, with a
:data:`~nereid.storage.mirror.StreamedFiles` built from the backends' hook. The cached
copies of folders gone from the store are removed
(:func:`mirror_leftovers`, :func:`drop_mirror_folder`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from nereid.log_limit import OnceLog
from nereid.storage.client import (StorageError, describe_error, failure_kind, open_store, read_ranges, RangeRead,
                                   store_failed, store_unreachable)
from nereid.storage.mirror import (MARKER_FILE, RemoteFolder, RemoteObject, StreamedFiles, VersionHold, materialize,
                                   materialize_version, mirror_root, read_marker)
from nereid.storage.url import SCHEMES, StoreURL, parse_store_url

if TYPE_CHECKING:
    from nereid.settings import ServerSettings

log = logging.getLogger(__name__)

__all__ = [
    "MARKER_FILE", "RangeRead", "RemoteFolder", "RemoteObject", "SCHEMES", "StorageError", "StoreURL",
    "decodable_name", "describe_error", "drop_mirror_folder", "failure_kind", "list_model_folders",
    "local_model_folders", "materialize_model_folder", "materialize_model_version", "mirror_leftovers",
    "mirror_root", "model_folder_exists",
    "open_store", "parse_store_url", "read_marker", "read_ranges", "scan_model_folders", "store_failed",
    "store_unreachable",
    "store_holds_folder", "StreamedFiles", "VersionHold",
]

# An unknown model name has the store listed at most this often, on a thread of its own (never on the
# event loop, where a hanging store would stall every request); a failed listing counts too.
_LISTING_TTL_S = 5.0


@dataclass
class _Listing:
    """A store's last listing of model folders: when it ended, and the names (None when it failed)."""

    ended: float = float("-inf")
    names: frozenset[str] | None = None
    running: bool = False  # a refresh for unknown names is under way
    started: float = float("-inf")  # when the listing kept here started: an older one ending later is not kept
    # Names the repository forgot (see forget_listed_folder), and when: a listing that started before then may
    # still hold them.
    forgotten: dict[str, float] = field(default_factory=dict)


# Beside a mirror's folder (``.<its name>`` and this): a server of this version uses it. A server at the provider's
# own endpoint names its mirror as earlier versions named every one, so that name alone does not tell an abandoned
# mirror from one in use. (Beside it, not in it: the mirror holds only model folders and their locks.)
IN_USE_SUFFIX = ".in-use"
_marked_mirrors: set[Path] = set()
# Longer than any listing of a store takes (its client's retries give up after a few minutes).
_LISTING_SLOW_S = 900.0
_listings: dict[str, _Listing] = {}
_listings_lock = threading.Lock()
# Folders whose names are not UTF-8 or too long for a local folder: warned about once (each scan meets them).
_folder_warnings = OnceLog(log)


def _location(server: ServerSettings) -> StoreURL | None:
    url = getattr(server, "ml_backends_url", None)
    return parse_store_url(url) if url else None


def list_model_folders(server: ServerSettings) -> list[str]:
    """The names of the model folders under ``server.ml_backends_path`` (or its URL).

    A store (or local folder) that cannot be listed is logged and lists
    nothing: the models nereid.yaml lists still get entries, and their loads
    report the error.
    """
    try:
        return scan_model_folders(server)
    except StorageError as err:
        log.error("%s", err)
        return []


def scan_model_folders(server: ServerSettings) -> list[str]:
    """:func:`list_model_folders`, raising StorageError when the store or folder cannot be listed.

    For a store, each listed folder also gets its (empty until materialized)
    local mirror folder.
    """
    location = _location(server)
    root = Path(server.ml_backends_path)
    if location is None:
        return local_model_folders(root)
    _mark_mirror(root)
    names = _list_remote(location, root)
    _note_earlier_mirror(location, root)
    for name in names:
        _make_mirror_folder(location, root, name)
    return names


def _mark_mirror(root: Path) -> None:
    """Mark the mirror ``root`` as one a server of this version uses (see :func:`_note_earlier_mirror`), once per
    process; a cache that refuses it is left alone (the folders' own writes say why)."""
    if root in _marked_mirrors:
        return
    try:
        _make_repositories_folder(root)
        _in_use_mark(root).touch()
    except OSError:
        return
    _marked_mirrors.add(root)


def _make_repositories_folder(root: Path) -> None:
    """Make ``<cache_dir>/repositories``, the folder of the mirror ``root``, mode 0700 when it is not there yet.

    The files fetched from a bucket (a model's code, its configuration, its
    weights) are in it, and under the usual umask 022 they were readable by
    every user of the machine, where the bucket let only the server read them
    (the path-safety hunt). One there already keeps its mode: the operator's
    choice (servers of several users in one group sharing the cache). OSError
    when it cannot be made.
    """
    repositories = root.parent
    repositories.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        repositories.mkdir(mode=0o700)


def _in_use_mark(root: Path) -> Path:
    """The file saying a server of this version uses the mirror ``root`` (see :func:`_mark_mirror`)."""
    return root.parent / f".{root.name}{IN_USE_SUFFIX}"


def _note_earlier_mirror(location: StoreURL, root: Path) -> None:
    """Say once that the mirror an earlier nereid made for ``location`` (named by the URL alone, before mirrors
    were told apart by the store's endpoint) is not used any more: it holds fetched files and compiled programs
    that nothing removes.

    That name is also the one a server at the provider's own endpoint uses
    now: one that carries the mark of a server of this version is never said
    to be unused.
    """
    earlier = root.parent / location.cache_name()
    if earlier != root and earlier.is_dir() and not os.path.lexists(_in_use_mark(earlier)):
        _folder_warnings.warning(str(earlier), "%s: the local mirror %s, made by an earlier nereid before mirrors "
                                 "were told apart by the store's endpoint, is no longer used (the models are "
                                 "fetched again into %s); delete it, unless a server of a nereid older than this "
                                 "one at the store provider's own endpoint shares this cache_dir", location,
                                 earlier, root)


def _make_mirror_folder(location: StoreURL, root: Path, name: str) -> None:
    """Make the (empty until materialized) mirror folder of ``name`` (a stray file in its place removed, see
    :func:`nereid.storage.mirror.make_mirror_folder`); a failure is logged once, never raised.

    A bucket takes folder names the local file system refuses (longer than 255
    bytes, say): such a folder stays listed, and its load reports why. The
    warning names the folder and the system's reason.
    """
    from nereid.storage.mirror import make_mirror_folder

    folder = root / name
    try:
        make_mirror_folder(location, root, name)
    except OSError as err:
        # A long name is cut, with its length said; a short one is named as it is.
        shown = name if len(name) <= 80 else f"{name[:80]}... ({len(name)} characters)"
        reason = str(err.strerror or err)
        if err.errno == errno.ENAMETOOLONG:
            reason += " (a local file system allows 255 bytes per name)"
        _folder_warnings.warning(str(folder), "model folder '%s': cannot make its local mirror folder %s: %s; it "
                                 "cannot load", shown, folder, reason)


def decodable_name(name: str, root: Path) -> bool:
    """Whether ``name``, a folder name read from ``root``, is UTF-8 text.

    Python reads a name that is not UTF-8 with surrogate escapes ('odd\\udcffname'),
    which no protobuf or JSON string can carry: such a folder cannot be a model,
    and one in a listing made every RepositoryIndex fail. The first time a
    name is met it is logged with its bytes escaped ('odd\\xffname').
    """
    try:
        name.encode("utf-8")
        return True
    except UnicodeEncodeError:
        pass
    shown = os.fsencode(name).decode("utf-8", "backslashreplace")
    _folder_warnings.warning(f"{root}/{shown}", "ml_backends_path %s: skipping the folder '%s': its name is not "
                             "UTF-8, so it cannot be a model name (rename it to serve it)", root, shown)
    return False


def local_model_folders(root: Path) -> list[str]:
    """The model folders in the local folder ``root`` (hidden ones and names that are not UTF-8 skipped).

    StorageError when ``root`` cannot be listed (removed while serving, say): like
    a store that cannot be listed, that is never "every folder is gone".
    """
    try:
        with os.scandir(root) as listing:
            entries = list(listing)
    except OSError as err:
        raise StorageError(f"ml_backends_path {root}: cannot list it: {err.strerror or err}") from None
    names = []
    for entry in entries:
        try:
            is_folder = entry.is_dir()  # follows a symlink, as a model folder may be one
        except OSError:
            continue  # gone since the listing
        if is_folder and not entry.name.startswith(".") and decodable_name(entry.name, root):
            names.append(entry.name)
    return sorted(names)


def _mirrored_folders(root: Path) -> list[str]:
    """The folders of the local mirror ``root``: every model folder listed before, even by an earlier server."""
    try:
        with os.scandir(root) as listing:
            return [entry.name for entry in listing if not entry.name.startswith(".") and entry.is_dir()]
    except OSError:  # no mirror yet
        return []


def model_folder_exists(server: ServerSettings, name: str) -> bool:
    """Whether ``name`` is a model folder now; never waits for a store, so it may be called on the event loop.

    Locally one stat. For a store, the answer of its last listing; when that
    is 5 s old or more (or failed that long ago), a new one starts on a
    thread, for the calls that follow. A load lists the store itself first.
    """
    location = _location(server)
    if location is None:
        return (Path(server.ml_backends_path) / name).is_dir()
    with _listings_lock:
        listing = _listings.setdefault(str(location), _Listing())
        if not listing.running and time.monotonic() - listing.ended >= _LISTING_TTL_S:
            listing.running = True
            threading.Thread(target=_refresh_listing, args=(location, Path(server.ml_backends_path)),
                             name="nereid-store-listing", daemon=True).start()
        return listing.names is not None and name in listing.names


def forget_listed_folder(server: ServerSettings, name: str) -> None:
    """Take ``name`` out of the store's last listing kept for :func:`model_folder_exists`: the repository has
    just forgotten it, its folder gone (seen by the watcher's own listing, which this one may predate).

    Otherwise a request for the name within the next seconds would find the folder in that older listing and
    give it an entry again: a model "waiting for its folder to settle" where the answer is NOT_FOUND.
    """
    location = _location(server)
    if location is None:
        return
    with _listings_lock:
        listing = _listings.setdefault(str(location), _Listing())
        now = time.monotonic()
        # Kept for a listing under way, which may still hold it; at most as long as a listing can take (the
        # store client gives up long before), so a server fed versioned names keeps no entry per name for good.
        listing.forgotten = {other: when for other, when in listing.forgotten.items() if now - when < _LISTING_SLOW_S}
        listing.forgotten[name] = now
        if listing.names is not None and name in listing.names:
            listing.names = listing.names - {name}


def store_holds_folder(server: ServerSettings, name: str) -> bool:
    """Whether the object store behind ``server`` holds the model folder ``name`` (blocking: call off the loop).

    One listing of that folder's prefix: the answer for a name a listing of
    every folder missed. False for a local folder; StorageError naming the
    store's URL when it cannot be listed (never "not there": a load asked for
    during an outage must say why, not answer NOT_FOUND).
    """
    location = _location(server)
    if location is None:
        return False
    from nereid.storage.mirror import remote_folder_exists

    return remote_folder_exists(location, name)


def mirror_leftovers(server: ServerSettings, present: list[str]) -> list[str]:
    """The names whose cached copy (a folder or its lock file) is in the local mirror of ``server``'s store but
    not in ``present``, a listing of its model folders (blocking: a directory listing); [] locally. Candidates
    only: :func:`drop_mirror_folder` asks the store about each (a listing may miss a folder)."""
    if _location(server) is None:
        return []
    from nereid.storage.mirror import leftover_names

    return leftover_names(Path(server.ml_backends_path), present)


def drop_mirror_folder(server: ServerSettings, name: str) -> bool:
    """Remove the cached copy of the model folder ``name`` (a name the repository forgot) when the store confirms
    its prefix is gone and no server sharing the cache is fetching it (blocking: call off the loop).

    Returns whether it was removed; a failure (the store cannot be listed, the
    cache refuses) is logged and leaves it, for a later call. See
    :func:`nereid.storage.mirror.drop_mirror`.
    """
    location = _location(server)
    if location is None:
        return False
    from nereid.storage.mirror import drop_mirror

    try:
        return drop_mirror(location, name, Path(server.ml_backends_path) / name)
    except StorageError as err:
        log.info("model folder '%s' is gone from the last listing, but its copy in the cache stays: %s", name, err)
    except OSError as err:  # (each later listing tries again: said once)
        folder = Path(server.ml_backends_path) / name
        _folder_warnings.warning(f"drop {folder}", "model folder '%s' is gone from %s, but its copy in the cache (%s) "
                                 "cannot be removed: %s", name, location, folder, err.strerror or err)
    return False


def _refresh_listing(location: StoreURL, root: Path) -> None:
    """List the store for :func:`model_folder_exists` (on its own thread); a failure is logged and kept."""
    try:
        _list_remote(location, root)
    except StorageError as err:
        log.warning("%s", err)
    except Exception:  # a thread of its own: nothing above it would report it
        log.exception("%s: listing the model folders failed", location)
    finally:
        with _listings_lock:
            _listings[str(location)].running = False


def materialize_model_folder(server: ServerSettings, name: str, streams: StreamedFiles | None = None) -> Path:
    """Make the model folder ``name`` ready to load and return its local path (blocking: call off the loop).

    Local: the folder itself. Store: its files fetched or refreshed in the
    mirror, but those ``streams`` leaves in the store (see
    :func:`nereid.plugins.streamed_files`; None: every file fetched);
    StorageError names the URL.
    """
    location = _location(server)
    folder = Path(server.ml_backends_path) / name
    if location is None:
        return folder
    _try_to_make_repositories_folder(folder.parent)
    materialize(location, name, folder, streams)
    return folder


def materialize_model_version(server: ServerSettings, name: str,
                              streams: StreamedFiles | None = None) -> VersionHold | None:
    """:func:`materialize_model_folder` for a version about to load: None for a local folder (which the version
    runs from); for a store, the hold of a version folder of its own, which no later fetch changes (blocking:
    call off the loop). Release it with the version (see :class:`~nereid.storage.mirror.VersionHold`)."""
    location = _location(server)
    if location is None:
        return None
    _try_to_make_repositories_folder(Path(server.ml_backends_path))
    return materialize_version(location, name, Path(server.ml_backends_path) / name, streams)


def _try_to_make_repositories_folder(root: Path) -> None:
    """:func:`_make_repositories_folder` before a fetch (a load may come before any listing); a cache that refuses
    it is left alone: the fetch's own writes fail naming what they could not write."""
    with contextlib.suppress(OSError):
        _make_repositories_folder(root)


def _list_remote(location: StoreURL, root: Path) -> list[str]:
    from nereid.storage.mirror import list_remote_folders

    started = time.monotonic()
    try:
        names = list_remote_folders(location, _mirrored_folders(root))
    except Exception:
        # A failure is kept as long as an answer, so it is not retried at once.
        _record_listing(location, None, started)
        raise
    _record_listing(location, frozenset(names), started)
    return names


def _record_listing(location: StoreURL, names: frozenset[str] | None, started: float) -> None:
    """Keep the outcome of a listing that started at ``started`` (the names, or None when it failed) for
    :func:`model_folder_exists`.

    Unless a listing that started later was kept already; and without the names forgotten since it started
    (a slow listing ending after the watcher saw a folder go would give the name an entry again).
    """
    with _listings_lock:
        listing = _listings.setdefault(str(location), _Listing())
        if started < listing.started:
            return
        if names is not None:
            names = names - {name for name, when in listing.forgotten.items() if when >= started}
        # Forgotten before this listing started: it is as new as anything that could still be kept.
        listing.forgotten = {name: when for name, when in listing.forgotten.items() if when >= started}
        listing.ended, listing.names, listing.started = time.monotonic(), names, started
