"""KServe V2 REST inference bodies <-> protocol-neutral requests and responses.

Two encodings, as Triton's HTTP endpoint speaks them:

* JSON tensors: ``data`` as a nested or flat list (BYTES elements as strings);
* Triton's binary tensor extension: the body is a JSON header of
  ``Inference-Header-Content-Length`` bytes followed by the tensors' raw bytes,
  in input order; an input says how many with ``parameters.binary_data_size``.
  The client asks for binary outputs with ``binary_data_output`` (request
  parameter) or an output's ``binary_data`` parameter.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import ml_dtypes
import numpy as np
import orjson

from nereid.classification import CLASSIFICATION_PARAMETER
from nereid.dtypes import DType
from nereid.errors import InvalidArgument
from nereid.model_info import MODEL_VERSION
from nereid.protocol.wire import (SCHEDULING_PARAMETERS, SEQUENCE_ID_PARAMETER, SHARED_MEMORY_PARAMETER,
                                  TIMEOUT_PARAMETER, check_sequence_id, check_scheduling_parameters, class_count,
                                  decode_raw, refuse_shared_memory, timeout_deadline_ns, wire_dtype, wire_shape)
from nereid.errors import PublicText
from nereid.signature import brief_repr, check_datatype
from nereid.tensors import InferRequest, InferResponse, NamedTensor, bytes_array, tensor_buffer

HEADER_LENGTH = "inference-header-content-length"
HEADER_LENGTH_HEADER = "Inference-Header-Content-Length"  # as messages spell it


@dataclass(frozen=True)
class OutputChoice:
    """How the client wants the outputs: which ones (empty: all), which of them as binary, which classified.

    An output's own ``binary_data`` (true: ``binary``, false: ``json``) overrides
    the request's ``binary_data_output`` (``binary_by_default``).
    """

    names: tuple[str, ...]
    binary: frozenset[str]
    binary_by_default: bool
    classifications: dict[str, int] = field(default_factory=dict)
    json: frozenset[str] = frozenset()

    def is_binary(self, name: str) -> bool:
        return name in self.binary or (self.binary_by_default and name not in self.json)


def decode_infer(model: str, body: bytes | memoryview, header_length: int | None,
                 declared: Mapping[str, DType] | None = None) -> tuple[InferRequest, OutputChoice]:
    """Decode an infer body; InvalidArgument naming the problem for anything malformed, MemoryError when the
    server runs out of memory decoding it (orjson's allocation failure included).

    ``declared``: the model's input datatypes by name (None: not checked here). An input the model declares sent
    in another datatype is refused as the data plane refuses it, before its data is converted or split (see
    :func:`nereid.protocol.grpc_codec.decode_infer_request`).

    Its message is a :class:`PublicText`: built from the request alone, it echoes the client's names as sent.
    """
    try:
        return _decode_infer(model, body, header_length, declared or {})
    except InvalidArgument as err:
        # Scrubbing server paths out of it rewrote a name such as "/opt/nereid/core/x" into "<nereid>/x",
        # telling the client which absolute paths are the server's.
        PublicText.mark(err)
        # Without the decode's own frames: their locals hold everything parsed (for a 16 MiB body of JSON, ~500
        # MiB of Python objects), and the handler's future and frames make a cycle with the traceback, so they
        # stayed until the collector's next full pass: four large bodies refused one after another held 1.1 GiB.
        raise err.with_traceback(None)


def _decode_infer(model: str, body: bytes | memoryview, header_length: int | None,
                  declared: Mapping[str, DType]) -> tuple[InferRequest, OutputChoice]:
    if header_length is None:
        header_bytes, binary = body, memoryview(b"")
    else:
        if header_length < 0 or header_length > len(body):
            raise InvalidArgument(f"model '{model}': Inference-Header-Content-Length is {header_length}, "
                                  f"but the body has {len(body)} bytes")
        view = memoryview(body)
        header_bytes, binary = view[:header_length], view[header_length:]
    document = _parse_json(model, header_bytes, None if header_length is None else body)
    if not isinstance(document, dict):
        raise InvalidArgument(f"model '{model}': the request body must be a JSON object")
    parameters = _object(model, document.get("parameters", {}), "parameters")
    raw_inputs = document.get("inputs")
    if not isinstance(raw_inputs, list):
        # An empty list is a request to a model without inputs (tritonclient sends one); the model's signature
        # check refuses it for a model that has inputs, naming them, as over gRPC.
        raise InvalidArgument(f"model '{model}': 'inputs' must be a list of tensors")
    inputs, offset = [], 0
    for index, raw in enumerate(raw_inputs):
        tensor, used = _decode_input(model, index, raw, binary, offset, declared)
        inputs.append(tensor)
        offset += used
    if offset != len(binary):
        raise InvalidArgument(f"model '{model}': the body carries {len(binary)} bytes of binary data after its "
                              f"JSON header, but the inputs' binary_data_size add up to {offset}")
    request_id = document.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidArgument(f"model '{model}': 'id' must be a string")
    # The parameters in the order the gRPC codec checks them (timeout, sequence_id, scheduling, outputs), so that
    # a request with two bad ones is told of the same one over either protocol.
    budgets = []
    if TIMEOUT_PARAMETER in parameters:
        timeout_us = parameters[TIMEOUT_PARAMETER]
        if isinstance(timeout_us, float) and timeout_us >= 2 ** 64:
            # orjson reads an integer literal past 64 bits as a float: too large, not "not an integer" (gRPC's
            # int64 and uint64 parameters cannot carry it either). Below 2**64 a float was sent as one.
            raise InvalidArgument(f"model '{model}': parameter 'timeout' must be a non-negative integer number "
                                  f"of microseconds of at most 64 bits; got about {timeout_us:.6g}")
        if isinstance(timeout_us, bool) or not isinstance(timeout_us, int) or timeout_us < 0:
            raise InvalidArgument(f"model '{model}': parameter 'timeout' must be a non-negative integer number "
                                  f"of microseconds, got {quoted(timeout_us)}")
        if timeout_us:
            budgets.append(timeout_us * 1000)
    if SEQUENCE_ID_PARAMETER in parameters:
        check_sequence_id(model, parameters[SEQUENCE_ID_PARAMETER], quoted)
    scheduling = {key: parameters[key] for key in SCHEDULING_PARAMETERS if key in parameters}
    if scheduling:
        check_scheduling_parameters(model, scheduling, quoted)
    choice = _output_choice(model, document.get("outputs", []), parameters)
    request = InferRequest(model, inputs, request_id, list(choice.names),
                           timeout_deadline_ns(time.monotonic_ns(), budgets), choice.classifications)
    return request, choice


def _parse_json(model: str, header: bytes | memoryview, body: bytes | memoryview | None) -> Any:
    """The JSON header as Python values; InvalidArgument naming the problem. ``body``: the whole body, when an
    Inference-Header-Content-Length cut ``header`` from it (None: none was sent, and ``header`` is the body)."""
    try:
        # orjson: strict RFC 8259 (valid UTF-8, depth limited), and 5x faster than the json module on these
        # small headers, which every request pays.
        return orjson.loads(header)
    except orjson.JSONDecodeError as err:
        if is_allocation_failure(err):
            # The server's failure, not the body's: the caller answers it as any MemoryError (503).
            raise MemoryError(f"orjson: {err}") from None
        error = err
    document = _with_non_finite_literals(header)
    if document is not None:
        return document
    if body is None:
        _refuse_binary_without_header_length(model, bytes(header))
        raise InvalidArgument(f"model '{model}': the request body is not valid JSON ({error})")
    _refuse_header_length_off(model, body, len(header))
    raise InvalidArgument(f"model '{model}': the JSON header (the body's first {len(header)} bytes, as "
                          f"{HEADER_LENGTH_HEADER} says) is not valid JSON ({error})")


def _with_non_finite_literals(header: bytes | memoryview) -> Any:
    """The header read with the NaN, Infinity and -Infinity literals Triton reads and writes (and tritonclient.http
    sends for such values), which orjson refuses; None when it still is not valid (orjson's reason is the one
    told). Only bodies orjson refused come here, so the common path pays nothing."""
    raw = bytes(header)
    if b"NaN" not in raw and b"Infinity" not in raw:
        return None
    try:
        # Everything else as strictly as orjson reads it: UTF-8 (json.loads of bytes also takes UTF-16 and a BOM;
        # of a str, refuses a BOM), a number too large for a double refused, an integer past 64 bits read as a
        # float, and (below) no lone surrogate, which json lets through.
        document = json.loads(raw.decode("utf-8"), parse_float=_finite_float, parse_int=_as_orjson_reads_it)
    except (ValueError, RecursionError):
        return None
    # (A surrogate can only come from a \uD800-\uDFFF escape, raw UTF-8 holds none: most bodies skip the walk.)
    if _SURROGATE_ESCAPE.search(raw) is None:
        return document
    return document if _has_no_lone_surrogate(document) else None


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # (an escaped backslash before "ud8..." too: then walked)


def _has_no_lone_surrogate(document: Any) -> bool:
    """Whether every string of ``document`` (a parsed JSON value) encodes as UTF-8: orjson refuses a lone
    surrogate's escape (``"\\ud800"``), which json reads. Walked without recursion: orjson.dumps, which checked
    it before, stops at 255 levels of nesting, where reading takes 1024 (a body nested deeper with a NaN in it
    was refused as invalid JSON, blamed on the NaN)."""
    pending = [document]
    while pending:
        value = pending.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return False
        elif isinstance(value, list):
            pending.extend(value)
        elif isinstance(value, dict):
            pending.extend(value)  # (its keys)
            pending.extend(value.values())
    return True


def _finite_float(text: str) -> float:
    """A JSON number with a fraction or exponent, refused (ValueError) when a double cannot hold it (``1e400``),
    as orjson refuses it: only the literals stand for an infinity."""
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number {text[:32]} is infinity when parsed as double")
    return value


def _as_orjson_reads_it(text: str) -> int | float:
    """A JSON integer as orjson reads it: an int within 64 bits (signed or not), a float past them."""
    value = int(text)
    if -2 ** 63 <= value < 2 ** 64:
        return value
    try:
        return float(value)
    except OverflowError:  # (309 digits or more: a 500 and a traceback per request once, in a body with a NaN)
        raise ValueError(f"number {text[:32]} is infinity when parsed as double") from None


def _refuse_binary_without_header_length(model: str, body: bytes) -> None:
    """InvalidArgument when ``body`` is a JSON document followed by more bytes: binary data sent without the
    Inference-Header-Content-Length header that says where the JSON ends (orjson blamed character 0 of a valid
    document, having found the binary tail not UTF-8). Returns when it is not that."""
    length = _leading_document_length(body)
    if length is None or not body[length:].strip():
        return
    raise InvalidArgument(f"model '{model}': the request body is a JSON document of {length} bytes followed by "
                          f"{len(body) - length} more bytes, and has no {HEADER_LENGTH_HEADER} header; binary "
                          f"tensor data needs {HEADER_LENGTH_HEADER}: {length}")


def _refuse_header_length_off(model: str, body: bytes | memoryview, header_length: int) -> None:
    """InvalidArgument when ``body`` starts with a JSON document of another length than Inference-Header-Content-
    Length says: the header's length counted wrong (in characters, say, where a non-ASCII ``id`` takes more bytes),
    which was told as "not valid JSON" of a valid document (the error hunt). Returns when it is not that.

    Only the header and 64 KiB past it are looked at: the mistake is a few bytes, and decoding the whole body, its
    binary data too, held the event loop (the GIL) a second per 64 MiB refused (the review)."""
    length = _leading_document_length(bytes(memoryview(body)[:header_length + HEADER_LENGTH_SLACK]))
    if length is None or length == header_length:
        return
    raise InvalidArgument(f"model '{model}': {HEADER_LENGTH_HEADER} is {header_length}, but the body starts with a "
                          f"JSON document of {length} bytes (the header's length counts its bytes, as UTF-8)")


HEADER_LENGTH_SLACK = 64 << 10  # how far past Inference-Header-Content-Length a JSON header's end is looked for


def _leading_document_length(body: bytes) -> int | None:
    """How many bytes the JSON document at the start of ``body`` takes (None: it starts with none)."""
    text = body.decode("utf-8", "surrogateescape")  # one character per undecodable byte: offsets stay countable
    try:
        _, end = json.JSONDecoder().raw_decode(text)
    except (ValueError, RecursionError):
        return None
    return len(text[:end].encode("utf-8", "surrogateescape"))


# orjson reports failing to allocate its parse buffer as a JSONDecodeError with one of these messages.
_ORJSON_ALLOCATION_FAILURES = ("Not enough memory", "failed to allocate memory")


def is_allocation_failure(error: orjson.JSONDecodeError) -> bool:
    """Whether orjson's decode error is its own allocation failure (the server out of memory), not the body's fault."""
    return str(error).startswith(_ORJSON_ALLOCATION_FAILURES)


def _decode_input(model: str, index: int, raw: Any, binary: memoryview, offset: int,
                  declared: Mapping[str, DType]) -> tuple[NamedTensor, int]:
    """One input tensor and how many bytes of the binary section it took; refused before its data is read when
    ``declared`` gives its name another datatype."""
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        raise InvalidArgument(f"model '{model}': inputs[{index}] must be an object with a 'name'")
    where = f"model '{model}': input '{raw['name'][:256]}'"
    datatype = raw.get("datatype")
    if not isinstance(datatype, str):
        raise InvalidArgument(f"{where}: 'datatype' must be a string such as \"FP32\"")
    dtype = wire_dtype(where, datatype)
    shape_value = raw.get("shape")
    if not isinstance(shape_value, list):
        raise InvalidArgument(f"{where}: 'shape' must be a list of integers")
    for position, dim in enumerate(shape_value):
        if not isinstance(dim, int) or isinstance(dim, bool):
            # (orjson reads an integer literal past 64 bits as a float: say so, rather than "not an integer".)
            huge = isinstance(dim, float) and math.isfinite(dim) and dim.is_integer() and abs(dim) >= 2**63
            raise InvalidArgument(f"{where}: 'shape' must be a list of integers; element {position} is "
                                  f"{quoted(dim)}{', past what a 64-bit integer holds' if huge else ''}")
    shape = tuple(shape_value)
    count = wire_shape(where, shape)
    parameters = _object(model, raw.get("parameters", {}), f"inputs[{index}].parameters")
    if SHARED_MEMORY_PARAMETER in parameters:
        raise refuse_shared_memory(where)
    if raw["name"] in declared:  # (an undeclared name: the data plane's validation names it unexpected)
        check_datatype(model, raw["name"], dtype, declared[raw["name"]])
    size = parameters.get("binary_data_size")
    if size is not None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise InvalidArgument(f"{where}: binary_data_size must be a non-negative integer")
        # ("data": null is no data: the KServe SDK writes it beside binary_data_size 0 for a tensor of no
        # elements, which Triton serves.)
        if raw.get("data") is not None:
            raise InvalidArgument(f"{where}: data sent both as JSON 'data' and as binary data; send one")
        if offset + size > len(binary):
            raise InvalidArgument(f"{where}: binary_data_size is {size}, but only {len(binary) - offset} bytes "
                                  "of binary data are left in the body")
        return NamedTensor(raw["name"], dtype, decode_raw(where, dtype, shape, binary[offset:offset + size])), size
    if "data" not in raw:
        raise InvalidArgument(f"{where}: no 'data' and no binary_data_size parameter")
    return NamedTensor(raw["name"], dtype, _json_array(where, dtype, shape, count, raw["data"])), 0


def _json_array(where: str, dtype: DType, shape: tuple[int, ...], count: int, data: Any) -> np.ndarray:
    """A tensor from JSON ``data`` (nested or flat), checked element by element for its datatype."""
    flat = _flatten(where, data)
    if len(flat) != count:
        raise InvalidArgument(f"{where}: 'data' holds {len(flat)} elements, expected {count} for shape {list(shape)}")
    if dtype is DType.BYTES:
        if not all(isinstance(e, str) for e in flat):
            raise InvalidArgument(f"{where}: BYTES data must be a list of strings"
                                  f"{_first_refused(flat, lambda e: isinstance(e, str))}")
        return bytes_array([e.encode("utf-8") for e in flat], shape)
    if dtype is DType.BOOL:
        if not all(isinstance(e, bool) for e in flat):
            raise InvalidArgument(f"{where}: BOOL data must be a list of true/false"
                                  f"{_first_refused(flat, lambda e: isinstance(e, bool))}")
        return np.array(flat, dtype=np.bool_).reshape(shape)
    if not all(map(_is_number, flat)):
        # (null is what JavaScript's JSON.stringify writes for a NaN: the element says which.)
        raise InvalidArgument(f"{where}: {dtype.kserve} data must be a list of numbers"
                              f"{_first_refused(flat, _is_number)}")
    if dtype.numpy.kind in "iu":
        info = np.iinfo(dtype.numpy)
        not_int = next((e for e in flat if not isinstance(e, int)), None)
        if not_int is not None:
            if not_int.is_integer() and not info.min <= not_int <= info.max:
                # orjson reads an integer literal past 64 bits as a float: out of range, not "not an integer"
                # (and its digits are no longer known exactly).
                raise InvalidArgument(f"{where}: a value of about {not_int:.6g} does not fit {dtype.kserve} "
                                      f"(range {info.min} to {info.max})")
            if not_int.is_integer() and abs(not_int) >= 2 ** 53:
                # (-2**63 - 1 reads as the float -2**63, in range: which of the two was sent is not known.)
                raise InvalidArgument(f"{where}: {dtype.kserve} data must be integers within {info.min} to "
                                      f"{info.max}; got about {not_int:.6g}, read as a number with a fraction or "
                                      "exponent, or an integer past 64 bits")
            raise InvalidArgument(f"{where}: {dtype.kserve} data must be integers"
                                  f"{_first_refused(flat, lambda e: isinstance(e, int))}")
        bad = next((e for e in flat if e < info.min or e > info.max), None)
        if bad is not None:
            raise InvalidArgument(f"{where}: value {bad} does not fit {dtype.kserve} (range {info.min} to {info.max})")
        return np.array(flat, dtype=dtype.numpy).reshape(shape)
    # Through float64 first: it holds every number orjson reads (its integers reach 2**64 - 1, which
    # ml_dtypes' own conversion refused), and each datatype is then rounded once, from it.
    exact = np.array(flat, dtype=np.float64)
    with np.errstate(over="ignore"):  # an overflow is refused just below, with the value
        array = (_to_bfloat16(exact) if dtype is DType.BF16 else exact.astype(dtype.numpy)).reshape(shape)
    overflowed = np.isfinite(exact) & ~np.isfinite(array.reshape(-1))  # (a NaN or Infinity literal is kept)
    if overflowed.any():
        bad = flat[int(np.argmax(overflowed))]
        raise InvalidArgument(f"{where}: value {bad} does not fit {dtype.kserve} "
                              f"(largest magnitude {float(ml_dtypes.finfo(dtype.numpy).max)})")
    return array


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _first_refused(flat: list[Any], accepted: Callable[[Any], bool]) -> str:
    """The first element of ``flat`` (a tensor's JSON data, flattened) that ``accepted`` refuses, for a message
    (with its leading "; "): a message without it named neither the element nor its value."""
    index, value = next((i, e) for i, e in enumerate(flat) if not accepted(e))
    return f"; element {index} is {quoted(value)}"


def _to_bfloat16(exact: np.ndarray) -> np.ndarray:
    """float64 values rounded once to the nearest bfloat16 (ties to even).

    ml_dtypes goes through float32, rounding twice: 1 + 2**-8 + 2**-40 became
    1.0 (float32 lands on the midpoint, then ties to even) instead of
    1.0078125. Rounding to float32 "to odd" first (truncate, then set the last
    bit when anything was dropped) keeps the information the second rounding
    needs, since float32 carries 16 more bits than bfloat16.
    """
    with np.errstate(over="ignore"):
        nearest = exact.astype(np.float32)
    away = np.abs(nearest.astype(np.float64)) > np.abs(exact)
    truncated = np.where(away, np.nextafter(nearest, np.float32(0)), nearest)
    inexact = truncated.astype(np.float64) != exact
    odd = (truncated.view(np.uint32) | inexact.astype(np.uint32)).view(np.float32)
    return odd.astype(ml_dtypes.bfloat16)


def _flatten(where: str, data: Any) -> list:
    if not isinstance(data, list):
        raise InvalidArgument(f"{where}: 'data' must be a list")
    if not any(isinstance(e, list) for e in data):
        return data
    flat: list = []
    stack = [iter(data)]
    while stack:  # iterative: a deeply nested body must not exhaust the recursion limit
        for element in stack[-1]:
            if isinstance(element, list):
                stack.append(iter(element))
                break
            flat.append(element)
        else:
            stack.pop()
    return flat


def _output_choice(model: str, outputs: Any, parameters: dict) -> OutputChoice:
    if not isinstance(outputs, list):
        raise InvalidArgument(f"model '{model}': 'outputs' must be a list")
    names, binary, json_outputs, classifications = [], set(), set(), {}
    for index, output in enumerate(outputs):
        if not isinstance(output, dict) or not isinstance(output.get("name"), str):
            raise InvalidArgument(f"model '{model}': outputs[{index}] must be an object with a 'name'")
        names.append(output["name"])
        options = _object(model, output.get("parameters", {}), f"outputs[{index}].parameters")
        if SHARED_MEMORY_PARAMETER in options:
            raise refuse_shared_memory(f"model '{model}': output '{output['name'][:256]}'")
        choice = _flag(model, options, "binary_data", f"output '{output['name'][:256]}': ")
        if choice is True:
            binary.add(output["name"])
        elif choice is False:
            json_outputs.add(output["name"])
        if CLASSIFICATION_PARAMETER in options:
            count = class_count(f"model '{model}': output '{output['name'][:256]}'", options[CLASSIFICATION_PARAMETER],
                                quoted)
            if count:
                classifications[output["name"]] = count
    by_default = _flag(model, parameters, "binary_data_output", "") is True
    return OutputChoice(tuple(names), frozenset(binary), by_default, classifications, frozenset(json_outputs))


def quoted(value: Any) -> str:
    """A client's JSON value as a message quotes it: as JSON (``"yes"``, ``true``), cut to 64 characters; one
    nested past orjson's depth (a thousand levels made json.dumps raise RecursionError: a 500) from a bounded
    part of it, as Python writes it."""
    if isinstance(value, float) and not math.isfinite(value):  # (orjson writes them as null)
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    try:
        text = orjson.dumps(value).decode()
    except (orjson.JSONEncodeError, TypeError):
        return brief_repr(value, 64)
    return text if len(text) <= 64 else text[:61] + "..."


def _flag(model: str, parameters: dict, key: str, where: str) -> bool | None:
    """A true/false parameter (None: absent); anything else is refused, as Triton refuses it, rather than read
    as false (``"binary_data_output": "yes"`` would otherwise answer JSON without a word)."""
    value = parameters.get(key)
    if value is None or isinstance(value, bool):
        return value
    raise InvalidArgument(f"model '{model}': {where}parameter '{key}' must be true or false, got "
                          f"{quoted(value)}")


def _object(model: str, value: Any, what: str) -> dict:
    if not isinstance(value, dict):
        raise InvalidArgument(f"model '{model}': '{what}' must be a JSON object")
    return value


def encode_infer(response: InferResponse, choice: OutputChoice) -> tuple[list[bytes | memoryview], int | None]:
    """The response body's parts and, when any output is binary, the JSON header's length (its parts' together).

    An output of more than :data:`JSON_CHUNK_ELEMENTS` elements answered as
    JSON is written a chunk at a time into parts of its own: as one list of
    Python values it cost about 40 bytes an element on top of the answer (a
    64 MB FP32 output answered as JSON took 1 GB, four at once 3 GiB), and
    held the GIL, the event loop's included, for seconds (the HTTP hunt).
    """
    outputs, binaries, finite = [], [], True
    chunked: dict[bytes, list[bytes | memoryview]] = {}  # a placeholder's JSON -> the data's parts
    nonce = ""  # (made for an answer that chunks: see _PLACEHOLDER)
    for tensor in response.outputs:
        entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.dtype.kserve, "shape": list(tensor.shape)}
        if choice.is_binary(tensor.name):
            raw = tensor_buffer(tensor)
            entry["parameters"] = {"binary_data_size": len(raw)}
            binaries.append(raw)
        elif tensor.data.size > JSON_CHUNK_ELEMENTS:
            nonce = nonce or secrets.token_hex(16)
            placeholder = f"{_PLACEHOLDER}{nonce}-{len(chunked)}\0"
            entry["data"] = placeholder
            chunked[orjson.dumps(placeholder)] = _json_chunks(response.model_name, tensor)
        else:
            entry["data"] = data = _json_data(response.model_name, tensor.data.reshape(-1), tensor)
            if finite and _is_float(tensor.dtype):
                finite = all(math.isfinite(value) for value in data)
        outputs.append(entry)
    document: dict[str, Any] = {"model_name": response.model_name, "model_version": MODEL_VERSION,
                                "outputs": outputs}
    if response.id:
        document["id"] = response.id
    header = _dumps(document, finite)
    parts: list[bytes | memoryview] = [header]
    for placeholder, data in chunked.items():  # (in the header's order: the outputs' own)
        before, after = parts.pop().split(placeholder, 1)
        parts += [before, *data, after]
    if not binaries:
        return parts, None
    return [*parts, *binaries], sum(len(part) for part in parts)


# An output of more elements than this answered as JSON is written a chunk of this many elements at a time.
JSON_CHUNK_ELEMENTS = 1 << 18
# Stands for a chunked output's data in the answer's JSON until its parts are put in its place, with a random nonce
# of the answer's own: a fixed text was found in a BYTES output (the client's own text echoed) or a tensor name
# first, and the data went to the wrong output (the hunt of this change). 128 random bits no one can guess.
_PLACEHOLDER = "\0nereid-chunked-output-data-"


def _dumps(value: Any, finite: bool) -> bytes:
    """``value`` as JSON; NaN and infinities (``finite`` False) as the NaN, Infinity and -Infinity literals Triton
    writes (and tritonclient.http reads): orjson would write null, a value the client cannot tell from a missing
    one."""
    return orjson.dumps(value) if finite else json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def _is_float(dtype: DType) -> bool:
    return dtype.numpy.kind == "f" or dtype is DType.BF16  # (bfloat16's kind is "V")


def _json_chunks(model: str, tensor: NamedTensor) -> list[bytes | memoryview]:
    """The JSON array of ``tensor``'s elements, flattened, as parts written a chunk of elements at a time."""
    flat = tensor.data.reshape(-1)
    parts: list[bytes | memoryview] = [b"["]
    for start in range(0, flat.size, JSON_CHUNK_ELEMENTS):
        chunk = flat[start:start + JSON_CHUNK_ELEMENTS]
        finite = not _is_float(tensor.dtype) or bool(np.isfinite(
            chunk.astype(np.float32) if tensor.dtype is DType.BF16 else chunk).all())
        if start:
            parts.append(b",")
        parts.append(memoryview(_dumps(_json_data(model, chunk, tensor), finite))[1:-1])  # (without [ and ])
    parts.append(b"]")
    return parts


def _json_data(model: str, flat: np.ndarray, tensor: NamedTensor) -> list:
    """The elements ``flat`` (of ``tensor``, flattened) as JSON values: numbers, booleans or text."""
    if tensor.dtype is DType.BYTES:
        try:
            return [bytes(e).decode("utf-8") if not isinstance(e, str) else e for e in flat]
        except UnicodeDecodeError:
            raise InvalidArgument(f"model '{model}': output '{tensor.name}' holds bytes that are not UTF-8 text; "
                                  "ask for it as binary data (binary_data: true)") from None
    if tensor.dtype in (DType.FP16, DType.BF16):
        flat = flat.astype(np.float32)
    return flat.tolist()
