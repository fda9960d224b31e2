"""Framed tensors: a UTF-8 header line ``"<dtype> d0,d1,...\\n"`` then raw little-endian bytes.

This is the subprocess contract's output format, and the input format of
multi-tensor models (one frame per tensor, in textproto order). BYTES tensors
carry KServe's serialization after the header: each element a 4-byte
little-endian length followed by its bytes.
"""

from __future__ import annotations

import io
import math
from typing import BinaryIO, Iterable

import numpy as np

from nereid.dtypes import DType
from nereid.backends.subprocess.dtype_names import contract_name, dtype_of_contract_name
from nereid.errors import ModelFailure
from nereid.signature import MAX_REQUEST_RANK
from nereid.tensors import NamedTensor, bytes_array, tensor_buffer, tensor_bytes

MAX_HEADER_BYTES = 4096
# A declared shape's dims and the batch axis in front of them: a model declaring the most dims a textproto
# takes was refused, coming back, the [batch, *dims] shape the server itself sent it.
MAX_RANK = MAX_REQUEST_RANK
_CHUNK_BYTES = 1 << 24  # reads above this size are bounded by what the stream holds
_MAX_ARRAY_BYTES = int(np.iinfo(np.intp).max)
_OBJECT_ITEMSIZE = np.dtype(object).itemsize  # a BYTES element is held as an object reference


def encode_frame(tensor: NamedTensor) -> bytes:
    """One framed tensor: header line then its bytes."""
    return frame_header(tensor) + tensor_bytes(tensor)


def frame_header(tensor: NamedTensor) -> bytes:
    """The header line of ``tensor``'s frame: ``"<dtype> d0,d1,...\\n"``."""
    return f"{contract_name(tensor.dtype)} {','.join(str(d) for d in tensor.shape)}\n".encode("utf-8")


def frame_buffers(tensors: Iterable[NamedTensor]) -> list[bytes | memoryview]:
    """The frames of ``tensors`` as buffers to write one after the other: the bytes of :func:`encode_frame`, each
    header followed by a read-only view of its tensor's data (no copy of a contiguous little-endian array; a BYTES
    tensor is serialized once, as ``encode_frame`` serializes it)."""
    buffers: list[bytes | memoryview] = []
    for tensor in tensors:
        data = tensor_buffer(tensor)
        buffers += [frame_header(tensor), data.toreadonly() if isinstance(data, memoryview) else data]
    return buffers


def read_header(stream: BinaryIO, where: str) -> tuple[DType, tuple[int, ...]]:
    """Read and parse one header line; ModelFailure says what is wrong with it."""
    line = stream.readline(MAX_HEADER_BYTES + 1)
    if not line:
        raise ModelFailure(f"{where}: no header line (expected \"<dtype> d0,d1,...\\n\")")
    if not line.endswith(b"\n"):
        if len(line) > MAX_HEADER_BYTES:
            raise ModelFailure(f"{where}: header line longer than {MAX_HEADER_BYTES} bytes")
        raise ModelFailure(f"{where}: header line is not terminated by a newline: {line[:80]!r}")
    try:
        text = line[:-1].decode("utf-8")
    except UnicodeDecodeError:
        raise ModelFailure(f"{where}: header line is not UTF-8: {line[:80]!r}") from None
    parts = text.split(" ")
    if len(parts) == 1 and parts[0]:
        # The contract's header has one space, a scalar's too ("float32 "): without it, a header cut short (or a
        # program that never writes the shape) would pass for a scalar.
        raise ModelFailure(f"{where}: header {text[:80]!r} has no space after its dtype (expected \"<dtype> "
                           f"d0,d1,...\", with one space; a scalar's is \"<dtype> \", nothing after the space)")
    if len(parts) > 2 or not parts[0]:
        raise ModelFailure(f"{where}: malformed header {text[:80]!r} (expected \"<dtype> d0,d1,...\")")
    try:
        dtype = dtype_of_contract_name(parts[0])
    except ValueError as err:
        raise ModelFailure(f"{where}: header {text[:80]!r}: {err}") from None
    dims = parts[1].split(",") if parts[1] else []
    # ASCII digits only: int() alone would also take '+4', '0_4', '4\r' and non-ASCII digits.
    if not all(d.isascii() and d.isdigit() for d in dims):
        raise ModelFailure(f"{where}: header {text[:80]!r}: dimensions must be comma-separated decimal integers "
                           "(ASCII digits)")
    shape = tuple(int(d) for d in dims)
    if len(shape) > MAX_RANK:
        raise ModelFailure(f"{where}: header {text[:80]!r}: bad shape (rank over {MAX_RANK})")
    if not _representable(dtype, shape):
        # A zero dimension makes the body empty, so only numpy itself would notice the other
        # dimensions, with a ValueError instead of the model's failure.
        raise ModelFailure(f"{where}: header {text[:80]!r}: the shape is too large for any array")
    return dtype, shape


def _representable(dtype: DType, shape: tuple[int, ...]) -> bool:
    # numpy's own rule: the non-zero dimensions times the item size must fit in a signed 64-bit size.
    return math.prod(d for d in shape if d) * (dtype.itemsize or _OBJECT_ITEMSIZE) <= _MAX_ARRAY_BYTES


def read_body(stream: BinaryIO, dtype: DType, shape: tuple[int, ...], where: str, max_bytes: int | None = None,
              bound: str = "", max_elements: int = 0) -> np.ndarray:
    """Read the data of a frame whose header was already read and checked.

    ``max_bytes`` (None: no bound) is the most the data may take: a header that
    promises more, or BYTES elements that add up to more, fail before that data
    is read, the message ending with ``bound`` (where the bound comes from).
    ``max_elements`` (0: :data:`MAX_BYTES_ELEMENTS`) bounds a BYTES tensor's elements.
    """
    count = math.prod(shape)
    if dtype is DType.BYTES:
        return _read_bytes_body(stream, count, shape, where, max_bytes, bound, max_elements or MAX_BYTES_ELEMENTS)
    size = count * dtype.itemsize
    if max_bytes is not None and size > max_bytes:
        held = _remaining(stream)  # said too when the file is short of it: both are the model's to fix
        short = f", file holds {held}" if held is not None and held < size else ""
        raise ModelFailure(f"{where}: header promises {size} bytes of {contract_name(dtype)} {list(shape)}{short}; "
                           f"{bound}")
    held = _remaining(stream)
    if held is not None and held < size:  # said before reading: what a short file holds was read whole first
        raise ModelFailure(f"{where}: header promises {size} bytes of {contract_name(dtype)} {list(shape)}, "
                           f"file holds {held}")
    data = _read_at_most(stream, size)
    if len(data) != size:
        raise ModelFailure(f"{where}: header promises {size} bytes of {contract_name(dtype)} {list(shape)}, "
                           f"file holds {len(data)}")
    return np.frombuffer(data, dtype=dtype.little_endian).reshape(shape)


# The most BYTES elements an output may hold per request row of its run: each is an object of the server's (tens of
# bytes of memory, however short), so a run's 2 GiB of outputs could be 536 million of them, tens of GiB (the
# warm-start hunt). As many as a 64 MiB request (max_message_bytes' default) can carry; a batch's run may hold as
# many per row it was given (a cap per run failed two such requests batched; the hunt of that cap).
MAX_BYTES_ELEMENTS = 1 << 24
# The most rows a run's BYTES cap grows by: past it, 32 one-number rows would let a model answer half a billion
# elements, the case the cap is for (the hunt of the per-row cap). 4 x 2**24 elements: a few GiB at most.
MAX_BYTES_ROWS = 4


def _read_bytes_body(stream: BinaryIO, count: int, shape: tuple[int, ...], where: str, max_bytes: int | None,
                     bound: str, max_elements: int) -> np.ndarray:
    # Elements are collected as they are read: a header promising billions of
    # elements fails on the first missing one instead of allocating them all.
    if max_bytes is not None and 4 * count > max_bytes:  # their length prefixes alone
        raise ModelFailure(f"{where}: header promises {count} BYTES elements, at least {4 * count} bytes; {bound}")
    if count > max_elements:
        raise ModelFailure(f"{where}: header promises {count} BYTES elements, past the {max_elements} this run's "
                           f"output may hold ({MAX_BYTES_ELEMENTS} per row it was given: each is an object in the "
                           "server's memory)")
    elements: list[bytes] = []
    size = 0  # the elements' bytes so far, with their length prefixes (as KServe's serialization carries them)
    for index in range(count):
        prefix = stream.read(4)
        if len(prefix) != 4:
            raise ModelFailure(f"{where}: BYTES data ends before element {index} of {count}")
        length = int.from_bytes(prefix, "little")
        size += 4 + length
        if max_bytes is not None and size > max_bytes:
            raise ModelFailure(f"{where}: BYTES element {index} of {count} ({length} bytes) brings the data to "
                               f"{size} bytes; {bound}")
        element = _read_at_most(stream, length)
        if len(element) != length:
            raise ModelFailure(f"{where}: BYTES element {index} is truncated")
        elements.append(element)
    return bytes_array(elements, shape)


def _read_at_most(stream: BinaryIO, size: int) -> bytes:
    """Up to ``size`` bytes, never allocating much more than the stream actually holds.

    ``stream.read(size)`` allocates ``size`` bytes up front, so a header that
    promises gigabytes over a short file would fail with MemoryError instead of
    a clear "file holds N bytes".
    """
    if size <= _CHUNK_BYTES:
        return stream.read(size)
    remaining = _remaining(stream)
    if remaining is not None:
        return stream.read(min(size, remaining))
    chunks: list[bytes] = []
    left = size
    while left > 0:
        chunk = stream.read(min(left, _CHUNK_BYTES))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _remaining(stream: BinaryIO) -> int | None:
    """Bytes left in a seekable stream, None when it cannot tell."""
    try:
        if not stream.seekable():
            return None
        here = stream.tell()
        end = stream.seek(0, io.SEEK_END)
        stream.seek(here)
    except (OSError, ValueError):
        return None
    return max(0, end - here)
