"""Fetching a model folder's files from object storage into the cache, against a real S3 API (moto; see
tests/moto_s3.py): how the bytes travel from the store to the local file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import obstore
import pytest

from nereid.settings import load_settings
from nereid.storage import StorageError, materialize_model_folder
from nereid.storage import mirror
from nereid.storage.mirror import read_marker


def _config(tmp_path: Path, url: str) -> Path:
    config = tmp_path / "nereid.yaml"
    config.write_text(f'server:\n  bind_addr: "127.0.0.1:0"\n  metrics_addr: ""\n  http_addr: ""\n'
                      f'  ml_backends_path: "{url}"\n  cache_dir: "{tmp_path / "cache"}"\n')
    return config


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


def test_a_large_file_is_written_as_it_arrives_never_held_whole(s3, tmp_path, monkeypatch) -> None:
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
    server = load_settings(_config(tmp_path, s3.url())).server
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


def test_a_store_whose_certificate_is_refused_is_told_so_and_each_scheme_its_own_variables() -> None:
    """Found by the storage hunt: an https store with a certificate no CA vouches for (or expired) was "cannot reach
    the store ... (AWS_ENDPOINT_URL, and AWS_ALLOW_HTTP for http://)": the reason was only in obstore's debug dump;
    and gs:// and az:// stores were told of the AWS variables."""
    from nereid.storage import describe_error, store_unreachable
    from nereid.storage.client import StorageError

    class GenericError(Exception):
        pass

    refused = GenericError("Generic S3 error: Error performing list request: error sending request\n\nDebug source:\n"
                           "Generic { source: hyper_util::client::legacy::Error(Connect, Custom { kind: Other, error: "
                           "InvalidCertificate(UnknownIssuer) }) }")
    said = describe_error(refused, "s3")
    assert said == ("the store's TLS certificate is not trusted (UnknownIssuer); set SSL_CERT_FILE to the CA that "
                    "signed it (or AWS_ALLOW_INVALID_CERTIFICATES=true, for a test store only)"), said
    assert not store_unreachable(StorageError(said))
    wrong_name = GenericError("error sending request\n\nDebug source:\nInvalidCertificate(NotValidForName)")
    assert describe_error(wrong_name, "s3") == ("the store's TLS certificate is not for the name it was reached by "
                                                "(NotValidForName); check the endpoint's host name (AWS_ENDPOINT_URL)")
    unreachable = GenericError("Generic error: error sending request for url (http://127.0.0.1:1/b)")
    assert describe_error(unreachable, "gs").endswith("check the endpoint (GOOGLE_BASE_URL, and GOOGLE_ALLOW_HTTP "
                                                      "for http://)")
    assert describe_error(unreachable, "az").endswith("check the endpoint (AZURE_STORAGE_ENDPOINT, and "
                                                      "AZURE_ALLOW_HTTP for http://)")


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


def test_the_record_of_what_was_fetched_is_read_by_older_and_later_nereid_versions(s3, tmp_path) -> None:
    """Found by the upgrade hunt: every record named ``modified`` (null for every object with an ETag, the field
    added at stop 51), which an older server's reader refused: after a rollback, or beside an older replica sharing
    cache_dir, each folder was fetched whole again at every load, with a WARNING. Fields left empty are left out
    now, and fields a later version adds are passed over."""
    import json

    obstore.put(s3.store, f"{s3.prefix}/kept/main.py", b"print()")
    server = load_settings(_config(tmp_path, s3.url())).server
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
