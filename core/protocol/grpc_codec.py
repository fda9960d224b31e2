"""KServe V2 messages <-> protocol-neutral tensors and requests."""

from __future__ import annotations

import time
from typing import Iterable, Mapping

import numpy as np
from google.protobuf.message import DecodeError

from nereid._proto import grpc_service_pb2 as pb
from nereid.classification import CLASSIFICATION_PARAMETER
from nereid.dtypes import DType
from nereid.errors import InvalidArgument
from nereid.model_info import MODEL_VERSION
from nereid.protocol.wire import (SCHEDULING_PARAMETERS, SEQUENCE_ID_PARAMETER, SHARED_MEMORY_PARAMETER,
                                  TIMEOUT_PARAMETER, check_scheduling_parameters, class_count,
                                  decode_raw, refuse_shared_memory, wire_dtype, wire_shape)
from nereid.errors import PublicText
from nereid.signature import brief_repr, check_datatype, check_input_names
from nereid.tensors import InferRequest, InferResponse, NamedTensor, bytes_array, tensor_buffer, tensor_bytes


# ModelInferRequest.raw_input_contents: field 7, length-delimited.
_RAW_FIELD = 7
_LENGTH_DELIMITED = 2
# The most top-level fields a request may have, whatever its size: a request to a model of the most inputs and
# outputs (4,096 each, see signature.MAX_DECLARED_TENSORS) has about 12,300 (an input, its raw contents and an
# output each, and parameters). 4 million empty inputs in 64 MiB took 18 s of the server's CPU and 2.4 GiB, the
# event loop held while protobuf parsed them, before any model refused them (the gRPC read hunt).
MAX_TOP_LEVEL_FIELDS = 16384
# Below this size a request is parsed whole by protobuf (copies are cheaper than the scan).
ZERO_COPY_MIN_BYTES = 64 << 10
# The most elements a request's typed contents may hold, all inputs together (see _check_typed_size): 16 MiB
# of FP32 data, as much as server.http_max_json_bytes lets a JSON body carry by default.
MAX_TYPED_ELEMENTS = 1 << 22


def parse_infer_request(data: bytes, zero_copy_min_bytes: int = ZERO_COPY_MIN_BYTES,
                        ) -> tuple[pb.ModelInferRequest, list[bytes | memoryview]]:
    """Parse a serialized ModelInferRequest, keeping ``raw_input_contents`` as views of ``data``.

    protobuf copies every bytes field into its arena when parsing, and again into a
    new ``bytes`` object on each access, so a 1 GiB request cost 3 GiB more. Here
    only the small rest of the message is parsed; each raw input stays a zero-copy
    view of the received bytes. Small messages, where copies cost less than the
    scan (below ``zero_copy_min_bytes``), are parsed whole. Raises ValueError when
    ``data`` is not a valid message.
    """
    if len(data) < zero_copy_min_bytes:
        return _parse_whole(data)
    view = memoryview(data)
    raws: list[memoryview] = []
    rest: list[memoryview] = []
    position, end, fields = 0, len(data), 0
    while position < end:
        fields += 1
        if fields > MAX_TOP_LEVEL_FIELDS:
            raise ValueError(_too_many_fields())
        start = position
        key, position = _varint(data, position)
        wire = key & 7
        if wire == _LENGTH_DELIMITED and key >> 3 == _RAW_FIELD:
            length, position = _varint(data, position)
            value_start, position = position, position + length
            if position <= end:
                raws.append(view[value_start:position])
                continue
        elif wire == 3:
            # A group (no client sends one; protobuf keeps it as an unknown field): skipped to its end, its fields
            # counted. Handing the message to protobuf whole instead parsed any number of fields after it on the
            # event loop (the review hunt).
            position, fields = _skip_group(data, position, key >> 3, fields)
        else:
            after = _past_value(data, position, wire)
            if after is None:  # (an end-group without its start, or an invalid wire type: protobuf's own refusal)
                return _parse_whole(data)
            position = after
        if position > end:
            raise ValueError(f"field at byte {start} runs past the end of the message")
        rest.append(view[start:position])
    try:
        message = pb.ModelInferRequest.FromString(b"".join(rest))
    except DecodeError as err:
        raise ValueError(str(err) or "not a valid ModelInferRequest") from None
    return message, raws


def _parse_whole(data: bytes) -> tuple[pb.ModelInferRequest, list[bytes | memoryview]]:
    try:
        message = pb.ModelInferRequest.FromString(data)
    except DecodeError as err:
        raise ValueError(str(err) or "not a valid ModelInferRequest") from None
    fields = (len(message.inputs) + len(message.outputs) + len(message.raw_input_contents) + len(message.parameters)
              + 4)  # (as the scan counts them: its model, version, id and other scalars at most)
    if fields > MAX_TOP_LEVEL_FIELDS:  # (as the scan refuses it: whatever the request's size)
        raise ValueError(_too_many_fields())
    return message, list(message.raw_input_contents)


def _too_many_fields() -> str:
    return (f"it has more than {MAX_TOP_LEVEL_FIELDS} top-level fields (inputs, outputs, raw contents and "
            "parameters), more than a request to any model needs")


def _skip_group(data: bytes, position: int, number: int, fields: int) -> tuple[int, int]:
    """The position after the group of field ``number`` starting at ``position`` (nested groups within), and
    ``fields`` with the fields read in it; ValueError when it does not end, or holds too many fields."""
    depth = 1
    while position < len(data):
        fields += 1
        if fields > MAX_TOP_LEVEL_FIELDS:
            raise ValueError(_too_many_fields())
        key, position = _varint(data, position)
        wire = key & 7
        if wire == 3:
            depth += 1
        elif wire == 4:
            depth -= 1
            if depth == 0:
                if key >> 3 != number:
                    raise ValueError(f"a group of field {number} ends as field {key >> 3}")
                return position, fields
        else:
            after = _past_value(data, position, wire)
            if after is None:
                raise ValueError(f"invalid wire type {wire} in a group of field {number}")
            position = after
    raise ValueError(f"a group of field {number} runs past the end of the message")


def _past_value(data: bytes, position: int, wire: int) -> int | None:
    """The position after a field's value of wire type ``wire`` starting at ``position`` (a varint, 8 bytes, a
    length-delimited value or 4 bytes); None for a group's start or end or an invalid wire type."""
    if wire == 0:
        return _varint(data, position)[1]
    if wire == 1:
        return position + 8
    if wire == 5:
        return position + 4
    if wire == _LENGTH_DELIMITED:
        length, position = _varint(data, position)
        return position + length
    return None


def _varint(data: bytes, position: int) -> tuple[int, int]:
    """Decode a protobuf varint at ``position``; returns (value, next position)."""
    value = shift = 0
    for index in range(position, min(position + 10, len(data))):
        byte = data[index]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, index + 1
        shift += 7
    raise ValueError(f"bad varint at byte {position}")


def decode_infer_request(msg: pb.ModelInferRequest, time_remaining_s: float | None,
                         raws: list[bytes | memoryview] | None = None,
                         sampled_ns: int | None = None, declared: Mapping[str, DType] | None = None) -> InferRequest:
    """Decode a ModelInferRequest; ``time_remaining_s`` is the gRPC deadline's remaining budget at ``sampled_ns``
    (the monotonic instant it was read; None: as this call starts).

    ``declared``: the model's input datatypes by name (its signature's ``input_datatypes``; None: not checked
    here). A tensor of a declared input sent in another datatype is refused as the data plane refuses it, before
    any of its elements is read (splitting millions of BYTES elements only to refuse them took seconds and
    hundreds of MiB); everything else about the inputs is left to the data plane's validation.

    ``raws`` are the raw input contents when :func:`parse_infer_request` kept
    them out of ``msg`` (None: read them from ``msg``). The earlier of the gRPC
    deadline and the ``timeout`` parameter becomes an absolute monotonic
    deadline: the gRPC one where the client's is (counted from before the
    decode, which takes a large request hundreds of milliseconds, or it would
    fall that much after the client's own), the ``timeout`` from decode time.
    A refusal is an InvalidArgument whose message is a :class:`PublicText`.
    """
    if sampled_ns is None:
        sampled_ns = time.monotonic_ns()
    try:
        return _decode_infer_request(msg, time_remaining_s, raws, sampled_ns, declared)
    except InvalidArgument as err:
        # Every refusal of the decode is built from the request alone (its model, tensor and parameter
        # names, datatypes, shapes, values): it echoes them as sent. Scrubbing server paths out of it
        # rewrote a name such as "/opt/nereid/core/x" into "<nereid>/x", telling the client which
        # absolute paths are the server's.
        PublicText.mark(err)
        raise


def _decode_infer_request(msg: pb.ModelInferRequest, time_remaining_s: float | None,
                          raws: list[bytes | memoryview] | None, sampled_ns: int,
                          declared: Mapping[str, DType] | None) -> InferRequest:
    model = msg.model_name
    tensors = msg.inputs
    if raws is None:
        raws = list(msg.raw_input_contents)
    if declared is not None and len(tensors) > len(declared):
        # Refused before any tensor is built, as the data plane would refuse it (an input given twice, or one the
        # model does not declare): thousands of tiny inputs cost a NamedTensor each first (the gRPC read hunt).
        check_input_names(model, [tensor.name for tensor in tensors], list(declared))
    if raws and len(raws) != len(tensors):
        # tritonclient sends no raw contents for an input in a shared-memory region: a mix of the two came here
        # first, and the client was told to fix its raw contents (the protocol-parity hunt).
        for tensor in tensors:
            if SHARED_MEMORY_PARAMETER in tensor.parameters:
                raise refuse_shared_memory(f"model '{model}': input '{tensor.name}'")
        raise InvalidArgument(
            f"model '{model}': {len(raws)} raw_input_contents for {len(tensors)} "
            "inputs; send raw contents for every input or for none")
    if raws:
        inputs = [_decode_tensor(model, tensor, raw, declared or {}) for tensor, raw in zip(tensors, raws)]
    else:
        _check_typed_size(model, tensors)
        inputs = [_decode_tensor(model, tensor, None, declared or {}) for tensor in tensors]
    deadlines: list[int] = []
    if time_remaining_s is not None:
        deadlines.append(sampled_ns + int(time_remaining_s * 1e9))
    if TIMEOUT_PARAMETER in msg.parameters:
        timeout_us = _timeout_us(model, msg.parameters[TIMEOUT_PARAMETER])
        if timeout_us > 0:
            deadlines.append(time.monotonic_ns() + timeout_us * 1000)
    deadline = min(deadlines, default=0)
    if SEQUENCE_ID_PARAMETER in msg.parameters:
        _check_sequence_id(model, msg.parameters[SEQUENCE_ID_PARAMETER])
    scheduling = {key: _value(msg.parameters[key]) for key in SCHEDULING_PARAMETERS if key in msg.parameters}
    if scheduling:
        check_scheduling_parameters(model, scheduling)
    classifications = {}
    for out in msg.outputs:
        if SHARED_MEMORY_PARAMETER in out.parameters:
            raise refuse_shared_memory(f"model '{model}': output '{out.name[:256]}'")
        if CLASSIFICATION_PARAMETER in out.parameters:
            count = _class_count(model, out.name, out.parameters[CLASSIFICATION_PARAMETER])
            if count:
                classifications[out.name] = count
    return InferRequest(
        model_name=model,
        inputs=inputs,
        id=msg.id,
        requested_outputs=[out.name for out in msg.outputs],
        deadline_ns=deadline,
        classifications=classifications,
    )


def _value(parameter: pb.InferParameter) -> object:
    """A parameter's value, whichever field holds it (None: none does)."""
    kind = parameter.WhichOneof("parameter_choice")
    return getattr(parameter, kind) if kind else None


def _shown(parameter: pb.InferParameter) -> str:
    """A parameter a refusal names, by its field and its value (``string_param '3'``): the field alone did not say
    what was sent (the error hunt), and "got 'a string_param'" read as though the client had sent that text."""
    kind = parameter.WhichOneof("parameter_choice")
    return f"{kind} {brief_repr(getattr(parameter, kind), 64)}" if kind else "no value"


def _check_sequence_id(model: str, parameter: pb.InferParameter) -> None:
    """InvalidArgument unless the ``sequence_id`` parameter is a correlation ID in the fields Triton's gRPC endpoint
    reads it from (int64_param or string_param; it refuses a uint64_param). A valid one is ignored, as Triton
    ignores it for a model without sequence batching (see :func:`~nereid.protocol.wire.check_sequence_id`)."""
    if parameter.WhichOneof("parameter_choice") not in ("int64_param", "string_param"):
        raise InvalidArgument(f"model '{model}': parameter 'sequence_id' must be a correlation ID in an int64_param "
                              f"or a string_param, got {_shown(parameter)}")


def _class_count(model: str, output: str, parameter: pb.InferParameter) -> int:
    """An output's ``classification`` parameter; tritonclient sends it as int64."""
    where = f"model '{model}': output '{output[:256]}'"
    kind = parameter.WhichOneof("parameter_choice")
    if kind not in ("int64_param", "uint64_param"):
        raise InvalidArgument(f"{where}: parameter 'classification' must be a non-negative integer count of classes "
                              f"(int64_param or uint64_param), got {_shown(parameter)}")
    return class_count(where, getattr(parameter, kind), lambda value: f"{kind} {value}")  # (as above)


def _timeout_us(model: str, parameter: pb.InferParameter) -> int:
    """The ``timeout`` parameter in microseconds (0: none); Triton clients send it as int64 or uint64."""
    kind = parameter.WhichOneof("parameter_choice")
    if kind not in ("int64_param", "uint64_param"):
        raise InvalidArgument(f"model '{model}': parameter 'timeout' must be a non-negative integer number of "
                              f"microseconds (int64_param or uint64_param), got {_shown(parameter)}")
    timeout_us = getattr(parameter, kind)
    if timeout_us < 0:  # (worded as HTTP words it)
        raise InvalidArgument(f"model '{model}': parameter 'timeout' must be a non-negative integer number of "
                              f"microseconds, got {timeout_us}")
    return timeout_us


def _decode_tensor(model: str, tensor: pb.ModelInferRequest.InferInputTensor,
                   raw: bytes | memoryview | None, declared: Mapping[str, DType]) -> NamedTensor:
    where = f"model '{model}': input '{tensor.name}'"
    if SHARED_MEMORY_PARAMETER in tensor.parameters:
        raise refuse_shared_memory(where)
    dtype = wire_dtype(where, tensor.datatype)
    shape = tuple(tensor.shape)
    count = wire_shape(where, shape)
    if tensor.name in declared:  # (an undeclared name: the data plane's validation names it unexpected)
        check_datatype(model, tensor.name, dtype, declared[tensor.name])
    if raw is not None:
        if tensor.HasField("contents") and tensor.contents.ListFields():
            raise InvalidArgument(f"{where}: data sent both in contents and in raw_input_contents; "
                                  "send it in one of them")
        data = decode_raw(where, dtype, shape, raw)
    else:
        data = _decode_contents(where, dtype, shape, count, tensor.contents)
    return NamedTensor(tensor.name, dtype, data)


def _check_typed_size(model: str, tensors: Iterable[pb.ModelInferRequest.InferInputTensor]) -> None:
    """InvalidArgument for a request whose typed ``contents`` hold more than MAX_TYPED_ELEMENTS elements in all.

    Each element becomes a Python object while the decode holds the GIL: 32 million empty BYTES elements (61 MiB
    on the wire, within max_message_bytes) held the event loop 3 s and grew the server by 1.6 GiB, where the same
    tensor sent raw costs a copy (the complexity hunt). Counted from the fields' lengths, before any is read.
    """
    count = sum(len(values) for tensor in tensors for _, values in tensor.contents.ListFields())
    if count > MAX_TYPED_ELEMENTS:
        raise InvalidArgument(f"model '{model}': the request's typed contents hold {count} elements, more than the "
                              f"{MAX_TYPED_ELEMENTS} nereid decodes from them (each is a Python object); send large "
                              "tensors in raw_input_contents, as tritonclient does")


def _decode_contents(where: str, dtype: DType, shape: tuple[int, ...], count: int,
                     contents: pb.InferTensorContents) -> np.ndarray:
    field = dtype.contents_field
    if field is None and count == 0 and not contents.ListFields():
        # An empty FP16 / BF16 tensor carries no data: nothing to send in a field it has none of (every typed
        # request to a model with such an input was refused for it; the gRPC read hunt).
        return np.empty(shape, dtype.numpy)
    if field is None:
        raise InvalidArgument(f"{where}: {dtype.kserve} data must be sent in raw_input_contents "
                              "(the typed contents message has no field for it)")
    values = getattr(contents, field)
    others = [other.name for other, _ in contents.ListFields() if other.name != field]
    if len(values) != count:
        # Another typed field filled instead (fp32_contents for an INT32 input) is named as such: "holds 0
        # elements" alone sent the client counting its data.
        filled = f"; the request filled contents.{others[0]} instead" if others and not values else ""
        raise InvalidArgument(f"{where}: contents.{field} holds {len(values)} elements, expected {count} for shape "
                              f"{list(shape)} ({dtype.kserve} data goes in contents.{field}{filled})")
    if others:  # their values would be dropped without a word: refused, as Triton refuses them
        raise InvalidArgument(f"{where}: {dtype.kserve} data goes in contents.{field}, and the request filled "
                              f"{', '.join('contents.' + other for other in others)} too; send it in one field")
    if dtype is DType.BYTES:
        return bytes_array(list(values), shape)
    # Read in the field's own width first: numpy's cast to a narrower type would silently wrap
    # (int_contents 200 as INT8 becoming -56), so the range is checked before narrowing.
    source = np.array(values)
    if dtype.numpy.kind in "iu" and source.size:
        info = np.iinfo(dtype.numpy)
        outside = (source < info.min) | (source > info.max)
        if outside.any():
            bad = source[outside][0]
            raise InvalidArgument(f"{where}: contents.{field} value {bad} does not fit {dtype.kserve} "
                                  f"(range {info.min} to {info.max})")
    return source.astype(dtype.numpy).reshape(shape)


def serialize_infer_response(response: InferResponse, *, streamed: bool = False) -> bytes:
    """The wire bytes of a ModelInferResponse (``streamed``: of a ModelStreamInferResponse holding it).

    Equal to serializing :func:`encode_infer_response`, with one copy of the
    output data instead of three: protobuf would copy each output into its
    arena, then into the serialized message, before gRPC copies it once more.
    Here the small rest of the message is serialized by protobuf and the raw
    outputs are appended as ``raw_output_contents`` fields, joined once.
    """
    head = pb.ModelInferResponse(model_name=response.model_name, model_version=MODEL_VERSION, id=response.id)
    if streamed:
        mark_final(head)
    buffers = []
    for tensor in response.outputs:
        head.outputs.add(name=tensor.name, datatype=tensor.dtype.kserve, shape=tensor.shape)
        buffers.append(tensor_buffer(tensor))
    parts: list[bytes | memoryview] = [head.SerializeToString()]
    for buffer in buffers:
        parts.append(_RAW_OUTPUT_KEY + _encode_varint(len(buffer)))
        parts.append(buffer)
    if streamed:
        size = sum(len(part) for part in parts)
        parts.insert(0, _STREAM_RESPONSE_KEY + _encode_varint(size))
    return b"".join(parts)


def mark_final(response: pb.ModelInferResponse) -> pb.ModelInferResponse:
    """Set Triton's ``triton_final_response`` parameter on a streamed answer (its errors' stubs included).

    Triton sets it on every ModelStreamInfer answer: true on a request's last
    one, which for a model that answers once is its only one. Stream readers
    written for Triton loop until they see it.
    """
    response.parameters["triton_final_response"].bool_param = True
    return response


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


# ModelInferResponse.raw_output_contents (field 6) and ModelStreamInferResponse.infer_response
# (field 2), both length-delimited.
_RAW_OUTPUT_KEY = bytes([6 << 3 | _LENGTH_DELIMITED])
_STREAM_RESPONSE_KEY = bytes([2 << 3 | _LENGTH_DELIMITED])


def encode_infer_response(response: InferResponse) -> pb.ModelInferResponse:
    """A ModelInferResponse with every output in ``raw_output_contents``."""
    msg = pb.ModelInferResponse(model_name=response.model_name, model_version=MODEL_VERSION, id=response.id)
    for tensor in response.outputs:
        msg.outputs.add(name=tensor.name, datatype=tensor.dtype.kserve, shape=tensor.shape)
        msg.raw_output_contents.append(tensor_bytes(tensor))
    return msg
