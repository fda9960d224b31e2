"""Tensors as every protocol sends them: datatype names, shapes and raw bytes, checked the same way.

The gRPC and HTTP codecs both decode a tensor from a datatype string, a shape
and (usually) its raw little-endian bytes; the checks and their messages live
here once.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from nereid.dtypes import DType
from nereid.errors import InvalidArgument
from nereid.signature import MAX_REQUEST_RANK, bool_bytes_problem, brief_repr, expected_byte_size
from nereid.tensors import bytes_array, split_bytes_elements

# Requests (gRPC) and bodies (HTTP) at least this large are decoded on a worker thread, so that the decode's
# Python-level work (splitting many BYTES elements, binary tensors' views, JSON's checks element by element,
# converting typed contents) never stalls the event loop. It still waits while a decode holds the GIL in one C call
# (orjson's parse, numpy's conversions): for a JSON part that is up to a few seconds at 64 MiB, which is why
# server.http_max_json_bytes bounds JSON parts (16 MiB by default).
DECODE_OFF_LOOP_BYTES = 256 << 10
# The request parameter Triton clients use for a per-request timeout, in microseconds.
TIMEOUT_PARAMETER = "timeout"
# The tensor parameter that points Triton at a registered shared-memory region instead of inline data.
SHARED_MEMORY_PARAMETER = "shared_memory_region"
# The request parameter that puts a request in a sequence (Triton's correlation ID) for a stateful model:
# checked for its type and ignored, as Triton ignores it for a model without sequence batching.
SEQUENCE_ID_PARAMETER = "sequence_id"
# Request parameters Triton reads to schedule a request (nereid by neither): checked only for their types.
SCHEDULING_PARAMETERS = ("priority", "sequence_start", "sequence_end")


# The most elements the non-zero dimensions of an empty tensor may multiply to: far past any tensor a
# request could carry, well within what numpy can shape (2**63 bytes, at 16 bytes an element).
MAX_EMPTY_EXTENT = 2 ** 48


def wire_dtype(where: str, datatype: str) -> DType:
    """The DType of a wire datatype string; InvalidArgument naming the valid ones otherwise."""
    try:
        return DType.from_kserve(datatype)
    except ValueError as err:
        raise InvalidArgument(f"{where}: {err}") from None


def wire_shape(where: str, shape: tuple[int, ...]) -> int:
    """Check a request tensor's shape (rank, dimensions of 0 or more); returns its element count.

    A zero-size dimension is a tensor with no elements, as Triton takes it (a
    model's ``-1`` dimension may be 0; its fixed dimensions and the batch size
    are checked against the model later). Its other dimensions are still
    bounded: numpy cannot represent an empty array whose other dimensions
    multiply past 2**63 bytes.
    """
    if len(shape) > MAX_REQUEST_RANK:
        raise InvalidArgument(f"{where}: shape has {len(shape)} dimensions; at most {MAX_REQUEST_RANK} are "
                              "supported")
    if shape and min(shape) < 0:
        raise InvalidArgument(f"{where}: shape {list(shape)} has a negative dimension")
    count = math.prod(shape)
    if count == 0 and math.prod(d for d in shape if d) > MAX_EMPTY_EXTENT:
        raise InvalidArgument(f"{where}: shape {list(shape)} is too large (its non-zero dimensions multiply "
                              f"past {MAX_EMPTY_EXTENT})")
    return count


def decode_raw(where: str, dtype: DType, shape: tuple[int, ...], raw: bytes | memoryview) -> np.ndarray:
    """The array held by a tensor's raw bytes (a read-only view, no copy); BYTES in KServe's framing."""
    count = math.prod(shape)
    if dtype is DType.BYTES:
        try:
            # Stops at the first element past ``count``: megabytes of 1-byte elements for a [1, 1]
            # input are refused after two, not split into millions of objects first.
            elements = split_bytes_elements(raw, count)
        except ValueError as err:
            raise InvalidArgument(f"{where}: {err}") from None
        if len(elements) != count:
            raise InvalidArgument(
                f"{where}: raw contents hold {len(elements)} BYTES elements, expected {count} for shape {list(shape)}")
        return bytes_array(elements, shape)
    expected = expected_byte_size(dtype, shape)
    if len(raw) != expected:
        raise InvalidArgument(
            f"{where}: raw contents are {len(raw)} bytes, expected {expected} "
            f"({dtype.kserve} {list(shape)} = {count} x {dtype.itemsize} bytes)")
    if dtype is DType.BOOL:
        # One byte each, 0 or 1: any other byte is no bool (numpy compares it unequal to True, and a
        # C++ model reading it as bool is undefined behaviour).
        problem = bool_bytes_problem(np.frombuffer(raw, dtype=np.uint8))
        if problem is not None:
            raise InvalidArgument(f"{where}: BOOL raw contents hold {problem}")
    return np.frombuffer(raw, dtype=dtype.little_endian).reshape(shape)


def timeout_deadline_ns(now_ns: int, budgets_ns: list[int]) -> int:
    """The absolute monotonic deadline of the earliest budget (0: none)."""
    return now_ns + min(budgets_ns) if budgets_ns else 0


def class_count(where: str, value: object, quote: Callable[[object], str] | None = None) -> int:
    """A ``classification`` parameter's count of top classes (0: none); InvalidArgument unless a count.

    ``quote`` writes the value as the client's protocol spells it (HTTP: as JSON, so that ``"3"`` and ``3``,
    ``true`` and ``True`` read apart); by default, a bounded part of its Python form, quoted.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        if quote is not None:
            shown = quote(value)
        else:  # (from a bounded part of it: a value may nest a thousand levels deep)
            shown = repr((value if isinstance(value, str) else brief_repr(value, 64))[:64])
        raise InvalidArgument(f"{where}: parameter 'classification' must be a non-negative integer count of "
                              f"classes, got {shown}")
    return value


def check_sequence_id(model: str, value: object, quote: Callable[[object], str] | None = None) -> None:
    """InvalidArgument unless ``value``, a ``sequence_id`` parameter over HTTP, is a correlation ID as Triton's HTTP
    endpoint reads one: an integer from 0 to 2**64 - 1, or a string. A valid one is ignored, as Triton ignores it
    for a model without sequence batching and runs the request on its own: nereid has none (no model keeps state
    between requests). (nereid refused any but 0 and "" until a hunt read Triton 2.41's source: it runs them.)"""
    if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2 ** 64):
        return
    raise InvalidArgument(f"model '{model}': parameter 'sequence_id' must be a correlation ID: an integer from 0 to "
                          f"2**64 - 1 or a string, got {_past_64_bits(value) or _shown(value, quote)}")


def check_scheduling_parameters(model: str, values: dict[str, object],
                                quote: Callable[[object], str] | None = None) -> None:
    """InvalidArgument for a ``priority`` that is no integer >= 0, or a ``sequence_start`` / ``sequence_end`` that
    is no boolean, as Triton refuses them: nereid schedules by neither, but a client sending them wrong is told.
    ``values``: those of the three the request carries, as plain values."""
    priority = values.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int) or priority < 0:
        raise InvalidArgument(f"model '{model}': parameter 'priority' must be an integer >= 0, got "
                              f"{_past_64_bits(priority) or _shown(priority, quote)}")
    for flag in ("sequence_start", "sequence_end"):
        if not isinstance(values.get(flag, False), bool):
            raise InvalidArgument(f"model '{model}': parameter '{flag}' must be true or false, got "
                                  f"{_shown(values[flag], quote)}")


def _past_64_bits(value: object) -> str:
    """How to quote a number past 64 bits: orjson reads such an integer literal as a float, which quoted as it is
    (``1.8446744073709552e+19``) read as a float sent as one; "" for any other value."""
    if isinstance(value, float) and math.isfinite(value) and abs(value) >= 2 ** 63:
        return f"a number past 64 bits (about {value:.6g})"
    return ""


def _shown(value: object, quote: Callable[[object], str] | None) -> str:
    """A parameter's value as a message quotes it: as its protocol spells it (``quote``), else a bounded part
    of its Python form (a string quoted)."""
    if quote is not None:
        return quote(value)
    return repr(value[:64]) if isinstance(value, str) else brief_repr(value, 64)


def refuse_shared_memory(where: str) -> InvalidArgument:
    """The error for a tensor placed in shared memory: nereid lists no shared-memory extension.

    Answering with the data inline instead would leave a client reading stale
    bytes from its region, so the request is refused.
    """
    return InvalidArgument(f"{where}: names a shared-memory region, but nereid does not support Triton's "
                           "shared-memory extensions; send the tensor in the request (and take it from the "
                           "response) instead")
