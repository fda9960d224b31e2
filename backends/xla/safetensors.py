"""Reading (and writing) bundle weights in the safetensors format.

A file is an 8-byte little-endian header length, a JSON header, then the data.
The header is validated in full before a byte of data is read: a sane header
length, offsets inside the data region, byte sizes matching dtype and shape, no
overlapping tensors. Data is read with ``os.preadv`` straight into preallocated
numpy arrays (large tensors in parallel chunks), never through one Python
``bytes`` object holding the whole file.

Two layouts, declared by the file's own ``__metadata__``:

* ``axis_order: xla`` — each header shape is the program's (row-major) shape, so
  tensors are read straight into place;
* legacy (no ``axis_order``) — each header shape is the column-major shape the
  bundle's Julia exporter held, the data row-major in that shape; loading
  transposes it back (one extra copy per tensor).

Both load to identical arrays. The argument order of the weights is the
``argument_order`` metadata (a JSON list of names) when present, else the order
of the tensors' data in the file.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

from nereid.dtypes import DType
from nereid.errors import ConfigError, cap_message
from nereid.signature import MAX_RANK

# safetensors' own dtype names. Only the names live here: the numpy dtype of
# each comes from nereid's DType table.
SAFETENSORS_DTYPES: Mapping[str, DType] = {
    "BOOL": DType.BOOL, "U8": DType.UINT8, "U16": DType.UINT16, "U32": DType.UINT32, "U64": DType.UINT64,
    "I8": DType.INT8, "I16": DType.INT16, "I32": DType.INT32, "I64": DType.INT64,
    "F16": DType.FP16, "BF16": DType.BF16, "F32": DType.FP32, "F64": DType.FP64,
    "F8_E5M2": DType.F8E5M2, "F8_E4M3": DType.F8E4M3,
}
_NAME_OF = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}

AXIS_ORDER_KEY = "axis_order"
AXIS_ORDER_XLA = "xla"
ARGUMENT_ORDER_KEY = "argument_order"
METADATA_KEY = "__metadata__"

# The safetensors reference implementation refuses headers over 100 MB; nereid
# stops at 16 MiB (about 150,000 tensors), which bounds what parsing a hostile
# header can cost. A longer one is a corrupt length field, not a real header.
MAX_HEADER_BYTES = 16 * 1024 * 1024
_LENGTH = struct.Struct("<Q")
# Linux caps one read at just under 2 GiB; tensors are read in chunks this size,
# in parallel, which also keeps several reads in flight on fast storage.
DEFAULT_CHUNK_BYTES = 16 * 1024 * 1024
DEFAULT_READ_THREADS = 8


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors header: dtype, header shape and absolute byte range."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    start: int  # absolute file offset
    end: int

    @property
    def nbytes(self) -> int:
        """Bytes of data."""
        return self.end - self.start


@dataclass(frozen=True)
class SafetensorsHeader:
    """A validated header. ``tensors`` is in argument order; ``legacy`` is True without ``axis_order``."""

    path: Path
    data_start: int
    tensors: tuple[TensorEntry, ...]
    metadata: Mapping[str, str]

    @property
    def legacy(self) -> bool:
        """True for the legacy (column-major header shape) layout."""
        return AXIS_ORDER_KEY not in self.metadata

    def program_shape(self, entry: TensorEntry) -> tuple[int, ...]:
        """The shape the program sees for ``entry`` (the header shape, reversed for legacy files)."""
        return tuple(reversed(entry.shape)) if self.legacy else entry.shape


def read_header(path: Path | str) -> SafetensorsHeader:
    """Read and validate a safetensors header without reading any tensor data.

    Raises ConfigError naming the file, the key and the value for every problem.
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err.strerror or err}") from None
    try:
        return read_header_fd(fd, path)
    finally:
        os.close(fd)


def read_header_fd(fd: int, path: Path) -> SafetensorsHeader:
    """:func:`read_header` of an open file (``path`` names it in messages and in the result)."""
    try:
        size = os.fstat(fd).st_size
        prefix = os.pread(fd, _LENGTH.size, 0)
        if len(prefix) < _LENGTH.size:
            raise ConfigError(f"{path}: file is {size} bytes, shorter than the 8-byte header length")
        (length,) = _LENGTH.unpack(prefix)
        if length == 0 or length > MAX_HEADER_BYTES or length > size - _LENGTH.size:
            # The length field is not quoted: for a file that is not safetensors at all (a symlink
            # to /etc/passwd) it is the file's first 8 bytes.
            raise ConfigError(f"{path}: not a safetensors file: its 8-byte header length field does not give "
                              f"a length from 1 to {min(MAX_HEADER_BYTES, max(size - 8, 0))} bytes "
                              f"(the file is {size} bytes)")
        raw = os.pread(fd, length, _LENGTH.size)
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err.strerror or err}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: header: not UTF-8 text (invalid byte at offset {8 + err.start})") from None
    try:
        document = json.loads(text, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise ConfigError(f"{path}: header: JSON nested too deeply") from None
    except ValueError as err:
        raise ConfigError(cap_message(f"{path}: header: not valid JSON: {err}")) from None
    if not isinstance(document, dict):
        raise ConfigError(f"{path}: header: must be a JSON object, got {type(document).__name__}")
    data_start = _LENGTH.size + length
    return _parse_header(path, document, data_start, size - data_start)


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    result: dict[str, object] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _parse_header(path: Path, document: dict, data_start: int, data_len: int) -> SafetensorsHeader:
    metadata = document.get(METADATA_KEY, {})
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ConfigError(f"{path}: {METADATA_KEY}: must map names to strings, got {_shown(metadata)}")
    axis_order = metadata.get(AXIS_ORDER_KEY)
    if axis_order is not None and axis_order != AXIS_ORDER_XLA:
        raise ConfigError(f"{path}: {METADATA_KEY}.{AXIS_ORDER_KEY}: unknown weights layout (expected "
                          f"{AXIS_ORDER_XLA!r}, or no key for the legacy layout), got {axis_order!r}")
    entries: list[TensorEntry] = []
    for name, spec in document.items():
        if name == METADATA_KEY:
            continue
        entries.append(_parse_entry(path, name, spec, data_start, data_len))
    by_offset = sorted(entries, key=lambda e: (e.start, e.end))
    for before, after in zip(by_offset, by_offset[1:]):
        if after.start < before.end:
            raise ConfigError(f"{path}: {after.name}.data_offsets: overlaps tensor '{before.name}' "
                              f"(which ends at {before.end - data_start}), got "
                              f"{[after.start - data_start, after.end - data_start]}")
    ordered = _argument_order(path, metadata, by_offset)
    return SafetensorsHeader(path, data_start, tuple(ordered), dict(metadata))


def _parse_entry(path: Path, name: str, spec: object, data_start: int, data_len: int) -> TensorEntry:
    where = f"{path}: {name}"
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise ConfigError(f"{where}: must be an object with dtype, shape and data_offsets, got {_shown(spec)}")
    token = spec["dtype"]
    dtype = SAFETENSORS_DTYPES.get(token) if isinstance(token, str) else None
    if dtype is None:
        raise ConfigError(f"{where}.dtype: unknown safetensors dtype (expected one of "
                          f"{', '.join(SAFETENSORS_DTYPES)}), got {_shown(token)}")
    shape = spec["shape"]
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                               for d in shape):
        raise ConfigError(f"{where}.shape: must be a list of non-negative integers, got {_shown(shape)}")
    if len(shape) > MAX_RANK:
        raise ConfigError(f"{where}.shape: has {len(shape)} dims; at most {MAX_RANK} are supported")
    offsets = spec["data_offsets"]
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
        raise ConfigError(f"{where}.data_offsets: must be [begin, end], got {_shown(offsets)}")
    begin, end = offsets
    if not 0 <= begin <= end <= data_len:
        raise ConfigError(f"{where}.data_offsets: must lie inside the {data_len}-byte data region "
                          f"(0 <= begin <= end), got {offsets!r}")
    expected = math.prod(shape) * dtype.numpy.itemsize
    if end - begin != expected:
        raise ConfigError(f"{where}.data_offsets: holds {end - begin} bytes but {token} {shape} needs "
                          f"{expected}, got {offsets!r}")
    return TensorEntry(name, dtype, tuple(shape), data_start + begin, data_start + end)


def _shown(value: object) -> str:
    """``repr(value)`` cut short: header values are untrusted and may be megabytes long."""
    return cap_message(repr(value), 200)


def _argument_order(path: Path, metadata: Mapping[str, str], by_offset: list[TensorEntry]) -> list[TensorEntry]:
    raw = metadata.get(ARGUMENT_ORDER_KEY)
    if raw is None:
        return by_offset
    where = f"{path}: {METADATA_KEY}.{ARGUMENT_ORDER_KEY}"
    try:
        names = json.loads(raw)
    except ValueError:
        names = None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"{where}: must be a JSON list of tensor names, got {_shown(raw)}")
    by_name = {e.name: e for e in by_offset}
    listed = set(names)  # sets and a Counter: a 100,000-name list once took 66 s here
    duplicates = sorted(n for n, count in Counter(names).items() if count > 1)
    unknown = [n for n in names if n not in by_name]
    missing = [n for n in by_name if n not in listed]
    if duplicates or unknown or missing:
        problems = []
        if duplicates:
            problems.append(f"names {duplicates} twice")
        if unknown:
            problems.append(f"names {unknown}, which the file does not hold")
        if missing:
            problems.append(f"omits {missing}")
        raise ConfigError(cap_message(f"{where}: must name every tensor exactly once, but it "
                                      f"{'; '.join(problems)}; got {_shown(raw)}"))
    return [by_name[n] for n in names]


def load_weights(path: Path | str, *, threads: int = DEFAULT_READ_THREADS,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[tuple[str, np.ndarray]]:
    """Read every tensor in argument order, each in the program's (row-major) shape.

    Both layouts load to identical arrays.
    """
    header = read_header(path)
    return read_tensors(header, threads=threads, chunk_bytes=chunk_bytes)


def read_tensors(header: SafetensorsHeader, *, threads: int = DEFAULT_READ_THREADS,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[tuple[str, np.ndarray]]:
    """Read the tensors of a validated header with ``pread`` into fresh arrays, in argument order."""
    arrays = [np.empty(entry.shape, dtype=_little_endian(entry.dtype.numpy)) for entry in header.tensors]
    read_into(header, arrays, threads=threads, chunk_bytes=chunk_bytes)
    result: list[tuple[str, np.ndarray]] = []
    for entry, array in zip(header.tensors, arrays):
        if not array.dtype.isnative:  # only on big-endian hosts: the file is little-endian
            array = array.astype(array.dtype.newbyteorder("="))
        if header.legacy:
            # Legacy files hold the column-major (Julia) array row-major in its own
            # shape: the program's array is its transpose, copied into place.
            array = np.asarray(array.transpose(), order="C")  # (ascontiguousarray would make 0-d 1-d)
        result.append((entry.name, array))
    return result


def read_into(header: SafetensorsHeader, arrays: Sequence[np.ndarray], *, threads: int = DEFAULT_READ_THREADS,
              chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
    """Fill C-contiguous arrays (one per tensor, in header order, each exactly its size) with ``pread``.

    Large tensors are read in ``chunk_bytes`` pieces by up to ``threads``
    threads, so several reads are in flight at once.
    """
    if chunk_bytes < 1:
        raise ValueError("chunk_bytes must be positive")
    jobs: list[tuple[memoryview, int]] = []
    for entry, array in zip(header.tensors, arrays, strict=True):
        if array.nbytes != entry.nbytes or not array.flags.c_contiguous:
            raise ValueError(f"array for '{entry.name}' must be C-contiguous with {entry.nbytes} bytes")
        view = memoryview(array.reshape(-1).view(np.uint8))
        for offset in range(0, entry.nbytes, chunk_bytes):
            jobs.append((view[offset:offset + chunk_bytes], entry.start + offset))
    try:
        fd = os.open(header.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise ConfigError(f"{header.path}: cannot open: {err.strerror or err}") from None
    try:
        if threads > 1 and len(jobs) > 1:
            with ThreadPoolExecutor(max_workers=min(threads, len(jobs)), thread_name_prefix="nereid-weights") as pool:
                # list() re-raises the first failure.
                list(pool.map(lambda job: _pread_exactly(fd, job[0], job[1], header.path), jobs))
        else:
            for view, offset in jobs:
                _pread_exactly(fd, view, offset, header.path)
    finally:
        os.close(fd)


def _little_endian(dtype: np.dtype) -> np.dtype:
    return dtype.newbyteorder("<") if dtype.itemsize > 1 and dtype.byteorder != "|" else dtype


def _pread_exactly(fd: int, view: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(view):
        try:
            count = os.preadv(fd, [view[done:]], offset + done)
        except OSError as err:
            raise ConfigError(f"{path}: read failed at byte {offset + done}: {err.strerror or err}") from None
        if count == 0:
            raise ConfigError(f"{path}: file ended at byte {offset + done} while reading tensor data "
                              "(was it truncated while loading?)")
        done += count


def write_safetensors(path: Path | str, tensors: Iterable[tuple[str, np.ndarray]], *, legacy: bool = False,
                      metadata: Mapping[str, str] | None = None) -> None:
    """Write program-shaped arrays as a safetensors file, in the given (argument) order.

    ``legacy=False`` writes ``axis_order: xla`` (header shape = program shape);
    ``legacy=True`` writes the older layout (header shape reversed, data
    transposed to match) without an ``axis_order`` key. ``argument_order``
    always records the order given.
    """
    items: list[tuple[str, np.ndarray]] = [(name, np.asarray(array)) for name, array in tensors]
    names = [name for name, _ in items]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate weight names in {names}")
    meta: dict[str, str] = dict(metadata or {})
    meta[ARGUMENT_ORDER_KEY] = json.dumps(names)
    if legacy:
        meta.pop(AXIS_ORDER_KEY, None)
    else:
        meta[AXIS_ORDER_KEY] = AXIS_ORDER_XLA
    stored = [(name, np.asarray(array.transpose() if legacy else array, dtype=_little_endian(array.dtype),
                                order="C")) for name, array in items]
    header = encode_header([(name, DType.of(array), array.shape, array.nbytes) for name, array in stored], meta)
    with open(path, "wb") as f:
        f.write(header)
        for _, array in stored:
            f.write(memoryview(array.reshape(-1).view(np.uint8)))


def encode_header(tensors: Sequence[tuple[str, DType, Sequence[int], int]], metadata: Mapping[str, str]) -> bytes:
    """The length prefix and JSON header of a file holding (name, dtype, shape, nbytes) in this data order."""
    header: dict[str, object] = {METADATA_KEY: dict(metadata)} if metadata else {}
    offset = 0
    for name, dtype, shape, nbytes in tensors:
        if dtype not in _NAME_OF:
            raise ValueError(f"weight '{name}': {dtype.name} cannot be stored in safetensors")
        header[name] = {"dtype": _NAME_OF[dtype], "shape": [int(d) for d in shape],
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)  # the format pads the header to 8 bytes with spaces
    return _LENGTH.pack(len(encoded)) + encoded


def read_entry(fd: int, entry: TensorEntry, path: Path) -> np.ndarray:
    """One tensor, in its header shape, read with ``pread`` from an open file."""
    array = np.empty(entry.shape, dtype=_little_endian(entry.dtype.numpy))
    _pread_exactly(fd, memoryview(array.reshape(-1).view(np.uint8)), entry.start, path)
    return array
