"""A model repository in an object store, mirrored file by file into the local cache folder.

The model folders are the prefixes one level below the repository URL, as
locally. Loading a model *materializes* its folder: every object under it is
fetched into ``<cache_dir>/repositories/<repository>/<model>/``, except the files
the backend that will claim the folder reads from the store itself (a bundle's
weights: the xla backend streams them), which stay there. Which files those are
is the caller's to say (a :data:`StreamedFiles`, built from the backends'
``nereid_streamed_files`` hook): core knows no backend's file names. A file is fetched again only when its ETag
(or version) changed since it was last fetched, or its local copy's size or modification time since it was
written; the folder's ``.nereid-remote.json`` records them, and the files the backend must stream. Files are written as
they arrive (never held whole in memory) under temporary names and renamed
into place, so a running model never sees a half file, and files gone from
the store are removed. Nothing is ever written to the store.

A loaded version never runs from that folder, which the next fetch (this
server's, or another's sharing the cache) changes: :func:`materialize_version`
gives it a *version folder* of its own, ``<model>/.nereid-versions/<id>/<model>/``,
made under the folder's lock from the files just fetched (hard links) and never
changed after. The version holds it (a shared lock on ``<id>/.nereid-in-use``, see
:class:`VersionHold`) until it is released; a version folder no server holds is
removed at the next fetch of its model, or once released.

A model folder whose prefix is gone from the store is removed from
the cache as a whole (see :func:`drop_mirror`) once the repository has
forgotten it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

from nereid.errors import ConfigError
from nereid.files import atomic_write, kind_of, read_text_file, remove_tree
from nereid.log_limit import OnceLog
from nereid.storage.client import (StorageError, describe_error, endpoint_identity, is_not_found, open_store,
                                   store_call)
from nereid.storage.url import StoreURL

log = logging.getLogger(__name__)

MARKER_FILE = ".nereid-remote.json"
# The most a backend deciding which files it streams may read of one file (``read_small``): a manifest, not weights.
SMALL_FILE_BYTES = 1 << 20
CACHE_SUBFOLDER = ".cache"  # the executable cache: local, never mirrored; removed only with its folder
# A mirrored folder being removed is first renamed to this prefix and a random suffix (hidden: never listed as
# a model folder), then deleted: a folder of the name made meanwhile is a new one, never one half deleted.
DROPPED_PREFIX = ".nereid-dropped-"
LOCK_SUFFIX = ".lock"
# Inside a model folder: the changed files of one fetch, moved into place only once every one is in.
STAGING_PREFIX = ".nereid-fetching-"
# Inside a model folder: the loaded versions' own folders, <id>/<model>/, immutable once made (see VersionHold).
VERSIONS_FOLDER = ".nereid-versions"
# Beside a version's folder (<id>/.nereid-in-use): each server running that version holds a shared lock on it.
IN_USE_FILE = ".nereid-in-use"
VERSION_BUILDING_PREFIX = ".building-"  # a version folder being made (a killed server's: removed under the lock)
VERSION_DROPPED_PREFIX = ".dropped-"
# Small files are fetched this many at a time: a folder with a vendored package holds hundreds, and a
# store answers each GET in tens of milliseconds.
FETCH_CONCURRENCY = 16
# A fetched file is written to disk as it arrives, in pieces of about this many bytes (at least, but for the
# last): a folder's files are fetched FETCH_CONCURRENCY at a time, so memory holds about that many pieces
# however large the files are (a python model's own weights may be gigabytes each).
FETCH_CHUNK_BYTES = 1 << 20
# A file larger than this is fetched one range of it per request (see _received_whole).
FETCH_RANGE_BYTES = 16 << 20
# The most a folder's record (MARKER_FILE) may hold: each file's entry takes about 300 bytes, so this is over
# 200,000 files, past the 100,000 entries a folder's check looks at before it fails the load (MAX_FOLDER_ENTRIES).
MARKER_LIMIT_BYTES = 64 << 20


@dataclass(frozen=True)
class RemoteObject:
    """One object of a model folder: its key, size and identity (ETag, version).

    ``mtime_ns``: the modification time of the file it was fetched into, so a
    cached copy changed in place (with its size unchanged) is fetched again.
    """

    key: str
    size: int
    etag: str | None = None
    version: str | None = None
    mtime_ns: int | None = None
    # The listing's last-modified time, for a store that gives no ETag (some S3-compatible ones): without it a
    # same-size edit was never seen (the storage hunt).
    modified: str | None = None

    @property
    def identity(self) -> tuple[str | int | None, ...]:
        """What says the object's bytes are unchanged (its modification time only where there is no ETag: the
        identity of an object that has one is what it was before the time joined it)."""
        if self.etag:
            return (self.etag, self.version, self.size)
        return (self.etag, self.version, self.size, self.modified)


@dataclass(frozen=True)
class RemoteFolder:
    """A materialized model folder: where it lives in the store, what was fetched, what stays remote."""

    url: str
    fetched: Mapping[str, RemoteObject] = field(default_factory=dict)
    streamed: Mapping[str, RemoteObject] = field(default_factory=dict)

    @property
    def location(self) -> StoreURL:
        """The folder's URL, parsed."""
        from nereid.storage.url import parse_store_url

        location = parse_store_url(self.url)
        assert location is not None
        return location


def mirror_root(cache_dir: Path, location: StoreURL) -> Path:
    """The local folder holding the mirrored model folders of the repository at ``location``, on the store the
    environment's endpoint reaches (servers on one ``cache_dir`` share it only when they share the store)."""
    return Path(cache_dir) / "repositories" / location.cache_name(endpoint_identity(location.scheme))


def list_remote_folders(location: StoreURL, known: Iterable[str] = ()) -> list[str]:
    """Names of the model folders under ``location`` (hidden ones skipped); StorageError on failure.

    A key obstore cannot read (see :func:`unreadable_key`) fails only what
    holds it: a folder with one inside is listed (its load fails naming the
    key); one directly under ``location``, or a folder named so, is skipped
    with a warning. ``known``: folders seen before (the local mirror's), looked
    at one by one should the listing be incomplete for such a key.
    """
    import obstore

    store = open_store(location)
    prefix = location.key() + "/" if location.key() else ""
    try:
        with store_call(location.scheme):
            listing = obstore.list_with_delimiter(store, prefix or None)
    except Exception as err:
        if unreadable_key(err) is None:
            raise _listing_failed(location, err) from None
        _known_folders.setdefault(str(location), set()).update(known)
        return _folders_from_keys(location, store, prefix)  # a key obstore refuses at this level: walk it
    names = sorted({p.rstrip("/").rsplit("/", 1)[-1] for p in listing["common_prefixes"]})
    names = [n for n in names if n and not n.startswith(".")]
    _known_folders[str(location)] = set(names)
    return names


def remote_folder_exists(location: StoreURL, name: str) -> bool:
    """Whether the model folder ``name`` is under ``location``, by a listing of its prefix alone (blocking).

    Found even where a listing of every folder misses it (a page obstore
    drops, see :func:`_folders_from_keys`); StorageError when it cannot be listed.
    False for a name obstore cannot put in a key (a control character): no file of such a folder can be read,
    and the listing refused it as the store's failure, a 503 telling the client to try again (the path-safety
    hunt).
    """
    if _is_bad_segment(name):
        return False
    prefix = location.key() + "/" if location.key() else ""
    return _folder_exists(location, open_store(location), f"{prefix}{name}/")


def _modified(meta: Any) -> str | None:
    """An object's last-modified time as its listing gives it, for a store that gives no ETag (None: one does)."""
    if meta.get("e_tag"):
        return None
    modified = meta.get("last_modified")
    return None if modified is None else f"modified {modified}"


def list_objects(location: StoreURL) -> list[tuple[str, int, str]]:
    """Every object under ``location``: its key relative to it, its size and ETag (where the store gives none, its
    modification time); StorageError on failure.

    A folder holding a key obstore cannot read gets one entry for it instead
    (named after the key, size -1), so that it is still there, changes when the
    key does, and its load names the key; the other folders are listed in full.
    """
    import obstore

    store = open_store(location)
    prefix = location.key() + "/" if location.key() else ""
    try:
        with store_call(location.scheme):
            entries = [(meta["path"][len(prefix):], int(meta["size"]), meta.get("e_tag") or _modified(meta) or "")
                       for chunk in obstore.list(store, prefix or None) for meta in chunk]
        _known_folders[str(location)] = {folder for relative, _, _ in entries
                                         for folder, slash, _ in [relative.partition("/")] if slash}
        return entries
    except Exception as err:
        if unreadable_key(err) is None:
            raise _listing_failed(location, err) from None
    # obstore drops the whole page holding such a key, so the keys listed before it in that page are
    # unknown: list folder by folder, and only the folders holding one lose their other entries.
    entries = []
    for name in list_remote_folders(location):
        objects, unreadable = _list_keys(location.child(name), store, f"{prefix}{name}/")
        entries.extend((meta["path"][len(prefix):], int(meta["size"]), meta.get("e_tag") or _modified(meta) or "")
                       for meta in objects)
        entries.extend((f"{name}/{_stamp_name(key[len(prefix) + len(name) + 1:])}", -1, "unreadable key")
                       for key in unreadable)
    return entries


def folder_objects(location: StoreURL, entries: Mapping[str, str]) -> set[str]:
    """Which of ``entries`` (name: ETag), objects a listing gave directly under ``location`` with no key below
    them, are a folder's own object ``<name>/`` (a console's "Create folder"), not a file (blocking).

    The listing drops a key's trailing ``/``, so the two look alike there,
    while the repository's listing by folder counts such a folder: asked of
    the store once per ETag. One that cannot be asked is taken as a file
    until the next call.
    """
    key = location.key()
    seen = _folder_objects.setdefault(str(location), {})
    store = None
    answers: dict[tuple[str, str], bool] = {}
    for name, etag in entries.items():
        answer = seen.get((name, etag))
        if answer is None:
            store = store or open_store(location)
            answer = _is_folder_object(store, location.scheme, f"{key}/{name}" if key else name)
        answers[(name, etag)] = answer
    _folder_objects[str(location)] = answers  # (only the entries there now: a listing's worth at most)
    return {name for (name, _), answer in answers.items() if answer}


# The answers of folder_objects, by repository: (name, ETag) -> whether it is a folder's own object.
_folder_objects: dict[str, dict[tuple[str, str], bool]] = {}


# obstore (the Rust object_store under it) refuses keys with an empty segment ('a//b'), a '.' or '..'
# segment, or an ASCII control character, all legal in S3; its error names the key.
_UNREADABLE = re.compile(r'Path "(.*?)"(?: contained empty path segment|: Encountered illegal character sequence)',
                         re.S)
_UNREADABLE_HINT = ("obstore, nereid's store client, cannot read a key with an empty segment ('//'), a '.' or '..' "
                    "segment or a control character: rename it")
# While a key directly under the repository URL is unreadable, the folders are found by listing every key, and
# obstore drops the page of that listing holding any unreadable key (see _folders_from_keys).
_HIDDEN_FOLDERS = ("while it is there, a model folder whose keys all come just before it in the listing (in its "
                   "page of 1,000 keys) is not found unless this server, or one sharing its cache_dir, listed that "
                   "folder before (a model nereid.yaml lists still loads)")
# The most unreadable keys one listing steps over before giving up (each costs a listing request).
_MAX_UNREADABLE = 100
# Unreadable keys skipped: warned about once (each scan meets them).
_key_warnings = OnceLog(log)
# The folders of each repository's last complete listing: looked at one by one when a listing is not complete.
_known_folders: dict[str, set[str]] = {}


def unreadable_key(err: BaseException) -> str | None:
    """The key named by obstore's InvalidPathError ``err``; None for any other error."""
    if type(err).__name__ != "InvalidPathError":
        return None
    match = _UNREADABLE.search(str(err).split("\n\nDebug source:", 1)[0])
    return match.group(1) if match else None


def _is_bad_segment(segment: str) -> bool:
    """Whether obstore refuses a key with this path segment (empty, '.', '..', an ASCII control character)."""
    return segment in ("", ".", "..") or any(ord(c) < 0x20 or c == "\x7f" for c in segment)


def _offset_past(key: str) -> str:
    """A key obstore accepts as a listing offset, past every key that shares ``key``'s unreadable part.

    The keys stepped over are all unreadable too, but for at most one: the
    offset itself, at the depth of the bad part, so in the same folder.
    """
    segments = key.split("/")
    kept: list[str] = []
    for depth, segment in enumerate(segments):
        last = depth == len(segments) - 1
        if segment in ("", ".", "..") and not last:
            return "/".join([*kept, segment]) + "0"  # past '<segment>/...': '0' follows '/'
        if segment in (".", ".."):
            return key + " "  # the smallest readable key after it
        for position, char in enumerate(segment):
            if ord(char) < 0x20:
                return "/".join([*kept, segment[:position]]) + " "  # ' ' follows the control characters
            if char == "\x7f":
                return "/".join([*kept, segment[:position]]) + "\x80"
        kept.append(segment)
    return key + " "


def _list_keys(url: StoreURL, store: Any, prefix: str) -> tuple[list[dict], list[str]]:
    """Every object under ``prefix`` obstore can read, and the keys it cannot (stepped over); StorageError otherwise.

    obstore fails the whole page (up to 1,000 keys) holding an unreadable key,
    so the readable keys listed before it in that page are missing: callers
    only trust a prefix without unreadable keys.
    """
    import obstore

    objects: list[dict] = []
    unreadable: list[str] = []
    offset: str | None = None
    while True:
        try:
            with store_call(url.scheme):
                for chunk in obstore.list(store, prefix or None, offset=offset):
                    objects.extend(chunk)
            return objects, unreadable
        except Exception as err:
            key = unreadable_key(err)
            if key is None:
                raise StorageError(f"{url}: cannot list it: {describe_error(err, url.scheme)}") from None
            if len(unreadable) >= _MAX_UNREADABLE:
                raise StorageError(f"{url}: cannot list it: more than {_MAX_UNREADABLE} keys like "
                                   f"{key!r} that {_UNREADABLE_HINT}") from None
            unreadable.append(key)
            offset = _offset_past(key)


def _folders_from_keys(location: StoreURL, store: Any, prefix: str) -> list[str]:
    """The model folders under ``prefix`` when listing them by folder fails on an unreadable key there.

    A full listing, stepping over each unreadable key and past the rest of a
    folder holding one (listed: its load names the key); an unreadable key
    directly under ``prefix``, or in a folder whose own name is unreadable, is
    skipped. obstore drops the whole page (1,000 keys on S3) holding an
    unreadable key, and no listing it offers can reach the keys before that
    key without that page (a prefix is whole folders, a listing has a start
    but no end, and the listing by folder fails as a whole): the folders seen
    before (``_known_folders``, the local mirror's) are each looked at again by
    themselves, and each such key is logged once, saying that folders listed
    just before it may be missing.
    """
    import obstore

    names: set[str] = set()
    offset: str | None = None
    for _ in range(_MAX_UNREADABLE):
        try:
            with store_call(location.scheme):
                for chunk in obstore.list(store, prefix or None, offset=offset):
                    names.update(folder for meta in chunk
                                 for folder, slash, _ in [meta["path"][len(prefix):].partition("/")] if slash)
            break
        except Exception as err:
            key = unreadable_key(err)
            if key is None:
                raise _listing_failed(location, err) from None
            folder, slash, _ = key[len(prefix):].partition("/")
            if slash and not _is_bad_segment(folder):
                names.add(folder)
                _key_warnings.warning(key, "%s: object key %r cannot be read (the load of '%s' fails naming it): %s; "
                                      "%s", location, key, folder, _UNREADABLE_HINT, _HIDDEN_FOLDERS)
                offset = f"{prefix}{folder}/\U0010ffff"  # past the folder: it fails to load anyway, naming a key
            else:
                _key_warnings.warning(key, "%s: skipping the object key %r: %s; %s", location, key,
                                      _UNREADABLE_HINT, _HIDDEN_FOLDERS)
                offset = _offset_past(key)
    else:
        raise StorageError(f"{location}: cannot list the model folders: more than {_MAX_UNREADABLE} keys that "
                           f"{_UNREADABLE_HINT}")
    # A copy: another thread's listing adds to the set in place (above) while each name here waits on the store.
    names.update(n for n in tuple(_known_folders.get(str(location), ())) if n not in names
                 and _folder_exists(location, store, f"{prefix}{n}/"))
    return sorted(n for n in names if n and not n.startswith("."))


def _folder_exists(location: StoreURL, store: Any, prefix: str) -> bool:
    """Whether any key lies under ``prefix`` (an unreadable one counts); StorageError when it cannot be listed."""
    import obstore

    try:
        with store_call(location.scheme):
            return any(len(chunk) for chunk in obstore.list(store, prefix, chunk_size=1))
    except Exception as err:
        if unreadable_key(err) is not None:
            return True
        raise _listing_failed(location, err) from None


def _listing_failed(location: StoreURL, err: BaseException) -> StorageError:
    """The error of a listing of ``location``'s model folders that the store refused."""
    return StorageError(f"{location}: cannot list the model folders: {describe_error(err, location.scheme)}")


def _stamp_name(relative: str) -> str:
    """``relative``, an unreadable key below its folder, as one readable, non-hidden name for a folder's state."""
    return "<unreadable key " + relative.encode("unicode_escape").decode("ascii").replace("/", "\\x2f") + ">"


# Which files of a model folder in the store stay there, read by the backend that claims it (streamed), rather than
# fetched: given the folder's files (paths relative to it, '/'-separated) and ``read_small`` (a listed file's bytes,
# None when it is over SMALL_FILE_BYTES), the names to leave (names not listed are ignored). Built by the caller
# from the backends' nereid_streamed_files hook (see nereid.plugins.streamed_files): the mirror knows no backend.
StreamedFiles = Callable[[tuple[str, ...], Callable[[str], "bytes | None"]], Iterable[str]]


def materialize(location: StoreURL, name: str, folder: Path, streams: StreamedFiles | None = None) -> RemoteFolder:
    """Bring ``folder`` up to date with the model folder ``location/name``; returns what it holds.

    ``streams`` says which files stay in the store (see :data:`StreamedFiles`);
    without it, every file is fetched. Raises StorageError naming the URL when
    the folder is gone, a key is unsafe, or a fetch fails (a read the
    ``streams`` decision asked for too); ConfigError when it holds only folder
    objects.
    """
    return _materialize(location, name, folder, False, streams)[0]


def materialize_version(location: StoreURL, name: str, folder: Path,
                        streams: StreamedFiles | None = None) -> VersionHold:
    """:func:`materialize`, then a version folder of the files fetched, held (release it with the version).

    The version folder is made (or the one of the same files reused) under the
    folder's lock, and held before the lock is let go: no fetch or removal by
    any server sharing the cache changes it while it is held.
    """
    hold = _materialize(location, name, folder, True, streams)[1]
    assert hold is not None
    return hold


def _materialize(location: StoreURL, name: str, folder: Path, version: bool,
                 streams: StreamedFiles | None) -> tuple[RemoteFolder, VersionHold | None]:
    import obstore

    folder_url = location.child(name)
    store = open_store(location)
    try:
        with store_call(location.scheme):
            objects = [o for chunk in obstore.list(store, folder_url.key() + "/") for o in chunk]
    except Exception as err:
        key = unreadable_key(err)
        if key is not None:
            raise StorageError(f"{folder_url}: object key {key!r} cannot be read: {_UNREADABLE_HINT}") from None
        raise StorageError(f"{folder_url}: cannot list the model folder: {describe_error(err, location.scheme)}") \
            from None
    listed = bool(objects)
    objects = _without_folder_markers(store, folder_url, objects)
    if not objects and listed:
        # As an empty local folder's load fails for want of files (the model's own fault: not tried again
        # until the folder changes), never as the store's.
        raise ConfigError(f"{folder_url}: the model folder holds no files, only folder objects (keys ending in "
                          "'/', as a console's \"Create folder\" makes): upload the model's files into it")
    if not objects:
        raise StorageError(f"{folder_url}: no such model folder (no objects under it)")
    with _fetch_lock(str(folder_url), folder.parent / _lock_name(name)):
        try:  # under the lock: a removal of the folder (drop_mirror) may have just ended
            _remove_stray_file(folder, str(folder_url))
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise _cache_write_failed(str(folder_url), "make its folder in", folder, err) from None
        try:
            _remove_stray_files(folder, str(folder_url))
        except OSError as err:
            raise _cache_write_failed(str(folder_url), "clear its own folders in", folder, err) from None
        try:
            previous = read_marker(folder)
        except StorageError as err:  # the record only saves fetches: without it, every file is fetched again
            # A folder (or a FIFO...) where it belongs cannot be written over, as a regular file is below.
            removed = _remove_unless_regular(folder / MARKER_FILE)
            log.warning("%s; %sfetching the whole folder again", err, "removed it, " if removed else "")
            previous = None
        fetched: dict[str, RemoteObject] = {}
        streamed: dict[str, RemoteObject] = {}
        stale: list[tuple[str, RemoteObject, Path]] = []  # new or changed: fetched below
        listed = _listed_files(folder_url, objects)
        # Only what the claiming backend reads from the store itself stays there; any other model (a main.py,
        # a meta model's model.py reading its own .safetensors) gets every file on disk.
        left = _streamed_names(streams, _SmallFiles(store, folder_url, folder, listed, previous))
        for relative, item in listed.items():
            if relative in left:
                streamed[relative] = item
                continue
            old = previous.fetched.get(relative) if previous is not None else None
            target = folder.joinpath(*relative.split("/"))
            if _is_current(target, item, old):
                fetched[relative] = old
                continue
            stale.append((relative, item, target))
        fetched.update(_fetch_staged(store, folder_url, folder, stale, keep=list(fetched)))
        _remove_others(folder, set(fetched))
        result = RemoteFolder(str(folder_url), fetched, streamed)
        try:
            atomic_write(folder / MARKER_FILE, [json.dumps(
                {"url": result.url, "fetched": {k: _recorded(v) for k, v in fetched.items()},
                 "streamed": {k: _recorded(v) for k, v in streamed.items()}}, indent=1, sort_keys=True).encode()])
        except OSError as err:
            # A StorageError, as a refused copy of a file is: the watcher tries the load again once the cache has
            # room, where a bare OSError reads as the model's own fault (UNAVAILABLE for good).
            raise _cache_write_failed(str(folder_url), "record what it fetched in", folder / MARKER_FILE,
                                      err) from None
        hold = _held_version(folder, name, result) if version else None
        if hold is not None:
            hold.remote = result
        _prune_versions(folder)
    log.info("%s: %d file(s) fetched or current in %s, %d file(s) left in the store to stream", folder_url,
             len(fetched), hold.folder if hold is not None else folder, len(streamed))
    return result, hold


def _listed_files(folder_url: StoreURL, objects: list[dict]) -> dict[str, RemoteObject]:
    """The model's files among the listed ``objects`` of ``folder_url``, by path relative to it (the server's own
    names skipped); StorageError for a key that is no safe relative path."""
    listed: dict[str, RemoteObject] = {}
    for meta in objects:
        relative = meta["path"][len(folder_url.key()) + 1:]
        parts = relative.split("/")
        if any(p in ("", ".", "..") for p in parts):
            raise StorageError(f"{folder_url}: object key {meta['path']!r} is not a safe relative path")
        if _mirror_internal(parts[0]):
            continue  # the server's own names (a .cache/ uploaded by mistake); other hidden files are the model's
        listed[relative] = RemoteObject(meta["path"], int(meta["size"]), meta.get("e_tag"), meta.get("version"),
                                        modified=_modified(meta))
    return listed


def _is_current(target: Path, item: RemoteObject, old: RemoteObject | None) -> bool:
    """Whether ``target``, the copy of ``item`` recorded as ``old`` (None: none), is current: fetched from the same
    object (ETag, version, size) and unchanged since it was written."""
    return old is not None and old.identity == item.identity and _is_as_written(target, old)


def _streamed_names(streams: StreamedFiles | None, files: _SmallFiles) -> frozenset[str]:
    """The files of the folder ``files`` reads that ``streams`` leaves in the store (none without it); the
    StorageError of a read the decision asked for, which is the store's failure whatever the decision did with it."""
    if streams is None:
        return frozenset()
    try:
        left = frozenset(streams(tuple(files.listed), files.read))
    finally:
        if files.failure is not None:  # (over whatever the decision raised or answered after it)
            raise files.failure
    return frozenset(name for name in left if name in files.listed)


class _SmallFiles:
    """A model folder's listed files, and ``read_small`` for a :data:`StreamedFiles` decision about them.

    A file is read from the mirror's copy when that is current (a reload
    costs no request), else from the store. The first store failure is kept:
    the caller raises it, since a backend's hook may swallow what it raises.
    """

    def __init__(self, store: Any, folder_url: StoreURL, folder: Path, listed: Mapping[str, RemoteObject],
                 previous: RemoteFolder | None) -> None:
        self.listed = listed
        self.failure: StorageError | None = None
        self._store, self._url, self._folder, self._previous = store, folder_url, folder, previous

    def read(self, relative: str) -> bytes | None:
        """The bytes of the listed file ``relative``; None when it is not listed or over SMALL_FILE_BYTES."""
        import obstore

        item = self.listed.get(relative)
        if item is None or item.size > SMALL_FILE_BYTES:
            return None
        target = self._folder.joinpath(*relative.split("/"))
        if _is_current(target, item, self._previous.fetched.get(relative) if self._previous is not None else None):
            with contextlib.suppress(OSError):  # (gone meanwhile: read from the store)
                return target.read_bytes()[:SMALL_FILE_BYTES]
        url = f"{self._url.bucket_url}/{item.key}"
        options: dict[str, Any] = {"if_match": item.etag} if item.etag else {}  # (the object the listing gave)
        try:
            with store_call(self._url.scheme):
                data = obstore.get(self._store, item.key, options=options).bytes()
        except Exception as err:
            self.failure = self.failure or StorageError(f"{url}: cannot fetch: {describe_error(err, self._url.scheme)}")
            raise self.failure from None
        return bytes(data)[:SMALL_FILE_BYTES]


def _held_version(folder: Path, name: str, result: RemoteFolder) -> VersionHold:
    """The held version folder of the files ``result`` records in ``folder`` (under the folder's lock); a
    StorageError naming the path the cache refuses."""
    cache = folder / CACHE_SUBFOLDER
    try:
        # Builds (a bundle's executables, a cpp or cxx model's binary) stay the folder's, shared by its versions
        # under their content keys: a version's own would go with it, and every restart would build again.
        cache.mkdir(exist_ok=True)
    except OSError as err:
        raise _cache_write_failed(result.url, "make its builds' folder in", cache, err) from None
    try:
        return _hold_version(_version_folder(folder, name, result))
    except OSError as err:
        raise _cache_write_failed(result.url, "make its version folder in", folder / VERSIONS_FOLDER, err) from None


def _version_id(result: RemoteFolder) -> str:
    """The name of the version folder of the files ``result`` records: a hash of the URL and their identities."""
    document = {"url": result.url,
                "fetched": {k: [v.key, *v.identity] for k, v in sorted(result.fetched.items())},
                "streamed": {k: [v.key, *v.identity] for k, v in sorted(result.streamed.items())}}
    return hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()[:16]


def _version_folder(folder: Path, name: str, result: RemoteFolder) -> Path:
    """The version folder ``<folder>/.nereid-versions/<id>/<name>`` of the files ``folder`` holds now, as
    ``result`` records them: the one made before for the same files when it is intact, else a new one (under
    the folder's lock; OSError when the cache refuses it).

    Made aside and renamed into place whole. Each file is a hard link to the
    folder's (a copy where the file system has none): a later fetch replaces
    the folder's files by rename, never writing into one, so the version
    folder's stay as they are. Its ``.cache/`` is a link to the folder's own
    (made by the caller), so builds (executables, binaries) are shared by its
    versions.
    """
    versions = folder / VERSIONS_FOLDER
    base = _version_id(result)
    candidates = sorted((p for p in _listing(versions) if p.name == base or p.name.startswith(f"{base}-")),
                        key=lambda p: p.name != base)
    for candidate in candidates:
        if _version_intact(candidate / name, result):
            return candidate / name
    top = versions / (base if not candidates else f"{base}-{uuid.uuid4().hex[:8]}")
    building = versions / f"{VERSION_BUILDING_PREFIX}{uuid.uuid4().hex[:12]}"
    target = building / name
    try:
        target.mkdir(parents=True)
        for relative in [*result.fetched, MARKER_FILE]:
            source, copy = folder.joinpath(*relative.split("/")), target.joinpath(*relative.split("/"))
            copy.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(source, copy)
            except OSError as err:
                if err.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
                    raise
                shutil.copy2(source, copy)  # (keeps the modification time the record says)
        os.symlink(os.path.join(os.pardir, os.pardir, os.pardir, CACHE_SUBFOLDER), target / CACHE_SUBFOLDER)
        (building / IN_USE_FILE).touch()
        os.rename(building, top)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return top / name


def _version_intact(path: Path, result: RemoteFolder) -> bool:
    """Whether the version folder ``path`` still holds every file of ``result`` as written (a version folder is
    never changed by nereid: one that was, by hand, is not reused)."""
    return path.is_dir() and all(_is_as_written(path.joinpath(*relative.split("/")), item)
                                 for relative, item in result.fetched.items())


def _listing(folder: Path) -> list[Path]:
    try:
        with os.scandir(folder) as listing:
            return [Path(entry.path) for entry in listing]
    except OSError:
        return []


class VersionHold:
    """A loaded version's claim on its version folder: no server sharing the cache removes the folder while held.

    A shared flock on ``<id>/.nereid-in-use``, taken under the model folder's
    lock (where every removal happens, trying an exclusive lock without
    waiting). This process keeps one descriptor per version folder, counted,
    and never tries its own: on NFS a flock is a POSIX lock, which a process
    does not conflict with, and loses entirely when it closes any descriptor of
    the file.
    """

    def __init__(self, folder: Path, key: _HeldKey) -> None:
        self.folder = folder  # <model>/.nereid-versions/<id>/<model>: what the version runs from
        self.remote: RemoteFolder | None = None  # the objects it was made of (see folder_states.loaded_store_stamp)
        self._key = key
        self._released = False

    def release(self) -> None:
        """Let the version folder go (once; later calls do nothing); a folder no server holds any more is removed
        on a thread of its own, unless a fetch of the model holds its lock (that fetch removes it)."""
        if self._released:
            return
        self._released = True
        with _held_lock:
            fd, count = _held[self._key]
            if count > 1:
                _held[self._key] = (fd, count - 1)
                return
            del _held[self._key]
            os.close(fd)
        model_folder = self._key[0].parent.parent  # (<model>/.nereid-versions/<id>)
        threading.Thread(target=_prune_released, args=(model_folder, self.folder.name),
                         name="nereid-version-prune", daemon=True).start()


# A version folder's top (<id>) with the device and inode of its in-use file: a folder made anew under the same
# path (the cache deleted, then the model loaded again) is another folder, to be held of its own. Keyed by the
# path alone, its load counted one more hold on the deleted folder's descriptor and took no lock on the new one,
# so another server sharing the cache (or nereid check) removed the folder the model ran from (found by a bug
# hunt: READY, and every request failed).
_HeldKey = tuple[Path, int, int]
# This process's holds: the version folder's key -> (the descriptor holding its shared lock, how many holds).
_held: dict[_HeldKey, tuple[int, int]] = {}
_held_lock = threading.Lock()


def _hold_version(path: Path) -> VersionHold:
    """Hold the version folder ``path`` (under the model folder's lock)."""
    import fcntl

    top = path.parent
    with _held_lock:
        key = _key_of(top)
        if key is not None and key in _held:
            # (Not opened again: on NFS, closing any descriptor of the file would drop the process's lock.)
            fd, count = _held[key]
            _held[key] = (fd, count + 1)
            return VersionHold(path, key)
        fd = os.open(top / IN_USE_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # (nobody else takes it but a removal, under the lock this holds)
            key = _key_of(top)  # (as every lookup reads it: stat, not fstat, which an overlay may number apart)
        except BaseException:
            os.close(fd)
            raise
        if key is None:  # (removed as it was opened: not by a removal, which takes the lock this holds)
            os.close(fd)
            raise FileNotFoundError(errno.ENOENT, "the version folder's in-use file went as it was locked",
                                    str(top / IN_USE_FILE))
        _held[key] = (fd, 1)
    return VersionHold(path, key)


def _key_of(top: Path) -> _HeldKey | None:
    """The key of the version folder at ``top`` as it is now; None when it has no in-use file."""
    try:
        stat = os.stat(top / IN_USE_FILE)
    except OSError:
        return None
    return (top, stat.st_dev, stat.st_ino)


def _held_here(top: Path) -> bool:
    """Whether this process holds a version folder at ``top``: the one there now, or one made there before (its
    in-use file deleted, by a cleaner say, leaves the folder held, never removed under a model running from it;
    found by the review of the change)."""
    with _held_lock:
        return any(key[0] == top for key in _held)


def _prune_released(model_folder: Path, name: str) -> None:
    """:func:`_prune_versions` after a release, when the model folder's lock is free (a thread of its own)."""
    try:
        with _folder_lock(model_folder.parent / _lock_name(name), wait=False) as held:
            if held:
                _prune_versions(model_folder)
    except Exception:  # (a thread of its own: nothing above it would say)
        log.exception("%s: removing the version folders no server holds failed", model_folder / VERSIONS_FOLDER)


def _is_folder(path: Path) -> bool:
    """Whether ``path`` is a folder itself (not a symlink to one)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _prune_versions(folder: Path) -> bool:
    """Remove the version folders of ``folder`` that no server holds (under the folder's lock), and those a
    killed server left half made; returns whether any is still held."""
    import fcntl

    busy = False
    versions = folder / VERSIONS_FOLDER
    for top in _listing(versions):
        if top.name.startswith((VERSION_BUILDING_PREFIX, VERSION_DROPPED_PREFIX)):
            shutil.rmtree(top, ignore_errors=True)
            continue
        if not _is_folder(top):
            # Not a version folder (a file someone put there, a symlink): it kept the prune "busy" for ever, so the
            # copy of a model gone from the store was never dropped.
            with contextlib.suppress(OSError):
                top.unlink()
            continue
        if _held_here(top):
            busy = True
            continue
        try:
            fd = os.open(top / IN_USE_FILE, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            fd = None  # (none: not a version folder nereid made whole; removed)
        except OSError:
            busy = True
            continue
        try:
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    busy = True
                    continue
            doomed = versions / f"{VERSION_DROPPED_PREFIX}{uuid.uuid4().hex[:12]}"
            try:
                top.rename(doomed)
            except OSError:
                continue
        finally:
            if fd is not None:
                os.close(fd)
        shutil.rmtree(doomed, ignore_errors=True)
    return busy


def _fetch_staged(store: Any, folder_url: StoreURL, folder: Path, stale: list[tuple[str, RemoteObject, Path]],
                  keep: list[str]) -> dict[str, RemoteObject]:
    """Fetch the ``stale`` files into a staging folder inside ``folder``, then move them into place; returns what
    was fetched (an empty folder's marker left out). ``keep``: the files current already.

    Nothing in ``folder`` changes until every file is in: a fetch that fails
    leaves the version the folder held whole, where a loaded model may still
    read its files (a ``main.py`` run per request), never a mix of two
    versions that never existed together. Called under the folder's lock, so
    a staging folder found there is a killed fetch's, removed first.
    """
    for leftover in folder.glob(f"{STAGING_PREFIX}*"):
        shutil.rmtree(leftover, ignore_errors=True)
    staging = folder / f"{STAGING_PREFIX}{uuid.uuid4().hex[:12]}"
    try:
        results = _fetch_all(store, folder_url, [(relative, item, staging.joinpath(*relative.split("/")))
                                                 for relative, item, _ in stale])
        arrived = {relative: item for relative, item in results.items() if item is not None}
        # A path that changed between a file and a folder in the store: the stale one in the cache is in the way.
        _clear_conflicts(folder, [*keep, *(relative for relative, _, _ in stale)])
        for relative, _, target in stale:
            if relative in arrived:
                try:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    os.replace(staging.joinpath(*relative.split("/")), target)  # (the mtime recorded stays)
                except OSError as err:
                    raise _cache_write_failed(f"{folder_url.bucket_url}/{arrived[relative].key}", "move it into",
                                              target, err) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return arrived


def make_mirror_folder(location: StoreURL, root: Path, name: str) -> None:
    """Make ``root/name``, the (empty until materialized) mirror folder of the model folder ``location/name``;
    a file in its place is removed first (see :func:`_remove_stray_file`). OSError when the cache refuses."""
    folder = root / name
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return
    except FileExistsError:
        pass
    with _folder_lock(root / _lock_name(name), url=str(location.child(name))):
        _remove_stray_file(folder, str(location.child(name)))
        folder.mkdir(parents=True, exist_ok=True)


def _remove_stray_file(folder: Path, url: str, what: str = "the model's folder",
                       then: str = "the folder is fetched again") -> None:
    """Remove what is at ``folder``, a model's mirror folder (or another folder of nereid's own in it, ``what``),
    unless it is a folder: the cache is nereid's, and nereid never makes a file or a symlink there, so it is a
    damaged cache's, which would fail every load (logged, saying ``then``). Called under the folder's lock.

    A symlink is removed whatever it leads to: one to a folder elsewhere had
    the model's files fetched into that folder, and the sweep of stale files
    and versions delete every other file there (the path-safety hunt).
    """
    if os.path.lexists(folder) and not _is_folder(folder):
        kind = _kind_of(folder)
        folder.unlink()
        log.warning("%s: removed %s from the local cache: %s where %s belongs (a damaged cache?); %s", url, folder,
                    kind, what, then)


def _remove_stray_files(folder: Path, url: str) -> None:
    """:func:`_remove_stray_file` for the folders of nereid's own in the mirror folder ``folder`` (a file where one
    belongs failed every load: 'cannot make its version folder ...: Not a directory', or 'File exists' naming
    the versions for a ``.cache``, though a local folder's damaged ``.cache`` only makes its build a scratch one;
    the bug hunt of persistent caches). OSError when one cannot be removed. Called under the folder's lock."""
    _remove_stray_file(folder / VERSIONS_FOLDER, url, "the folder of its versions", "they are made again")
    _remove_stray_file(folder / CACHE_SUBFOLDER, url, "the folder of its builds", "they are built again")


def _kind_of(path: Path) -> str:
    """What is at ``path``, for a message: "a file", "a folder", "a FIFO", "a symlink" (not followed)..."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return "a file"
    if stat.S_ISLNK(mode):
        return "a symlink"
    return {stat.S_IFREG: "a file", stat.S_IFDIR: "a folder"}.get(stat.S_IFMT(mode)) or kind_of(mode)


def _lock_name(name: str) -> str:
    """The name of the lock file of the model folder ``name``, kept short enough for any folder name that fits."""
    if len(os.fsencode(name)) <= 240:
        return f".{name}{LOCK_SUFFIX}"
    return f".{hashlib.sha256(os.fsencode(name)).hexdigest()}{LOCK_SUFFIX}"


# How long a wait for a folder's lock goes unsaid: replicas sharing cache_dir that start together take turns
# for a second or less, and a WARNING each time taught operators to ignore the one for a peer hung holding it.
QUIET_LOCK_WAIT_S = 5.0


@contextlib.contextmanager
def _folder_lock(path: Path, wait: bool = True, url: str | None = None) -> Iterator[bool]:
    """Hold the exclusive lock ``path`` of a mirrored folder (processes sharing the cache take turns); yields True.

    With ``wait`` False, yields False at once when another holds it. A lock
    file is deleted by its holder when :func:`drop_mirror` removes its folder:
    one that was waiting for it then holds a lock on a file no longer there,
    which the next comer (making a new file) would not see, so the lock is
    taken again until the file locked is the one at ``path``. Taken through a
    read-write descriptor (on NFS flock is a POSIX lock, whose exclusive kind
    needs one). A folder or a symlink at ``path`` (a damaged cache,
    which nobody can lock either) is removed first, logged naming ``url``
    (the folder's URL) when given. A wait for a lock another process holds
    is logged once if it lasts past QUIET_LOCK_WAIT_S, naming that process
    where the system says (see :func:`_say_waiting`).
    """
    import fcntl  # POSIX only: imported where a lock is taken, so the module imports anywhere

    path.parent.mkdir(parents=True, exist_ok=True)
    clearings = 2  # (bounded: a server sharing the cache might damage it as fast)
    warned = False
    while True:
        try:
            # (Not through a symlink, which would make or lock a file wherever it leads: ELOOP, removed below.)
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o666)
        except OSError as err:
            # Any other refusal (a full disk; its folder not there, a mount not made yet?) is raised.
            if err.errno not in (errno.EISDIR, errno.ELOOP) or not clearings:
                raise
            clearings -= 1
            _remove_stray_lock(path, url)
            continue
        try:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not wait:
                    yield False
                    return
                if warned:
                    fcntl.flock(descriptor, fcntl.LOCK_EX)
                else:
                    warned = True
                    if not _taken_within(descriptor, QUIET_LOCK_WAIT_S):
                        _say_waiting(path, descriptor, url)
                        fcntl.flock(descriptor, fcntl.LOCK_EX)
            locked, current = os.fstat(descriptor), _stat_or_none(path)
            if current is None or (current.st_dev, current.st_ino) != (locked.st_dev, locked.st_ino):
                continue  # deleted (or made anew) while this waited: lock the file there now
            yield True
            return
        finally:
            os.close(descriptor)  # (lets the lock go)


def _taken_within(descriptor: int, seconds: float) -> bool:
    """Whether the lock open as ``descriptor`` was taken, tried without blocking every 50 ms for ``seconds``."""
    import fcntl

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
    return False


def _say_waiting(path: Path, descriptor: int, url: str | None) -> None:
    """Log that this waits for the lock ``path`` (open as ``descriptor``), which another holds.

    A peer sharing ``cache_dir`` that hangs while it holds the lock (stopped,
    stuck on NFS) keeps the wait going for good, and the only line was the
    load's note after 60 s, blaming the store (the bug hunt of persistent
    caches): a WARNING, with the holder's pid where ``/proc/locks`` gives it.
    Held by this very server (a removal of its released versions, a listing
    making the folder: a moment), only at DEBUG.
    """
    holder = _lock_holder(os.fstat(descriptor))
    if holder == os.getpid():
        log.debug("%s: waiting for %s, held by this server", url or path.parent, path)
        return
    log.warning("%s: waiting for %s, held by another process sharing cache_dir%s; this goes on once it lets go",
                url or path.parent, path, f" (pid {holder})" if holder is not None else "")


def _lock_holder(locked: os.stat_result) -> int | None:
    """The pid of the process holding a lock on the file ``locked`` (its stat), as Linux's ``/proc/locks`` says;
    None where it does not (another system; a holder in another PID namespace, shown as 0 or -1; on NFS, one on
    another host)."""
    wanted = f"{os.major(locked.st_dev):02x}:{os.minor(locked.st_dev):02x}:{locked.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as locks:
            for line in locks:
                # "1: FLOCK  ADVISORY  WRITE 4242 fe:00:2188599 0 EOF"; a waiter's line has "->" after the number.
                fields = line.split()
                if len(fields) > 5 and fields[1] != "->" and fields[5] == wanted:
                    return int(fields[4]) if fields[4].isdigit() and int(fields[4]) > 0 else None
    except OSError:
        pass
    return None


def _remove_stray_lock(path: Path, url: str | None) -> None:
    """Remove what is at ``path``, a folder's lock file that cannot be opened (a folder, a symlink), unless it
    is a regular file (or nothing) by now: a folder there failed every load of the model ('cannot make its lock
    file ...: Is a directory'; the bug hunt of persistent caches). Nobody holds a lock on what cannot be opened,
    so it goes without one; a server sharing the cache that removes it at the same time only makes the same
    lock file. Logged."""
    kind = _kind_of(path)
    if _remove_unless_regular(path):
        log.warning("%s: removed %s from the local cache: %s where the model folder's lock file belongs (a damaged "
                    "cache?); it is made again", url or path.parent, path, kind)


@contextlib.contextmanager
def _fetch_lock(url: str, path: Path) -> Iterator[None]:
    """:func:`_folder_lock` for a fetch of ``url``'s folder: a lock file the local cache refuses (a full disk, a
    folder where the file must be) is a StorageError naming it, as a refused copy of a file is, so the watcher
    tries the load again once the cache has room, where a bare OSError read as the model's own fault."""
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(_folder_lock(path, url=url))
        except OSError as err:
            raise _cache_write_failed(url, "make its lock file in", path, err) from None
        yield


def _stat_or_none(path: Path) -> os.stat_result | None:
    """``os.stat(path)``; None when nothing is there."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None


def drop_mirror(location: StoreURL, name: str, folder: Path) -> bool:
    """Remove ``folder``, the cached copy of the model folder ``location/name``, and its lock file (blocking).

    Only when the store confirms the prefix is gone (one listing of it;
    StorageError when it cannot be listed) and the folder's lock is free:
    a server sharing the cache that is fetching the folder holds it, and the
    folder stays (a later call removes it). The folder is renamed aside under
    the lock and deleted after (a server making the folder anew meanwhile
    makes a new one); so are the ones an interrupted removal left. Returns
    whether anything was removed. Not while a loaded version of any server
    sharing the cache (loaded before the prefix was deleted) runs from one of
    its version folders (see :class:`VersionHold`): a later call removes it.
    """
    root = folder.parent
    lock = root / _lock_name(name)
    if not os.path.lexists(folder) and not os.path.lexists(lock):
        return False
    with _folder_lock(lock, wait=False, url=str(location.child(name))) as held:
        if not held or remote_folder_exists(location, name):
            return False
        if _prune_versions(folder):  # a version of it still runs (here, or on a server sharing the cache)
            return False
        with contextlib.suppress(FileNotFoundError):  # (a lock file left alone)
            folder.rename(root / f"{DROPPED_PREFIX}{uuid.uuid4().hex}")
        lock.unlink(missing_ok=True)  # while held: a waiter locks the file made anew (see _folder_lock)
    _remove_dropped(root)
    log.info("%s: gone from the store; its copy in the cache (%s) was removed", location.child(name), folder)
    return True


def _remove_dropped(root: Path) -> None:
    """Delete the folders :func:`drop_mirror` renamed aside in ``root`` (another server's, or an interrupted one's,
    too: deleting one twice at once is harmless)."""
    try:
        with os.scandir(root) as listing:
            doomed = [Path(entry.path) for entry in listing
                      if entry.name.startswith(DROPPED_PREFIX) and entry.is_dir(follow_symlinks=False)]
    except OSError:
        return
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)


def leftover_names(root: Path, present: Iterable[str]) -> list[str]:
    """The names with a folder or a lock file in the mirror ``root`` that are not in ``present`` (a listing of the
    store's model folders): candidates for :func:`drop_mirror`."""
    present = set(present)
    kept_locks = {_lock_name(name) for name in present}
    names: set[str] = set()
    try:
        with os.scandir(root) as listing:
            for entry in listing:
                if entry.name.startswith(DROPPED_PREFIX):
                    continue
                if entry.name.startswith("."):
                    # A lock whose folder is gone (a too-long name's hashed lock is named by its hash: dropping
                    # that name removes only the free lock file).
                    if entry.name.endswith(LOCK_SUFFIX) and entry.name not in kept_locks and entry.is_file():
                        names.add(entry.name[1:-len(LOCK_SUFFIX)])
                elif entry.name not in present and entry.is_dir(follow_symlinks=False):
                    names.add(entry.name)
    except OSError:  # no mirror yet
        return []
    return sorted(name for name in names if name and not name.startswith("."))


def ancestor_paths(paths: Iterable[str]) -> set[str]:
    """Every folder above each of the ``/``-separated ``paths`` (``a`` and ``a/b`` for ``a/b/c``): the keys that are
    folders of other keys, as a listing without trailing slashes shows them."""
    return {"/".join(parts[:depth]) for parts in (path.split("/") for path in paths) for depth in range(1, len(parts))}


def _without_folder_markers(store: Any, folder_url: StoreURL, objects: list[dict]) -> list[dict]:
    """The listing without the folder markers it can recognise: the zero-byte objects a console's "Create folder" makes.

    Their keys end in ``/``, which the listing drops, so a marker shows as an
    object named like the folder it marks. One with bytes in it is a real
    file that clashes with a folder of the same name: StorageError. A zero-byte
    entry beside a file of the same name is that file's marker twin. The marker
    of an empty folder looks like an empty file here; :func:`_fetch` tells them
    apart (the key without the ``/`` does not exist).
    """
    folder_key = folder_url.key()
    folders = {folder_key, *(f"{folder_key}/{path}"
                             for path in ancestor_paths(meta["path"][len(folder_key) + 1:] for meta in objects))}
    sized = {meta["path"] for meta in objects if int(meta["size"])}
    kept = []
    for meta in objects:
        if not int(meta["size"]) and meta["path"] in sized:
            continue  # "x/" listed as "x" next to the real file "x"
        if meta["path"] not in folders:
            kept.append(meta)
        elif int(meta["size"]):
            # Listed under "<folder_key>/", the folder's own entry can only be its object "<folder_key>/".
            if meta["path"] == folder_key or _is_folder_object(store, folder_url.scheme, meta["path"]):
                raise _folder_object_with_bytes(folder_url, meta["path"], int(meta["size"]))
            raise StorageError(f"{folder_url}: object key {meta['path']!r} is both a file ({int(meta['size'])} "
                               "bytes) and the folder of other objects; a model folder cannot hold both")
    return kept


def _is_folder_object(store: Any, scheme: str, key: str) -> bool:
    """Whether the listing's entry ``key`` is the object ``key + "/"`` (a folder's own object, whose trailing
    ``/`` the listing drops) rather than the file ``key``: a listing of ``key + "/"`` holds it, and would not hold
    the file. False when that cannot be listed (the caller's own message stands then)."""
    import obstore

    try:
        with store_call(scheme):
            for chunk in obstore.list(store, key + "/", chunk_size=1):
                return any(meta["path"] == key for meta in chunk)  # (sorted first under its own prefix)
    except Exception:  # a second look only: the first error is the one to report
        return False
    return False


def _folder_object_with_bytes(folder_url: StoreURL, key: str, size: int) -> StorageError:
    """The error of the object ``key + "/"`` holding ``size`` bytes: a folder's own object, never a model file."""
    return StorageError(f"{folder_url}: object key {key + '/'!r} holds {size} bytes, but a key ending in '/' is a "
                        "folder's own object, which nereid's store client (obstore) cannot read: delete it, or "
                        "upload the file under a key without the trailing '/'")


def read_marker(folder: Path) -> RemoteFolder | None:
    """What :func:`materialize` recorded in ``folder``; None for a local (not mirrored) folder.

    StorageError when the record is there but cannot be read. Read without
    blocking, as a model's own files are: a FIFO in its place (a damaged
    cache) is refused, where opening it waited for a writer for good, holding
    the folder's lock, so that no later load of the model (nor any server
    sharing ``cache_dir``) could fetch it again until a restart (a bug hunt).
    """
    marker = Path(folder) / MARKER_FILE
    if not os.path.lexists(marker):
        return None
    try:
        document = json.loads(read_text_file(marker, MARKER_LIMIT_BYTES))
        return RemoteFolder(document["url"],
                            {k: _recorded_object(v) for k, v in document["fetched"].items()},
                            {k: _recorded_object(v) for k, v in document["streamed"].items()})
    except ConfigError as err:  # not a regular file, too large, not text: its reason names the file already
        raise StorageError(f"{marker}: unreadable ({str(err).removeprefix(f'{marker}: ')})") from None
    except Exception as err:  # any shape at all: garbage, another nereid version's fields
        raise StorageError(f"{marker}: unreadable ({type(err).__name__}: {err})") from None


def _recorded(item: RemoteObject) -> dict[str, Any]:
    """``item`` as the record holds it: its fields, less those left empty (None).

    Servers of several nereid versions share a record (a rollback, a rolling
    upgrade over one cache_dir), and a reader of an older version refuses a
    field it does not know: every record this version wrote named
    ``modified``, null for every object with an ETag, and an older server
    fetched each folder whole again at every load, with a WARNING (the upgrade
    hunt). A field left out is its default when read.
    """
    return {name: value for name, value in asdict(item).items() if value is not None}


def _recorded_object(recorded: dict[str, Any]) -> RemoteObject:
    """A record's object, the fields a later nereid version added passed over (compared with the listing by the
    fields this version knows, as it would have recorded them)."""
    return RemoteObject(**{name: value for name, value in recorded.items() if name in _REMOTE_OBJECT_FIELDS})


_REMOTE_OBJECT_FIELDS = frozenset(known.name for known in fields(RemoteObject))


def _remove_unless_regular(path: Path) -> bool:
    """Remove what is at ``path``, a name of nereid's own in the cache, unless it is a regular file (or nothing);
    returns whether anything was removed. Never raises: what cannot be removed fails where it is written."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return False
    if stat.S_ISREG(mode):
        return False
    if stat.S_ISDIR(mode):
        return remove_tree(path)
    try:
        path.unlink()  # (a FIFO, a socket, a symlink: the link itself, never what it leads to)
    except OSError:
        return False
    return True


def _fetch_all(store: Any, folder_url: StoreURL,
               jobs: list[tuple[str, RemoteObject, Path]]) -> dict[str, RemoteObject | None]:
    """Fetch each ``(relative, item, target)``, FETCH_CONCURRENCY at a time; the first failure is raised.

    An item maps to None when it was an empty folder's marker (nothing written).
    """
    if len(jobs) <= 1:
        return {relative: _fetch(store, folder_url, item, target) for relative, item, target in jobs}
    with concurrent.futures.ThreadPoolExecutor(min(FETCH_CONCURRENCY, len(jobs)),
                                               thread_name_prefix="nereid-fetch") as pool:
        results = pool.map(lambda job: _fetch(store, folder_url, job[1], job[2]), jobs)
        return {relative: result for (relative, _, _), result in zip(jobs, results)}


def _fetch(store: Any, folder_url: StoreURL, item: RemoteObject, target: Path) -> RemoteObject | None:
    """Fetch ``item`` into ``target``; None when it is the marker of an empty folder (nothing to write)."""
    import obstore

    url = f"{folder_url.bucket_url}/{item.key}"
    options: dict[str, Any] = {"if_match": item.etag} if item.etag else {}
    if item.size > FETCH_RANGE_BYTES:
        options["range"] = (0, FETCH_RANGE_BYTES)
    try:
        with store_call(folder_url.scheme):
            result = obstore.get(store, item.key, options=options)
    except Exception as err:
        if not item.size and is_not_found(err):
            # The listing drops a key's trailing "/", so an empty folder's marker "empty/" shows as a
            # zero-byte "empty" that does not exist: a folder marker, skipped as the others are.
            return None
        if is_not_found(err) and _is_folder_object(store, folder_url.scheme, item.key):
            raise _folder_object_with_bytes(folder_url, item.key, item.size) from None
        raise StorageError(f"{url}: cannot fetch: {describe_error(err, folder_url.scheme)}") from None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # Written piece by piece as the bytes arrive (a StorageError from the store mid-way, or a size other than
        # the listing's, removes the temporary file and leaves ``target`` as it was).
        atomic_write(target, _received_whole(store, result, url, item, folder_url.scheme))
        written = os.lstat(target)
    except OSError as err:
        raise _cache_write_failed(url, "write it into", target, err) from None
    # Recorded as the listing gave it, since the next load compares it with the next listing: a GET also says
    # the version (a versioned bucket) where a listing says none, and the file would never match again. The
    # written file's mtime is recorded too: a copy changed in place since, even to the same size, is fetched again.
    return replace(item, mtime_ns=written.st_mtime_ns)


def _received_whole(store: Any, first: Any, url: str, item: RemoteObject, scheme: str) -> Iterator[memoryview]:
    """The bytes of ``item`` as they arrive: those of the GET ``first``, then, for a file of more than
    FETCH_RANGE_BYTES, of one ranged GET after another (each must match the listing's ETag).

    Each request is bounded by the store client's timeout (30 s), so a whole-file GET of a large file on a slow
    link could never finish, and every retry failed the same way (a bug hunt: 100 MB at 3 MB/s); a range of
    FETCH_RANGE_BYTES fits it down to about half a megabyte a second.
    """
    import obstore

    yield from _received(first, url, min(item.size, FETCH_RANGE_BYTES), scheme, total=item.size)
    for start in range(FETCH_RANGE_BYTES, item.size, FETCH_RANGE_BYTES):
        end = min(start + FETCH_RANGE_BYTES, item.size)
        options: dict[str, Any] = {"range": (start, end)}
        if item.etag:
            options["if_match"] = item.etag  # (a file replaced mid-fetch fails, never mixes two versions)
        try:
            with store_call(scheme):
                result = obstore.get(store, item.key, options=options)
        except Exception as err:
            raise StorageError(f"{url}: cannot fetch: the store failed after {start} of {item.size} bytes: "
                               f"{describe_error(err, scheme)}") from None
        yield from _received(result, url, end - start, scheme, offset=start, total=item.size)


def _received(result: Any, url: str, size: int, scheme: str, offset: int = 0,
              total: int | None = None) -> Iterator[memoryview]:
    """The bytes of the GET ``result`` of ``url`` as they arrive, about FETCH_CHUNK_BYTES at a time.

    StorageError naming ``url`` when the store fails mid-way or sends other
    than the ``size`` bytes asked for (it stops reading as soon as it has
    more). ``offset`` and ``total``: where those bytes lie in the file, and its
    size (the listing's), for the messages; by default, the whole file.
    """
    total = size if total is None else total
    received = 0
    try:
        with store_call(scheme):
            stream = result.stream(min_chunk_size=FETCH_CHUNK_BYTES)
    except Exception as err:
        raise StorageError(f"{url}: cannot fetch: {describe_error(err, scheme)}") from None
    while True:
        try:  # (not around the yield: only the store's own failures are said to be the store's)
            with store_call(scheme):
                chunk = next(stream, None)
        except Exception as err:
            raise StorageError(f"{url}: cannot fetch: the store failed after {offset + received} of {total} bytes: "
                               f"{describe_error(err, scheme)}") from None
        if chunk is None:
            break
        received += len(chunk)
        if received > size:
            raise StorageError(f"{url}: fetched at least {offset + received} bytes, but the listing says {total}")
        yield memoryview(chunk)
    if received != size:
        raise StorageError(f"{url}: fetched {offset + received} bytes, but the listing says {total}")


def _cache_write_failed(url: str, what: str, path: Path, err: OSError) -> StorageError:
    """The error of ``url``'s copy that the local cache refused: a name the bucket takes but the local file
    system does not (over 255 bytes), a full disk."""
    hint = " (a local file system allows 255 bytes per name)" if err.errno == errno.ENAMETOOLONG else ""
    # Named where the file goes, not by the staging folder it is fetched into: its random name made each try's
    # reason new, so a full cache_dir was an ERROR at every retry, for ever (the storage hunt).
    shown = _STAGING_PART.sub("", str(path))
    return StorageError(f"{url}: cannot {what} the local cache ({shown}, under server.cache_dir): "
                        f"{err.strerror or err}{hint}")


# A fetch's staging folder in a path (see STAGING_PREFIX): its name is random.
_STAGING_PART = re.compile(rf"/{re.escape(STAGING_PREFIX)}[0-9a-f]+(?=/|$)")


def _is_as_written(path: Path, item: RemoteObject) -> bool:
    """Whether ``path`` is still the regular file ``item`` was fetched into: the same size and modification time."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_size == item.size and info.st_mtime_ns == item.mtime_ns


def _clear_conflicts(folder: Path, relatives: Iterable[str]) -> None:
    """Remove what the cache holds in the way of the files ``relatives`` (paths relative to ``folder``).

    That is a file where one of their folders goes, or a folder where one of
    them goes: ``data`` a file, then ``data/x.txt`` in the store, or the reverse.
    """
    for relative in relatives:
        parts = relative.split("/")
        path = folder
        for part in parts[:-1]:
            path = path / part
            if os.path.lexists(path) and (path.is_symlink() or not path.is_dir()):
                path.unlink()
        target = folder.joinpath(*parts)
        if os.path.isdir(target) and not os.path.islink(target):  # (False for a name too long: fails at its write)
            shutil.rmtree(target)


def _mirror_internal(name: str) -> bool:
    """Whether ``name``, directly in a mirrored model folder, is the server's own (the executable cache, the
    record of what was fetched, the versions, a fetch's staging folder): never fetched, never removed as stale.
    Any other hidden file is the model's, fetched as any file is (`.scale` beside main.py, a cpp model's
    `.gen/factor.h`: skipped, the model worked from a local folder and failed from a bucket; a bug hunt)."""
    return name == CACHE_SUBFOLDER or name.startswith(".nereid-")


def _remove_others(folder: Path, keep: set[str]) -> None:
    """Remove local files the store no longer has (the executable cache and the marker stay)."""
    for path in sorted(folder.rglob("*"), reverse=True):
        relative = path.relative_to(folder)
        if _mirror_internal(relative.parts[0]):
            continue
        if path.is_dir() and not path.is_symlink():
            with contextlib.suppress(OSError):
                path.rmdir()  # only when empty
        elif relative.as_posix() not in keep:
            path.unlink(missing_ok=True)
