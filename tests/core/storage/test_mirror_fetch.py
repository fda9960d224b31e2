"""Fetching a model folder's files from object storage into the cache (``nereid.storage.mirror``), against a real S3
API (moto; see tests/moto_s3.py): how the bytes travel from the store to the local file, and what records them."""

from __future__ import annotations

import os
from typing import Any, Iterator

import obstore
import pytest

from moto_s3 import upload_folder
from nereid.settings import load_settings
from nereid.storage import StorageError, materialize_model_folder
from nereid.storage import mirror
from nereid.storage.mirror import MARKER_FILE, read_marker


class _WatchedGet:
    """A GET result that records the size of every buffer it hands out, whichever way it is read."""

    def __init__(self, result: Any, pieces: list[int], on_disk: Any = None) -> None:
        self._result, self._pieces = result, pieces
        self._on_disk = on_disk  # called as each piece is handed out: what the fetch has written so far
        self.written: list[int] = []

    def bytes(self) -> Any:
        data = self._result.bytes()
        self._pieces.append(len(data))
        return data

    def stream(self, min_chunk_size: int = 10 * 1024 * 1024) -> Iterator[bytes]:
        for chunk in self._result.stream(min_chunk_size=min_chunk_size):
            self._pieces.append(len(chunk))
            if self._on_disk is not None:
                self.written.append(self._on_disk())
            yield chunk

    def __iter__(self) -> Iterator[bytes]:
        return self.stream()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._result, name)


def test_a_large_file_is_written_as_it_arrives_never_held_whole(s3, tmp_path, monkeypatch, bucket_config) -> None:
    """Defect (found by a bug hunt): every fetched file was read whole into memory, 16 at a time, so a python
    model's own weights (16 x 2 GB shards) needed 32 GB just to be copied to disk. Each file is written piece by
    piece as it arrives; the bytes, and the record that saves refetching them, are as before."""
    data = os.urandom(6 << 20)
    obstore.put(s3.store, f"{s3.prefix}/big/main.py", b"print()")
    obstore.put(s3.store, f"{s3.prefix}/big/weights.bin", data)
    monkeypatch.setattr(mirror, "FETCH_CHUNK_BYTES", 256 << 10, raising=False)
    pieces: list[int] = []
    gets: list[_WatchedGet] = []
    real_get = obstore.get

    def on_disk() -> int:  # the bytes in the cache's files by now (the one being written among them)
        return sum(path.stat().st_size for path in (tmp_path / "cache").rglob("*") if path.is_file())

    def watched_get(store: Any, key: str, **kwargs: Any) -> _WatchedGet:
        big = key.endswith(".bin")
        gets.append(_WatchedGet(real_get(store, key, **kwargs), pieces if big else [], on_disk if big else None))
        return gets[-1]
    monkeypatch.setattr(obstore, "get", watched_get)
    server = load_settings(bucket_config(tmp_path, s3.url())).server
    local = materialize_model_folder(server, "big")
    assert (local / "weights.bin").read_bytes() == data
    assert sum(pieces) == len(data) and len(pieces) > 4
    assert max(pieces) < len(data) // 4, pieces  # (a piece is at least FETCH_CHUNK_BYTES, plus what the socket gave)
    # Written as it arrived (the review of the tests: a fetch that joined the pieces, then wrote them, passed too):
    # when the last piece came, all but it was on disk already.
    (written,) = [get.written for get in gets if get.written]
    assert written[-1] >= len(data) - pieces[-1], (written, pieces)
    assert read_marker(local).fetched["weights.bin"].size == len(data)
    # Recorded as before: current, it is not fetched again; changed in the bucket, it is.
    materialize_model_folder(server, "big")
    assert len(s3.gets("big/weights.bin")) == 1
    obstore.put(s3.store, f"{s3.prefix}/big/weights.bin", data[::-1])
    materialize_model_folder(server, "big")
    assert (local / "weights.bin").read_bytes() == data[::-1]


class _Answer:
    """A GET result whose stream gives ``chunks``, then raises ``failure`` (if any)."""

    def __init__(self, chunks: list[bytes], failure: Exception | None = None) -> None:
        self.chunks, self.failure = chunks, failure

    def stream(self, min_chunk_size: int) -> Iterator[bytes]:
        yield from self.chunks
        if self.failure is not None:
            raise self.failure


@pytest.mark.parametrize("answer, expected", [
    (_Answer([b"abc", b"de"]), "fetched 5 bytes, but the listing says 8"),
    (_Answer([b"abcd", b"efgh", b"ij"]), "fetched at least 10 bytes, but the listing says 8"),
    (_Answer([b"abc"], ConnectionResetError("connection reset by peer")),
     "cannot fetch: the store failed after 3 of 8 bytes: ConnectionResetError: connection reset by peer"),
])
def test_a_file_that_arrives_short_long_or_broken_is_named_and_never_written(tmp_path, answer, expected) -> None:
    from nereid.files import atomic_write

    target = tmp_path / "data.bin"
    target.write_bytes(b"previous")
    url = "s3://models/prod/m/data.bin"
    with pytest.raises(StorageError) as raised:
        atomic_write(target, mirror._received(answer, url, 8, "s3"))
    assert str(raised.value) == f"{url}: {expected}"
    assert target.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.bin"]  # (no temporary file left)


def test_a_cache_write_failure_names_the_file_where_it_goes_so_a_repeat_is_the_same_reason(tmp_path) -> None:
    """Found by the storage hunt: a full cache_dir's reason named the fetch's staging folder, whose name is random,
    so each retry's failure was a new reason: an ERROR, and "failed again, for another reason", every time."""
    import errno

    from nereid.storage import failure_kind
    from nereid.storage.mirror import STAGING_PREFIX, _cache_write_failed

    full = OSError(errno.ENOSPC, "No space left on device")
    reasons = [str(_cache_write_failed("s3://b/p/big/data.bin", "write it into",
                                       tmp_path / "big" / f"{STAGING_PREFIX}{token}" / "data.bin", full))
               for token in ("2206c07d9273", "458a2eb9dbe1")]
    assert reasons[0] == (f"s3://b/p/big/data.bin: cannot write it into the local cache ({tmp_path}/big/data.bin, "
                          "under server.cache_dir): No space left on device")
    assert failure_kind(reasons[0]) == failure_kind(reasons[1])


def test_an_object_of_a_store_that_gives_no_etag_is_known_by_its_modification_time_too() -> None:
    """Found by the storage hunt: behind a store that lists no ETags (some S3-compatible ones), an edit that kept a
    file's size was never seen, by the watcher nor by a RepositoryModelLoad. An object with an ETag keeps the
    identity it had (its version folders' names depend on it)."""
    import datetime

    from nereid.storage.mirror import RemoteObject, _modified

    earlier, later = (datetime.datetime(2026, 12, 4, 17, minute, tzinfo=datetime.timezone.utc) for minute in (1, 2))
    assert _modified({"e_tag": None, "last_modified": earlier}) != _modified({"e_tag": None, "last_modified": later})
    assert _modified({"e_tag": '"abc"', "last_modified": earlier}) is None
    unlabelled = [RemoteObject("p/m/w.bin", 4, None, None, modified=_modified({"last_modified": when}))
                  for when in (earlier, later)]
    assert unlabelled[0].identity != unlabelled[1].identity
    assert RemoteObject("p/m/w.bin", 4, '"abc"', None).identity == ('"abc"', None, 4)


def test_the_record_of_what_was_fetched_is_read_by_older_and_later_nereid_versions(s3, tmp_path, bucket_config) -> None:
    """Found by the upgrade hunt: every record named ``modified`` (null for every object with an ETag, the field
    added at stop 51), which an older server's reader refused: after a rollback, or beside an older replica sharing
    cache_dir, each folder was fetched whole again at every load, with a WARNING. Fields left empty are left out
    now, and fields a later version adds are passed over."""
    import json

    obstore.put(s3.store, f"{s3.prefix}/kept/main.py", b"print()")
    server = load_settings(bucket_config(tmp_path, s3.url())).server
    local = materialize_model_folder(server, "kept")
    record = json.loads((local / mirror.MARKER_FILE).read_text())
    fields_before_stop_51 = {"key", "size", "etag", "version", "mtime_ns"}
    written = [set(item) for part in ("fetched", "streamed") for item in record[part].values()]
    assert written and all(names <= fields_before_stop_51 for names in written), written
    assert read_marker(local).fetched["main.py"].etag  # (moto lists ETags: the object keeps its identity)
    for item in record["fetched"].values():
        item["checksum"] = "a field of a later version"
    (local / mirror.MARKER_FILE).write_text(json.dumps(record))
    assert read_marker(local).fetched["main.py"].key == f"{s3.prefix}/kept/main.py"


def test_a_large_file_is_fetched_one_range_per_request(s3, tmp_path, monkeypatch, python_folder, bucket_config) -> None:
    """Found by a bug hunt: each file came in one GET, which the store client ends at 30 s, so a 100 MB file at
    3 MB/s could never be fetched, however often it was tried. Ranges of FETCH_RANGE_BYTES each (small here)."""
    import obstore
    from nereid.storage import materialize_model_folder, mirror

    monkeypatch.setattr(mirror, "FETCH_RANGE_BYTES", 100_000)
    get = obstore.get
    ranges = []

    def counted(store, key, options=None):
        if key.endswith("data.bin"):
            ranges.append((options or {}).get("range"))
        return get(store, key, options=options)

    monkeypatch.setattr(obstore, "get", counted)
    source = tmp_path / "source"
    folder = python_folder(source, "big")
    data = bytes(range(256)) * 1368 + b"!"  # 350,209 bytes: three whole ranges and a part
    (folder / "data.bin").write_bytes(data)
    upload_folder(s3.store, source, s3.prefix)
    local = materialize_model_folder(load_settings(bucket_config(tmp_path, s3.url())).server, "big")
    assert (local / "data.bin").read_bytes() == data
    assert ranges == [(0, 100_000), (100_000, 200_000), (200_000, 300_000), (300_000, 350_209)]


def test_many_small_files_are_fetched_at_once_and_a_failed_one_is_named(s3, tmp_path, bucket_config) -> None:
    from nereid.storage import StorageError, materialize_model_folder
    from nereid.storage.mirror import FETCH_CONCURRENCY

    files = {f"pkg/mod{i}.py": f"VALUE = {i}\n".encode() for i in range(3 * FETCH_CONCURRENCY)}
    files["main.py"] = b"import pkg\n"
    for relative, data in files.items():
        obstore.put(s3.store, f"{s3.prefix}/vendored/{relative}", data)
    server = load_settings(bucket_config(tmp_path, s3.url())).server
    local = materialize_model_folder(server, "vendored")
    assert {p.relative_to(local).as_posix(): p.read_bytes() for p in local.rglob("*")
            if p.is_file() and p.name != MARKER_FILE} == files
    # Changed in the bucket and failing to download: the load fails naming the object.
    marker = (local / MARKER_FILE).read_bytes()
    obstore.put(s3.store, f"{s3.prefix}/vendored/pkg/mod7.py", b"VALUE = 'new'\n")
    obstore.put(s3.store, f"{s3.prefix}/vendored/main.py", b"import pkg  # v2\n")
    s3.fail("vendored/pkg/mod7.py", times=100)  # past the store client's own retries
    with pytest.raises(StorageError, match=r"vendored/pkg/mod7.py: cannot fetch: .*500"):
        materialize_model_folder(server, "vendored")
    # Defect (found by a bug hunt): the files fetched before the failure replaced their old copies, so the
    # version still serving (a main.py run per request) ran a mix of two versions that never existed together.
    # Nothing is touched until every changed file is in: the folder is as it was, whole, with nothing left over.
    assert {p.relative_to(local).as_posix(): p.read_bytes() for p in local.rglob("*")
            if p.is_file() and p.name != MARKER_FILE} == files
    assert (local / MARKER_FILE).read_bytes() == marker
    assert [p.name for p in local.iterdir() if p.name.startswith(".") and p.name != MARKER_FILE] == []
    with s3.lock:
        s3.faults.clear()
    local = materialize_model_folder(server, "vendored")  # the store answers again: the next load fetches it
    assert (local / "pkg" / "mod7.py").read_bytes() == b"VALUE = 'new'\n"
    assert (local / "main.py").read_bytes() == b"import pkg  # v2\n"
