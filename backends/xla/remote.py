"""Bundles served from an object store: the weights are streamed, never written to local disk.

The repository materialized the bundle's small files (manifest, programs,
model.py, the shard index) into the local cache; its ``*.safetensors`` objects
stayed in the store, as this backend's ``nereid_streamed_files`` (plugin.py) told
:mod:`nereid.storage.mirror`. A weights file named
otherwise (a manifest's ``weights_file: weights.bin``, a shard an index names
``part-1.st``) was fetched whole with the other files and is read as a local
bundle's. Here each streamed weights
file's header is fetched first (one ranged GET of its first 64 KiB, a second
one when the header is longer) and validated in full by the same parser as a
local file. Then the tensors are read with parallel ranged GETs of
``weights_chunk_bytes`` each, at most ``weights_concurrency`` in flight,
straight into preallocated arrays (in either layout; legacy tensors are then
transposed as locally). Every read is conditional on the object's ETag from
the listing, so a file replaced mid-load fails the load instead of mixing
versions; a failed or short range is retried ``weights_read_retries`` times,
then the load fails naming the URL, the byte range and the cause.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from nereid.backends.xla.safetensors import (SafetensorsHeader, empty_for, header_length, parse_header_bytes,
                                             to_program_array)
from nereid.backends.xla.weights import LocalBundleFiles, OpenWeightFiles, WeightSet, read_local_into
from nereid.errors import ConfigError
from nereid.storage import MARKER_FILE, RangeRead, RemoteFolder, StoreURL, open_store, read_marker, read_ranges

# The first ranged GET of a weights file: the length field and, usually, the whole header.
HEAD_BYTES = 64 * 1024


class RemoteBundle:
    """A materialized bundle folder whose weights live in the store (a :class:`BundleFiles`)."""

    def __init__(self, folder: Path, remote: RemoteFolder, *, retries: int) -> None:
        self.folder = Path(folder)
        self.remote = remote
        self.location: StoreURL = remote.location
        self.retries = retries
        self._local = LocalBundleFiles(folder)
        self._store: Any = None

    @classmethod
    def of(cls, folder: Path, *, retries: int) -> RemoteBundle | None:
        """The remote bundle materialized at ``folder``; None for a local bundle."""
        remote = read_marker(folder)
        return cls(folder, remote, retries=retries) if remote is not None else None

    @property
    def store(self) -> Any:
        """The store, built once per load from the environment.

        Without obstore's own retries: the ranged reads retry themselves, so
        ``weights_read_retries`` is the real count and the error says how many.
        """
        if self._store is None:
            self._store = open_store(self.location, max_retries=0)
        return self._store

    # -- BundleFiles ----------------------------------------------------------------------------------

    def names(self) -> list[str]:
        local = [n for n in self._local.names() if n != MARKER_FILE]
        return sorted({*local, *(n for n in self.remote.streamed if "/" not in n)})

    def where(self, name: str) -> str:
        return str(self.location.child(name)) if name in self.remote.streamed else self._local.where(name)

    def read_small(self, name: str, limit: int) -> bytes:
        return self._local.read_small(name, limit)

    @property
    def opened(self) -> OpenWeightFiles:
        return self._local.opened  # (the files fetched whole; a streamed one's reads are bound to its ETag)

    def header(self, name: str) -> SafetensorsHeader:
        item = self.remote.streamed.get(name)
        if item is None:
            if name in self.remote.fetched:  # not a *.safetensors name: fetched whole, read as locally
                return self._local.header(name)
            raise ConfigError(f"{self.location}: no weights file {name!r} in the model folder (files: "
                              f"{', '.join(sorted({*self.remote.streamed, *self.remote.fetched})) or 'none'})")
        url = self.where(name)
        head = bytearray(min(item.size, HEAD_BYTES))
        if head:  # an empty object has no range to read: header_length says what is wrong with it
            self._read([RangeRead(item.key, 0, (memoryview(head),), "the safetensors header")], item.key)
        length = header_length(url, item.size, bytes(head[:8]))
        if 8 + length <= len(head):
            raw = bytes(head[8:8 + length])
        else:
            rest = bytearray(length)
            self._read([RangeRead(item.key, 8, (memoryview(rest),), "the safetensors header")], item.key)
            raw = bytes(rest)
        return parse_header_bytes(url, raw, item.size)

    # -- weights --------------------------------------------------------------------------------------

    def read_weights(self, weight_set: WeightSet, *, chunk_bytes: int,
                     concurrency: int) -> list[tuple[str, np.ndarray]]:
        """Every weight in argument order, streamed with parallel ranged GETs into fresh arrays (those of a file
        fetched whole read from the local copy, through the descriptor its header was read through); then the
        set's local files are closed."""
        try:
            arrays = [empty_for(w.entry) for w in weight_set.weights]
            streamed = [(w, a) for w, a in zip(weight_set.weights, arrays) if w.file in self.remote.streamed]
            if streamed:
                etags = {item.key: item.etag for item in self.remote.streamed.values()}
                reads = plan_reads([(self.remote.streamed[w.file].key, w.entry.start, w.entry.name, a)
                                    for w, a in streamed], chunk_bytes)
                read_ranges(self.store, self.location, reads, concurrency=concurrency, retries=self.retries,
                            etags=etags)
            if len(streamed) < len(arrays):
                read_local_into(self.folder, [(w, a) for w, a in zip(weight_set.weights, arrays)
                                              if w.file not in self.remote.streamed], opened=weight_set.opened)
        finally:
            weight_set.close()
        return [(w.entry.name, to_program_array(a, w.header.legacy)) for w, a in zip(weight_set.weights, arrays)]

    def _read(self, reads: list[RangeRead], key: str) -> None:
        etag = next((i.etag for i in self.remote.streamed.values() if i.key == key), None)
        read_ranges(self.store, self.location, reads, concurrency=1, retries=self.retries, etags={key: etag})


def plan_reads(tensors: list[tuple[str, int, str, np.ndarray]], chunk_bytes: int) -> list[RangeRead]:
    """Ranged GETs of at most ``chunk_bytes`` covering (key, file offset, name, destination) tensors.

    A large tensor is split into ``chunk_bytes`` pieces; small tensors that lie
    next to each other in one file share a GET up to ``chunk_bytes``, so a file
    of many small tensors costs a few requests, not one per tensor.
    """
    pieces: list[tuple[str, int, memoryview, str]] = []
    for key, start, name, array in tensors:
        view = memoryview(array.reshape(-1).view(np.uint8))
        for offset in range(0, len(view), chunk_bytes):
            pieces.append((key, start + offset, view[offset:offset + chunk_bytes], name))
    pieces.sort(key=lambda piece: (piece[0], piece[1]))
    reads: list[RangeRead] = []
    run: list[tuple[str, int, memoryview, str]] = []

    def close() -> None:
        if run:
            names = list(dict.fromkeys(name for *_, name in run))
            what = f"tensor '{names[0]}'" if len(names) == 1 else (
                f"{len(names)} tensors, '{names[0]}' to '{names[-1]}'")
            reads.append(RangeRead(run[0][0], run[0][1], tuple(view for _, _, view, _ in run), what))
            run.clear()

    for piece in pieces:
        if run:
            key, start, _, _ = run[0]
            end = run[-1][1] + len(run[-1][2])
            if piece[0] != key or piece[1] != end or end - start + len(piece[2]) > chunk_bytes:
                close()
        run.append(piece)
    close()
    return reads
