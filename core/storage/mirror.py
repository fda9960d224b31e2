"""A model repository in an object store, mirrored file by file into the local cache folder.

The model folders are the prefixes one level below the repository URL, as
locally. Loading a model *materializes* its folder: every object under it is
fetched into ``<cache_dir>/repositories/<repository>/<model>/``, except, in a
bundle (a folder with a ``manifest.yaml``), the weights (``*.safetensors``),
which stay in the store and are streamed by the bundle's loader. A file is fetched again only when its ETag (or
version) changed since it was last fetched; the folder's ``.nereid-remote.json``
records them, and the weights the backend must stream. Files are written under
temporary names and renamed into place, so a running model never sees a half
file, and files gone from the store are removed. Nothing is ever written to
the store.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from nereid.files import atomic_write, locked
from nereid.storage.client import StorageError, describe_error, open_store
from nereid.storage.url import StoreURL

log = logging.getLogger(__name__)

MARKER_FILE = ".nereid-remote.json"
STREAMED_SUFFIX = ".safetensors"
BUNDLE_MARKER = "manifest.yaml"  # a folder holding one is a bundle, whose loader streams its weights
CACHE_SUBFOLDER = ".cache"  # the executable cache: local, never mirrored or removed
# Small files are fetched this many at a time: a folder with a vendored package holds hundreds, and a
# store answers each GET in tens of milliseconds.
FETCH_CONCURRENCY = 16


@dataclass(frozen=True)
class RemoteObject:
    """One object of a model folder: its key, size and identity (ETag, version)."""

    key: str
    size: int
    etag: str | None = None
    version: str | None = None

    @property
    def identity(self) -> tuple[str | None, str | None, int]:
        """What says the object's bytes are unchanged."""
        return (self.etag, self.version, self.size)


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
    """The local folder holding the mirrored model folders of the repository at ``location``."""
    return Path(cache_dir) / "repositories" / location.cache_name()


def list_remote_folders(location: StoreURL) -> list[str]:
    """Names of the model folders under ``location`` (hidden ones skipped); StorageError on failure."""
    import obstore

    store = open_store(location)
    prefix = location.key() + "/" if location.key() else ""
    try:
        listing = obstore.list_with_delimiter(store, prefix or None)
    except Exception as err:
        raise StorageError(f"{location}: cannot list the model folders: {describe_error(err, location.scheme)}") \
            from None
    names = sorted({p.rstrip("/").rsplit("/", 1)[-1] for p in listing["common_prefixes"]})
    return [n for n in names if n and not n.startswith(".")]


def list_objects(location: StoreURL) -> list[tuple[str, int, str]]:
    """Every object under ``location``: its key relative to it, its size and ETag; StorageError on failure."""
    import obstore

    store = open_store(location)
    prefix = location.key() + "/" if location.key() else ""
    try:
        return [(meta["path"][len(prefix):], int(meta["size"]), meta.get("e_tag") or "")
                for chunk in obstore.list(store, prefix or None) for meta in chunk]
    except Exception as err:
        raise StorageError(f"{location}: cannot list the model folders: {describe_error(err, location.scheme)}") \
            from None


def materialize(location: StoreURL, name: str, folder: Path) -> RemoteFolder:
    """Bring ``folder`` up to date with the model folder ``location/name``; returns what it holds.

    Raises StorageError naming the URL when the folder is empty or gone, a key
    is unsafe, or a fetch fails.
    """
    import obstore

    folder_url = location.child(name)
    store = open_store(location)
    try:
        objects = [o for chunk in obstore.list(store, folder_url.key() + "/") for o in chunk]
    except Exception as err:
        raise StorageError(f"{folder_url}: cannot list the model folder: {describe_error(err, location.scheme)}") \
            from None
    objects = _without_folder_markers(str(folder_url), folder_url.key(), objects)
    if not objects:
        raise StorageError(f"{folder_url}: no such model folder (no objects under it)")
    folder.mkdir(parents=True, exist_ok=True)
    with locked(folder.parent / f".{name}.lock"):
        previous = read_marker(folder)
        fetched: dict[str, RemoteObject] = {}
        streamed: dict[str, RemoteObject] = {}
        stale: list[tuple[str, RemoteObject, Path]] = []  # new or changed: fetched below
        # Only a bundle's loader streams weights; any other model (a main.py reading its own
        # .safetensors) gets every file on disk.
        streams = f"{folder_url.key()}/{BUNDLE_MARKER}" in {o["path"] for o in objects}
        for meta in objects:
            relative = meta["path"][len(folder_url.key()) + 1:]
            parts = relative.split("/")
            if any(p in ("", ".", "..") for p in parts):
                raise StorageError(f"{folder_url}: object key {meta['path']!r} is not a safe relative path")
            if any(p.startswith(".") for p in parts):
                continue  # hidden, as locally (a .cache/ uploaded by mistake)
            item = RemoteObject(meta["path"], int(meta["size"]), meta.get("e_tag"), meta.get("version"))
            if streams and relative.endswith(STREAMED_SUFFIX):
                streamed[relative] = item
                continue
            old = previous.fetched.get(relative) if previous is not None else None
            target = folder.joinpath(*parts)
            if old is not None and old.identity == item.identity and _has_size(target, item.size):
                fetched[relative] = old
                continue
            stale.append((relative, item, target))
        fetched.update((relative, item) for relative, item in _fetch_all(store, folder_url, stale).items()
                       if item is not None)  # (None: an empty folder's marker, skipped)
        _remove_others(folder, set(fetched))
        result = RemoteFolder(str(folder_url), fetched, streamed)
        atomic_write(folder / MARKER_FILE, [json.dumps(
            {"url": result.url, "fetched": {k: asdict(v) for k, v in fetched.items()},
             "streamed": {k: asdict(v) for k, v in streamed.items()}}, indent=1, sort_keys=True).encode()])
    log.info("%s: %d file(s) fetched or current in %s, %d weights file(s) left to stream", folder_url, len(fetched),
             folder, len(streamed))
    return result


def _without_folder_markers(url: str, folder_key: str, objects: list[dict]) -> list[dict]:
    """The listing without the folder markers it can recognise: the zero-byte objects a console's "Create folder" makes.

    Their keys end in ``/``, which the listing drops, so a marker shows as an
    object named like the folder it marks. One with bytes in it is a real
    file that clashes with a folder of the same name: StorageError. A zero-byte
    entry beside a file of the same name is that file's marker twin. The marker
    of an empty folder looks like an empty file here; :func:`_fetch` tells them
    apart (the key without the ``/`` does not exist).
    """
    folders = {folder_key}
    for meta in objects:
        parts = meta["path"][len(folder_key) + 1:].split("/")
        folders.update(f"{folder_key}/{'/'.join(parts[:depth])}" for depth in range(1, len(parts)))
    sized = {meta["path"] for meta in objects if int(meta["size"])}
    kept = []
    for meta in objects:
        if not int(meta["size"]) and meta["path"] in sized:
            continue  # "x/" listed as "x" next to the real file "x"
        if meta["path"] not in folders:
            kept.append(meta)
        elif int(meta["size"]):
            raise StorageError(f"{url}: object key {meta['path']!r} is both a file ({int(meta['size'])} bytes) and "
                               "the folder of other objects; a model folder cannot hold both")
    return kept


def read_marker(folder: Path) -> RemoteFolder | None:
    """What :func:`materialize` recorded in ``folder``; None for a local (not mirrored) folder."""
    try:
        document = json.loads((Path(folder) / MARKER_FILE).read_text(encoding="utf-8"))
        return RemoteFolder(document["url"],
                            {k: RemoteObject(**v) for k, v in document["fetched"].items()},
                            {k: RemoteObject(**v) for k, v in document["streamed"].items()})
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise StorageError(f"{folder / MARKER_FILE}: unreadable ({type(err).__name__}: {err}); delete the folder "
                           "to fetch it again") from None


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
    try:
        result = obstore.get(store, item.key, options=options)
        data = result.bytes()
    except Exception as err:
        if not item.size and _is_not_found(err):
            # The listing drops a key's trailing "/", so an empty folder's marker "empty/" shows as a
            # zero-byte "empty" that does not exist: a folder marker, skipped as the others are.
            return None
        raise StorageError(f"{url}: cannot fetch: {describe_error(err, folder_url.scheme)}") from None
    if len(data) != item.size:
        raise StorageError(f"{url}: fetched {len(data)} bytes, but the listing says {item.size}")
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(target, [memoryview(data)])
    meta = result.meta
    return RemoteObject(item.key, item.size, meta.get("e_tag") or item.etag, meta.get("version") or item.version)


def _is_not_found(err: BaseException) -> bool:
    """Whether obstore's ``err`` says the object does not exist (it raises FileNotFoundError or NotFoundError)."""
    return isinstance(err, FileNotFoundError) or type(err).__name__ == "NotFoundError"


def _has_size(path: Path, size: int) -> bool:
    try:
        return path.is_file() and path.stat().st_size == size
    except OSError:
        return False


def _remove_others(folder: Path, keep: set[str]) -> None:
    """Remove local files the store no longer has (the executable cache and the marker stay)."""
    for path in sorted(folder.rglob("*"), reverse=True):
        relative = path.relative_to(folder)
        if relative.parts[0] in (CACHE_SUBFOLDER, MARKER_FILE) or relative.parts[0].startswith("."):
            continue
        if path.is_dir() and not path.is_symlink():
            with contextlib.suppress(OSError):
                path.rmdir()  # only when empty
        elif relative.as_posix() not in keep:
            path.unlink(missing_ok=True)
