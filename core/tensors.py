"""Protocol-neutral request and response types shared by every layer."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

from nereid.dtypes import DType

_LENGTH = struct.Struct("<I")


@dataclass(frozen=True)
class NamedTensor:
    """A named host tensor: its datatype and a numpy array holding the data.

    BYTES tensors hold a numpy object array whose elements are ``bytes``.
    """

    name: str
    dtype: DType
    data: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        """The row-major shape of ``data``."""
        return tuple(self.data.shape)

    @classmethod
    def from_array(cls, name: str, data: np.ndarray) -> NamedTensor:
        """Build a tensor whose datatype is derived from the array's dtype, as tritonclient's
        ``set_data_from_numpy`` and Triton's ``pb_utils.Tensor`` derive it: a fixed-width bytes or str array (numpy
        ``S``, ``U``) is BYTES, its elements bytes or str objects, and an array of the other byte order (``>f4``)
        is its datatype's, in this machine's order (the meta hunt: a BLS port's ``np.array([b"a"])`` failed its
        orchestration)."""
        if isinstance(data, np.ndarray):
            if data.dtype.kind in "SU":
                data = data.astype(object)
            elif not data.dtype.isnative:
                data = data.astype(data.dtype.newbyteorder("="))
        return cls(name, DType.of(data), data)


@dataclass
class InferRequest:
    """A decoded inference request, the scheduler's unit of work.

    ``deadline_ns`` is an absolute ``time.monotonic_ns()`` deadline (0: none); a
    remaining-time budget from the wire is converted to it when the request is
    decoded, so clock differences between processes never matter.
    ``requested_outputs`` empty means every output. ``classifications`` maps
    a requested output to how many of its top classes to return instead of
    its values (Triton's classification extension).
    """

    model_name: str
    inputs: list[NamedTensor]
    id: str = ""
    requested_outputs: list[str] = field(default_factory=list)
    deadline_ns: int = 0
    classifications: dict[str, int] = field(default_factory=dict)


@dataclass
class InferResponse:
    """The result of one request: its outputs, in the model's declared order."""

    model_name: str
    outputs: list[NamedTensor]
    id: str = ""


def bytes_array(elements: list[bytes], shape: tuple[int, ...]) -> np.ndarray:
    """A BYTES tensor's object array (``np.array`` would make a fixed-width ``S`` array and pad it)."""
    array = np.empty(len(elements), dtype=object)
    array[:] = elements
    return array.reshape(shape)


# What a malformed BYTES serialization is told it should be (the error hunt: text sent without the prefixes was told
# only of an element of 1.8 GB).
_BYTES_LAYOUT = "; BYTES contents hold each element as a 4-byte little-endian length, then its bytes"


def split_bytes_elements(raw: bytes | memoryview, limit: int | None = None) -> list[bytes]:
    """Split KServe's BYTES serialization: each element a 4-byte little-endian length, then the bytes.

    With ``limit``, raises ValueError at the first element beyond it, so surplus
    elements are never materialized.
    """
    elements: list[bytes] = []
    offset, view = 0, memoryview(raw)
    size = len(view)
    while offset < size:
        if limit is not None and len(elements) >= limit:
            raise ValueError(f"raw contents hold more than the {limit} BYTES element(s) the shape allows")
        if offset + 4 > size:
            raise ValueError(f"BYTES contents end inside a 4-byte length prefix (element {len(elements)}: "
                             f"{size - offset} byte(s) left){_BYTES_LAYOUT}")
        (length,) = _LENGTH.unpack_from(view, offset)
        offset += 4
        if offset + length > size:
            # (Data sent with no length prefixes reads its first 4 bytes as a length: b"hell" as 1,819,043,176.)
            raise ValueError(f"BYTES element {len(elements)} of {length} bytes runs past the end of the contents "
                             f"({size - offset} byte(s) left){_BYTES_LAYOUT}")
        elements.append(bytes(view[offset:offset + length]))
        offset += length
    return elements


# Up to this many elements, or elements of this many bytes on average, BYTES are joined from a list of parts; more
# and smaller, laid out with numpy (see bytes_elements_buffer).
_JOIN_AS_PARTS_UP_TO = 64
_JOIN_AS_PARTS_FROM_BYTES = 128


_MAX_ELEMENT_BYTES = 0xFFFFFFFF  # what a 4-byte length prefix can say


def _element_too_long(length: int) -> ValueError:
    """The refusal of a BYTES element too long for its length prefix (struct.pack's own error named no bound)."""
    return ValueError(f"a BYTES element of {length} bytes is past the 4-byte length prefix's bound")


def join_bytes_elements(array: np.ndarray) -> bytes:
    """KServe's BYTES serialization of an object array of ``bytes`` (str is UTF-8 encoded)."""
    buffer = bytes_elements_buffer(array)
    return buffer if isinstance(buffer, bytes) else bytes(buffer)


def bytes_elements_buffer(array: np.ndarray) -> bytes | memoryview:
    """:func:`join_bytes_elements`, as a view of a buffer of its own where that saves a copy.

    Each element is its 4-byte little-endian length, then its bytes. Many
    small elements are laid out with numpy, never one Python object per length
    prefix: a tensor of 20 million empty elements took 4.6 GiB joined from
    parts (218 bytes an element at peak), and its collection stalled the event
    loop for seconds (a bug hunt); it takes under 100 bytes an element so.
    """
    flat = array.reshape(-1)
    elements = [element if type(element) is bytes else
                element.encode("utf-8") if isinstance(element, str) else bytes(element) for element in flat]
    count = len(elements)
    lengths = np.fromiter(map(len, elements), dtype=np.int64, count=count) if count > _JOIN_AS_PARTS_UP_TO else None
    if lengths is None or int(lengths.sum()) >= _JOIN_AS_PARTS_FROM_BYTES * count:
        # Few elements, or large ones (a batch of images): two objects an element cost little beside their bytes,
        # and the join copies each once, where the layout below costs a mask and a scatter per byte (the
        # regression hunt: 1,000 elements of 100 KB took 2.6 times as long, and 4 times the memory).
        parts: list[bytes] = []
        for data in elements:
            if len(data) > _MAX_ELEMENT_BYTES:
                raise _element_too_long(len(data))
            parts.append(_LENGTH.pack(len(data)))
            parts.append(data)
        return b"".join(parts)
    if int(lengths.max()) > _MAX_ELEMENT_BYTES:
        raise _element_too_long(int(lengths.max()))
    data = b"".join(elements)
    del elements
    out = np.empty(4 * count + len(data), dtype=np.uint8)
    prefix_at = np.cumsum(lengths)
    prefix_at -= lengths
    prefix_at += np.arange(0, 4 * count, 4, dtype=np.int64)  # where each element's length prefix starts
    prefix_bytes = lengths.astype("<u4").view(np.uint8).reshape(count, 4)
    del lengths
    is_prefix = np.zeros(len(out), dtype=bool)
    for byte in range(4):
        out[prefix_at + byte] = prefix_bytes[:, byte]
        is_prefix[prefix_at + byte] = True
    if data:
        out[~is_prefix] = np.frombuffer(data, dtype=np.uint8)
    return memoryview(out)


def tensor_bytes(tensor: NamedTensor) -> bytes:
    """The raw little-endian row-major bytes of a tensor (KServe framing for BYTES)."""
    if tensor.dtype is DType.BYTES:
        return join_bytes_elements(tensor.data)
    data = tensor.data
    root = _root_bytes(data)
    if root is not None and len(root) == data.nbytes and data.flags.c_contiguous and data.dtype.byteorder != ">":
        return root  # the array is exactly a bytes object it views (an echoed input): no copy
    return np.ascontiguousarray(data, dtype=tensor.dtype.little_endian).tobytes()


def tensor_buffer(tensor: NamedTensor) -> bytes | memoryview:
    """:func:`tensor_bytes` without a copy where the array already holds exactly those bytes.

    A C-contiguous little-endian array is returned as a byte view of itself;
    anything else is converted (BYTES, big-endian or strided arrays).
    """
    data = tensor.data
    if (tensor.dtype is not DType.BYTES and data.flags.c_contiguous and data.dtype.byteorder != ">"
            and data.dtype == tensor.dtype.little_endian):
        # A uint8 view first: extension dtypes (bfloat16) have no buffer format of their own.
        return memoryview(data.reshape(-1).view(np.uint8))
    if tensor.dtype is DType.BYTES:
        return bytes_elements_buffer(data)
    return tensor_bytes(tensor)


def _root_bytes(array: np.ndarray) -> bytes | None:
    """The bytes object at the bottom of a chain of numpy views (or of a memoryview), if that is what it is."""
    base = array.base
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    return base if isinstance(base, bytes) else None
