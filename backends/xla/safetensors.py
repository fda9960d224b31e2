"""Reading (and writing) bundle weights in the safetensors format.

A file is an 8-byte little-endian header length, a JSON header, then the data.
The header is validated in full before a byte of data is read, accepting
exactly the files the safetensors library (the reference) accepts, within
nereid's limits: a sane header length, the tensors tiling the data region from
byte 0 to the end of the file, byte sizes matching dtype and shape, shapes
numpy can allocate (an empty tensor's other dimensions included), and
``__metadata__.format`` ``pt`` or ``nereid`` when present. Data is read with ``os.preadv`` straight into preallocated
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
from typing import Callable, Iterable, Mapping, Sequence

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
# Valid in the format (the library reads them) but with no numpy type nereid can hold.
REFERENCE_ONLY_DTYPES = frozenset({"F4", "F6_E2M3", "F6_E3M2", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "C64"})

AXIS_ORDER_KEY = "axis_order"
AXIS_ORDER_XLA = "xla"
ARGUMENT_ORDER_KEY = "argument_order"
METADATA_KEY = "__metadata__"

# The safetensors library refuses headers over 100,000,000 bytes; nereid stops
# at 16 MiB (about 150,000 tensors), which bounds what parsing a hostile header
# can cost. A longer one is a corrupt length field, not a real header.
MAX_HEADER_BYTES = 16 * 1024 * 1024
REFERENCE_MAX_HEADER_BYTES = 100_000_000
# ``__metadata__.format``, when present: PyTorch's "pt" (the only value the
# streaming loaders accept) or nereid's own, which nereid's writer records.
FORMAT_KEY = "format"
NEREID_FORMAT = "nereid"
ACCEPTED_FORMATS = ("pt", NEREID_FORMAT)
_LENGTH = struct.Struct("<Q")
# Linux caps one read at just under 2 GiB; tensors are read in chunks this size,
# in parallel, which also keeps several reads in flight on fast storage.
DEFAULT_CHUNK_BYTES = 16 * 1024 * 1024
DEFAULT_READ_THREADS = 8
# jaxlib's CPU client takes a host array as the device buffer itself (no copy) only when its data is 64-byte
# aligned; numpy's allocations are 16-byte aligned, so each weight was copied, and the copied-from array was
# freed only at jax's next garbage collection: a loaded (idle) server held every weight twice.
WEIGHT_ALIGNMENT = 64


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

    path: Path | str  # a local path, or the URL of an object in a store
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
    fd = open_weights_file(path)
    try:
        return read_header_fd(fd, path)
    finally:
        os.close(fd)


def open_weights_file(path: Path) -> int:
    """A read-only descriptor of a weights file (ConfigError ``cannot read`` naming it when it cannot be opened).

    A load reads a file's header and then its data through one descriptor: a file replaced meanwhile (an atomic
    redeploy, a migration's ``replace``) is read whole as it was, never its header's offsets applied to its
    successor's bytes.
    """
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err.strerror or err}") from None


def read_header_fd(fd: int, path: Path) -> SafetensorsHeader:
    """:func:`read_header` of an open file (``path`` names it in messages and in the result)."""
    try:
        size = os.fstat(fd).st_size
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err.strerror or err}") from None

    def pread(offset: int, length: int) -> bytes:
        try:
            return os.pread(fd, length, offset)
        except OSError as err:
            raise ConfigError(f"{path}: cannot read: {err.strerror or err}") from None

    return parse_header(path, size, pread)


def header_length(where: object, size: int, prefix: bytes) -> int:
    """The JSON header's length from a file's first 8 bytes; ConfigError unless it is sane for ``size``."""
    if len(prefix) < _LENGTH.size:
        raise ConfigError(f"{where}: file is {size} bytes, shorter than the 8-byte header length")
    (length,) = _LENGTH.unpack_from(prefix)
    if MAX_HEADER_BYTES < length <= min(size - _LENGTH.size, REFERENCE_MAX_HEADER_BYTES):
        # A length the file holds and the format allows: a real header, only too long for nereid (quoting it is
        # safe: the first 8 bytes of a file that is not safetensors give no such length).
        raise ConfigError(f"{where}: its header is {length:,} bytes, over nereid's limit of 16 MiB "
                          f"({MAX_HEADER_BYTES:,} bytes; the safetensors library allows up to "
                          f"{REFERENCE_MAX_HEADER_BYTES:,})")
    if length == 0 or length > MAX_HEADER_BYTES or length > size - _LENGTH.size:
        # The length field is not quoted: for a file that is not safetensors at all (a symlink
        # to /etc/passwd) it is the file's first 8 bytes.
        raise ConfigError(f"{where}: not a safetensors file: its 8-byte header length field does not give "
                          f"a length from 1 to {min(MAX_HEADER_BYTES, max(size - 8, 0))} bytes "
                          f"(the file is {size} bytes; nereid reads headers of up to {MAX_HEADER_BYTES} bytes, "
                          f"the safetensors library up to {REFERENCE_MAX_HEADER_BYTES:,})")
    return length


def parse_header(where: Path | str, size: int, pread: Callable[[int, int], bytes]) -> SafetensorsHeader:
    """Read (through ``pread(offset, length)``) and validate the header of a ``size``-byte file.

    ``where`` is the file's path, or its URL for an object in a store; it names
    the file in every message and is kept as the header's ``path``.
    """
    length = header_length(where, size, pread(0, _LENGTH.size))
    raw = pread(_LENGTH.size, length)
    if len(raw) != length:
        raise ConfigError(f"{where}: file ended inside its {length}-byte header (the file is {size} bytes)")
    return parse_header_bytes(where, raw, size)


def parse_header_bytes(where: Path | str, raw: bytes, size: int) -> SafetensorsHeader:
    """Validate the JSON header ``raw`` of a ``size``-byte file, exactly as the safetensors library does.

    The library parses the header with serde_json into a typed struct, so its
    rules are serde's, and these are emulated here: a duplicate ``__metadata__``
    or a duplicate field inside a tensor entry is refused, a duplicate tensor
    name or metadata key is won by its last occurrence (serde types every
    occurrence first, so an earlier one that is no tensor entry, or no string,
    is refused all the same), unknown fields of an
    entry are ignored, an entry may be a 3-element array, NaN, infinities,
    ``-0``, lone surrogates and nesting deeper than 127 are refused. Then the
    tensors, sorted by offset, must cover the data region exactly: contiguous
    from byte 0, each the size its dtype and shape need, and nothing after the
    last. nereid's own limits on top: a header of at most
    ``MAX_HEADER_BYTES``, at most ``MAX_RANK`` dimensions, the dtypes nereid
    can hold, and ``__metadata__.format`` ``pt`` or ``nereid`` when present.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{where}: header: not UTF-8 text (invalid byte at offset {8 + err.start})") from None
    try:
        document = json.loads(text, object_pairs_hook=_JsonObject.of, parse_constant=_refuse_constant,
                              parse_float=_finite_float, parse_int=_json_int)
    except RecursionError:
        raise ConfigError(f"{where}: header: JSON nested too deeply") from None
    except ValueError as err:
        raise ConfigError(cap_message(f"{where}: header: not valid JSON: {err}")) from None
    problem = _serde_problem(document)
    if problem:
        raise ConfigError(f"{where}: header: not valid JSON for safetensors: {problem}")
    if not isinstance(document, dict):
        raise ConfigError(f"{where}: header: must be a JSON object, got {type(document).__name__}")
    if METADATA_KEY in document.duplicates:
        raise ConfigError(f"{where}: header: {METADATA_KEY} appears twice")
    data_start = _LENGTH.size + len(raw)
    return _parse_header(where, document, data_start, size - data_start)


class _JsonObject(dict):
    """A JSON object with the keys that appeared more than once (the last occurrence is kept).

    ``earlier`` holds the values of a repeated key's occurrences before the
    last, in document order: serde deserialises each of them into its typed
    form before the map keeps the last, so each must pass the same type checks.
    """

    duplicates: frozenset = frozenset()
    earlier: Mapping[str, list[object]] = {}

    @classmethod
    def of(cls, pairs: list[tuple[str, object]]) -> "_JsonObject":
        result = cls(pairs)
        if len(result) != len(pairs):
            earlier: dict[str, list[object]] = {}
            last = {key: index for index, (key, _) in enumerate(pairs)}
            for index, (key, value) in enumerate(pairs):
                if last[key] != index:
                    earlier.setdefault(key, []).append(value)
            result.duplicates = frozenset(earlier)
            result.earlier = earlier
        return result


class _NegativeZero:
    """JSON ``-0``: serde_json reads it as a float, so it is no unsigned integer."""

    def __repr__(self) -> str:
        return "-0"


def _refuse_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number out of range: {text[:40]}")
    return value


def _json_int(text: str) -> object:
    return _NegativeZero() if text.startswith("-") and not text.strip("-0") else int(text)


# serde_json's recursion limit: 128 levels, the outermost object included, are refused.
_MAX_JSON_DEPTH = 127


def _serde_problem(document: object) -> str:
    """What serde_json refuses that Python's json accepted: lone surrogates, nesting too deep."""
    stack: list[tuple[object, int]] = [(document, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            if depth > _MAX_JSON_DEPTH:
                return f"nested deeper than {_MAX_JSON_DEPTH} levels"
            for key, item in value.items():
                stack.append((key, depth))
                stack.append((item, depth + 1))
            # serde parsed the occurrences a repeated key's last one replaced, too.
            for items in getattr(value, "earlier", {}).values():
                stack.extend((item, depth + 1) for item in items)
        elif isinstance(value, list):
            if depth > _MAX_JSON_DEPTH:
                return f"nested deeper than {_MAX_JSON_DEPTH} levels"
            stack.extend((item, depth + 1) for item in value)
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return f"a string holds a lone UTF-16 surrogate escape: {_shown(value)}"
    return ""


def _parse_header(path: Path | str, document: dict, data_start: int, data_len: int) -> SafetensorsHeader:
    metadata = document.get(METADATA_KEY, {})
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ConfigError(f"{path}: {METADATA_KEY}: must map names to strings, got {_shown(metadata)}")
    for key, values in getattr(metadata, "earlier", {}).items():
        for value in values:
            if not isinstance(value, str):
                raise ConfigError(f"{path}: {METADATA_KEY}.{key}: must be a string in every occurrence of the "
                                  f"repeated key (the last one counts, but the safetensors library reads each), "
                                  f"got {_shown(value)}")
    file_format = metadata.get(FORMAT_KEY)
    if file_format is not None and file_format not in ACCEPTED_FORMATS:
        raise ConfigError(f"{path}: {METADATA_KEY}.{FORMAT_KEY}: must be {' or '.join(map(repr, ACCEPTED_FORMATS))} "
                          f"when present, got {_shown(file_format)}")
    axis_order = metadata.get(AXIS_ORDER_KEY)
    if axis_order is not None and axis_order != AXIS_ORDER_XLA:
        raise ConfigError(f"{path}: {METADATA_KEY}.{AXIS_ORDER_KEY}: unknown weights layout (expected "
                          f"{AXIS_ORDER_XLA!r}, or no key for the legacy layout), got {axis_order!r}")
    for name, specs in getattr(document, "earlier", {}).items():
        for spec in specs:
            _typed_fields(f"{path}: {name} (an earlier occurrence of the repeated tensor name: the last one "
                          "counts, but the safetensors library reads each)", spec)
    entries: list[TensorEntry] = []
    for name, spec in document.items():
        if name == METADATA_KEY:
            continue
        entries.append(_parse_entry(path, name, spec, data_start, data_len))
    # The library's rule: sorted by offsets, the tensors tile the data region from byte 0 to its end.
    by_offset = sorted(entries, key=lambda e: (e.start, e.end, e.name))
    covered, previous = data_start, None
    for entry in by_offset:
        if entry.start != covered:
            offsets = [entry.start - data_start, entry.end - data_start]
            if previous is not None and entry.start < covered:
                raise ConfigError(f"{path}: {entry.name}.data_offsets: overlaps tensor '{previous.name}' "
                                  f"(which ends at {covered - data_start}), got {offsets}")
            after = f"tensor '{previous.name}' ends" if previous is not None else "the data region starts"
            raise ConfigError(f"{path}: {entry.name}.data_offsets: must begin at {covered - data_start}, where "
                              f"{after} (safetensors data is contiguous from byte 0), got {offsets}")
        covered, previous = entry.end, entry
    if covered != data_start + data_len:
        raise ConfigError(f"{path}: the tensors end at byte {covered - data_start} of the {data_len}-byte data "
                          f"region: {data_start + data_len - covered} byte(s) after the last tensor belong to none "
                          "(a safetensors file ends with its last tensor)")
    ordered = _argument_order(path, metadata, by_offset)
    return SafetensorsHeader(path, data_start, tuple(ordered), dict(metadata))


_ENTRY_FIELDS = ("dtype", "shape", "data_offsets")
_USIZE_LIMIT = 1 << 64
# numpy sizes every array, empty ones included, in bytes as an intp: a tensor past it cannot be allocated.
MAX_ARRAY_BYTES = int(np.iinfo(np.intp).max)


def _is_usize(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _USIZE_LIMIT


def _typed_fields(where: str, spec: object) -> tuple[str, list, list]:
    """An entry as serde types it into the library's TensorInfo: its dtype token, shape and data offsets.

    Only the types: a dtype the library knows (nereid holds fewer), lists of
    unsigned 64-bit integers, two offsets. What an occurrence of a repeated
    tensor name before its last one must pass, and the last one before the
    rest of :func:`_parse_entry`.
    """
    if isinstance(spec, list) and len(spec) == len(_ENTRY_FIELDS):  # serde reads a struct from a sequence too
        spec = dict(zip(_ENTRY_FIELDS, spec))
    elif isinstance(spec, dict):
        repeated = sorted(set(_ENTRY_FIELDS) & getattr(spec, "duplicates", frozenset()))
        if repeated:
            raise ConfigError(f"{where}: field {repeated[0]!r} appears twice")
    if not isinstance(spec, dict) or not all(f in spec for f in _ENTRY_FIELDS):
        raise ConfigError(f"{where}: must be an object with dtype, shape and data_offsets, got {_shown(spec)}")
    token = spec["dtype"]
    if isinstance(token, dict) and len(token) == 1 and next(iter(token.values())) is None:
        token = next(iter(token))  # serde's other spelling of a unit variant: {"F32": null}
    if not isinstance(token, str) or (token not in SAFETENSORS_DTYPES and token not in REFERENCE_ONLY_DTYPES):
        raise ConfigError(f"{where}.dtype: unknown safetensors dtype (expected one of "
                          f"{', '.join(SAFETENSORS_DTYPES)}), got {_shown(token)}")
    shape = spec["shape"]
    if not isinstance(shape, list) or not all(_is_usize(d) for d in shape):
        raise ConfigError(f"{where}.shape: must be a list of non-negative integers, got {_shown(shape)}")
    offsets = spec["data_offsets"]
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_usize(o) for o in offsets):
        raise ConfigError(f"{where}.data_offsets: must be [begin, end], got {_shown(offsets)}")
    return token, shape, offsets


def _parse_entry(path: Path | str, name: str, spec: object, data_start: int, data_len: int) -> TensorEntry:
    where = f"{path}: {name}"
    token, shape, offsets = _typed_fields(where, spec)
    dtype = SAFETENSORS_DTYPES.get(token)
    if dtype is None:
        raise ConfigError(f"{where}.dtype: a safetensors dtype nereid cannot load "
                          f"(expected one of {', '.join(SAFETENSORS_DTYPES)}), got {_shown(token)}")
    if len(shape) > MAX_RANK:
        raise ConfigError(f"{where}.shape: has {len(shape)} dims; at most {MAX_RANK} are supported")
    begin, end = offsets
    if not 0 <= begin <= end <= data_len:
        raise ConfigError(f"{where}.data_offsets: must lie inside the {data_len}-byte data region "
                          f"(0 <= begin <= end), got {offsets!r}")
    # The library multiplies in 64-bit unsigned arithmetic and refuses an overflow, even when a 0 follows.
    elements = 1
    for dim in shape:
        elements *= dim
        if elements >= _USIZE_LIMIT:
            raise ConfigError(f"{where}.shape: the element count of {_shown(shape)} overflows 64 bits")
    if elements * dtype.numpy.itemsize * 8 >= _USIZE_LIMIT:
        raise ConfigError(f"{where}.shape: the bit count of {token} {_shown(shape)} overflows 64 bits")
    # Past the library's checks, a tensor with a 0 may still have other dimensions numpy cannot allocate, even empty.
    spanned = math.prod(d for d in shape if d) * dtype.numpy.itemsize
    if spanned > MAX_ARRAY_BYTES:
        raise ConfigError(f"{where}.shape: {token} {_shown(shape)} is past what nereid can hold: its non-zero "
                          f"dimensions span {spanned} bytes, and numpy sizes an array (even an empty one) in a "
                          f"signed {np.dtype(np.intp).itemsize * 8}-bit integer, at most {MAX_ARRAY_BYTES}")
    expected = elements * dtype.numpy.itemsize
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
    except (ValueError, RecursionError):  # (a list nested past the parser's depth: no list of names either)
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
    path = Path(path)
    fd = open_weights_file(path)
    try:
        header = read_header_fd(fd, path)
        arrays = [empty_for(entry) for entry in header.tensors]
        read_entries_into([(path, header.tensors, arrays)], threads=threads, chunk_bytes=chunk_bytes,
                          opened={path: fd})
    finally:
        os.close(fd)
    return [(entry.name, to_program_array(array, header.legacy)) for entry, array in zip(header.tensors, arrays)]


def read_tensors(header: SafetensorsHeader, *, threads: int = DEFAULT_READ_THREADS,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[tuple[str, np.ndarray]]:
    """Read the tensors of a validated header with ``pread`` into fresh arrays, in argument order.

    The file is opened again by its path: one replaced since its header was read would be read at the old
    header's offsets (a load reads both through one descriptor, as :func:`load_weights` does).
    """
    arrays = [empty_for(entry) for entry in header.tensors]
    read_into(header, arrays, threads=threads, chunk_bytes=chunk_bytes)
    return [(entry.name, to_program_array(array, header.legacy)) for entry, array in zip(header.tensors, arrays)]


def empty_for(entry: TensorEntry) -> np.ndarray:
    """A fresh array to read ``entry``'s data into: its header shape, its dtype, little-endian, its data
    :data:`WEIGHT_ALIGNMENT`-byte aligned (see :func:`aligned_empty`)."""
    return aligned_empty(entry.shape, _little_endian(entry.dtype.numpy))


def aligned_empty(shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a :data:`WEIGHT_ALIGNMENT`-byte boundary.

    Such an array becomes a CPU device buffer without a copy (the device buffer
    is this memory, kept alive by the jax array), where ``np.empty``'s would be
    copied and held twice until jax's next garbage collection.
    """
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + WEIGHT_ALIGNMENT, np.uint8)
    offset = -raw.ctypes.data % WEIGHT_ALIGNMENT
    return raw[offset:offset + nbytes].view(dtype).reshape(tuple(shape))


def to_program_array(array: np.ndarray, legacy: bool) -> np.ndarray:
    """A tensor read in its header shape, as the program takes it (native byte order, transposed if legacy);
    a copy made here is aligned as :func:`aligned_empty`'s."""
    if not array.dtype.isnative:  # only on big-endian hosts: the file is little-endian
        array = _aligned_copy(array, array.dtype.newbyteorder("="))
    if legacy:
        # Legacy files hold the column-major (Julia) array row-major in its own
        # shape: the program's array is its transpose, copied into place.
        array = _aligned_copy(array.transpose(), array.dtype)
    return array


def _aligned_copy(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    copy = aligned_empty(array.shape, dtype)
    np.copyto(copy, array)  # (a byte-order change at most: the values are kept)
    return copy


def read_into(header: SafetensorsHeader, arrays: Sequence[np.ndarray], *, threads: int = DEFAULT_READ_THREADS,
              chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
    """Fill C-contiguous arrays (one per tensor, in header order, each exactly its size) with ``pread``.

    Large tensors are read in ``chunk_bytes`` pieces by up to ``threads``
    threads, so several reads are in flight at once.
    """
    read_entries_into([(Path(header.path), list(header.tensors), list(arrays))], threads=threads,
                      chunk_bytes=chunk_bytes)


def chunk_jobs(entries: Sequence[TensorEntry], arrays: Sequence[np.ndarray],
               chunk_bytes: int) -> list[tuple[memoryview, int]]:
    """(destination view, absolute file offset) pieces of at most ``chunk_bytes`` covering every tensor."""
    if chunk_bytes < 1:
        raise ValueError("chunk_bytes must be positive")
    jobs: list[tuple[memoryview, int]] = []
    for entry, array in zip(entries, arrays, strict=True):
        if array.nbytes != entry.nbytes or not array.flags.c_contiguous:
            raise ValueError(f"array for '{entry.name}' must be C-contiguous with {entry.nbytes} bytes")
        view = memoryview(array.reshape(-1).view(np.uint8))
        for offset in range(0, entry.nbytes, chunk_bytes):
            jobs.append((view[offset:offset + chunk_bytes], entry.start + offset))
    return jobs


def read_entries_into(files: Sequence[tuple[Path, Sequence[TensorEntry], Sequence[np.ndarray]]], *,
                      threads: int = DEFAULT_READ_THREADS, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                      opened: Mapping[Path, int] | None = None) -> None:
    """:func:`read_into` for tensors of several files (shards) at once, sharing one pool of readers.

    A file in ``opened`` (path -> descriptor: the one its header was read through) is read through that
    descriptor, which stays open (its owner closes it); any other is opened by its path for the read.
    """
    jobs: list[tuple[int, Path, memoryview, int]] = []
    fds: list[int] = []
    try:
        for path, entries, arrays in files:
            pieces = chunk_jobs(entries, arrays, chunk_bytes)
            fd = (opened or {}).get(path)
            if fd is None:
                try:
                    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                except OSError as err:
                    raise ConfigError(f"{path}: cannot open: {err.strerror or err}") from None
                fds.append(fd)
            jobs.extend((fd, path, view, offset) for view, offset in pieces)
        if threads > 1 and len(jobs) > 1:
            with ThreadPoolExecutor(max_workers=min(threads, len(jobs)), thread_name_prefix="nereid-weights") as pool:
                # list() re-raises the first failure.
                list(pool.map(lambda job: _pread_exactly(job[0], job[2], job[3], job[1]), jobs))
        else:
            for fd, path, view, offset in jobs:
                _pread_exactly(fd, view, offset, path)
    finally:
        for fd in fds:
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
    names = [name for name, _ in items]  # (checked by encode_header, before the file is opened)
    meta: dict[str, str] = dict(metadata or {})
    meta.setdefault(FORMAT_KEY, NEREID_FORMAT)
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
    _check_tensor_names([name for name, _, _, _ in tensors])
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


def _check_tensor_names(names: Sequence[str]) -> None:
    """Raise ValueError for names a header cannot hold: one given twice (the later entry would replace the
    earlier), or ``__metadata__`` (its entry would replace the file's metadata)."""
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate weight names in {list(names)}")
    if METADATA_KEY in names:
        raise ValueError(f"a tensor cannot be named {METADATA_KEY!r}, the header key of the file's metadata")


def read_entry(fd: int, entry: TensorEntry, path: Path) -> np.ndarray:
    """One tensor, in its header shape, read with ``pread`` from an open file (aligned as :func:`empty_for`'s)."""
    array = empty_for(entry)
    _pread_exactly(fd, memoryview(array.reshape(-1).view(np.uint8)), entry.start, path)
    return array
