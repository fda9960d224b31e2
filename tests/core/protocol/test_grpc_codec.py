"""ModelInfer messages end to end: datatypes, typed and raw contents, outputs, validation errors.

The tests share one real server (see the ``server`` fixture) and talk to it
over gRPC: with tritonclient where it can build the request, and with the raw
KServe V2 stub where the request has to be shaped by hand (typed ``contents``,
malformed raw bytes).
"""

from __future__ import annotations

import re
import struct
from contextlib import contextmanager
from typing import Iterator

import grpc
import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from nereid.dtypes import DType
from nereid.errors import InvalidArgument
from nereid.protocol.grpc_codec import decode_infer_request

from support import (ECHO_MAIN, FRAMED_ECHO_MAIN, ModelRepo, RunningServer, expect_grpc_error, private_names,
                     textproto_single)

# --------------------------------------------------------------------------- helpers

# One value set per datatype, chosen to hit the edges of each type (shape [2, 4]).
ROUND_TRIP_VALUES: dict[str, np.ndarray] = {
    "BOOL": np.array([[True, False, True, True], [False, False, True, False]], dtype=np.bool_),
    "UINT8": np.array([[0, 1, 127, 128], [200, 253, 254, 255]], dtype=np.uint8),
    "UINT16": np.array([[0, 1, 255, 256], [32768, 40000, 65534, 65535]], dtype=np.uint16),
    "UINT32": np.array([[0, 1, 65536, 2**31], [2**31 + 1, 3_000_000_000, 2**32 - 2, 2**32 - 1]], dtype=np.uint32),
    "UINT64": np.array([[0, 1, 2**32, 2**53 + 1], [2**63, 2**63 + 1, 2**64 - 2, 2**64 - 1]], dtype=np.uint64),
    "INT8": np.array([[-128, -127, -1, 0], [1, 64, 126, 127]], dtype=np.int8),
    "INT16": np.array([[-32768, -32767, -1, 0], [1, 255, 32766, 32767]], dtype=np.int16),
    "INT32": np.array([[-2**31, -2**31 + 1, -1, 0], [1, 2**24 + 1, 2**31 - 2, 2**31 - 1]], dtype=np.int32),
    "INT64": np.array([[-2**63, -2**63 + 1, -1, 0], [1, 2**53 + 1, 2**63 - 2, 2**63 - 1]], dtype=np.int64),
    "FP16": np.array([[-65504.0, -0.0, 0.0, 2**-24], [6.1035e-05, 0.333, np.inf, np.nan]], dtype=np.float16),
    "FP32": np.array([[-3.4028235e38, -0.0, 1e-45, 1.17549435e-38],
                      [0.1, 16777217.0, -np.inf, np.nan]], dtype=np.float32),
    "FP64": np.array([[-1.7976931348623157e308, -0.0, 5e-324, 2.2250738585072014e-308],
                      [0.1, 2.0**53 + 2, np.inf, np.nan]], dtype=np.float64),
    # BF16 values exactly representable in bfloat16 (tritonclient sends float32 and keeps the top 16 bits).
    "BF16": np.array([[1.0, -2.5, 0.15625, -0.0], [3.3895314e38, 9.18355e-41, -np.inf, 65280.0]],
                     dtype=np.float32).astype(ml_dtypes.bfloat16),
    "BYTES": np.array([[b"", b"a", b"\x00\x01\xff", "üñï©ødé".encode()],
                       [b"x" * 300, b"\n", b"two words", b"\x00"]], dtype=np.object_),
}

# The InferTensorContents field each datatype travels in when sent typed.
CONTENTS_FIELD = {
    "BOOL": "bool_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}

PAIR_TEXTPROTO = '''
input  { name: "a" data_type: "INT32" dims: [2] }
input  { name: "b" data_type: "FP32" dims: [3] }
output { name: "x" data_type: "INT32" dims: [2] }
output { name: "y" data_type: "FP32" dims: [3] }
max_batch_size: 4
'''

# Echoes its input like ECHO_MAIN, and records the shape it was given in seen_shape.txt.
SHAPE_RECORDING_MAIN = ECHO_MAIN + '''
with open("seen_shape.txt", "w") as seen:
    seen.write(os.environ["NEREID_INPUT_SHAPE"])
'''


def serialize_bytes(elements) -> bytes:
    """KServe's BYTES serialization: a 4-byte little-endian length before each element."""
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


def wire_bytes(dtype: str, array: np.ndarray) -> bytes:
    """The exact raw bytes of ``array`` as a KServe ``dtype`` tensor."""
    if dtype == "BYTES":
        return serialize_bytes(array.reshape(-1))
    return np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tobytes()


@contextmanager
def raw_stub(server) -> Iterator[service_pb2_grpc.GRPCInferenceServiceStub]:
    """The generated KServe V2 stub on a plain channel to ``server``."""
    with grpc.insecure_channel(server.url) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def raw_infer(server, request: service_pb2.ModelInferRequest) -> service_pb2.ModelInferResponse:
    """ModelInfer over the raw stub; an RPC error is raised as tritonclient's InferenceServerException."""
    with raw_stub(server) as stub:
        try:
            return stub.ModelInfer(request, timeout=30)
        except grpc.RpcError as err:
            raise InferenceServerException(msg=err.details(), status=str(err.code())) from None


def raw_request(model: str, *tensors: tuple[str, str, list[int], bytes | None],
                **fields) -> service_pb2.ModelInferRequest:
    """A ModelInferRequest with inputs (name, datatype, shape, raw bytes or None for no raw contents)."""
    request = service_pb2.ModelInferRequest(model_name=model, **fields)
    for name, datatype, shape, raw in tensors:
        request.inputs.add(name=name, datatype=datatype, shape=shape)
        if raw is not None:
            request.raw_input_contents.append(raw)
    return request


def triton_input(name: str, array: np.ndarray, datatype: str) -> triton.InferInput:
    tensor = triton.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def models_of(repo: ModelRepo) -> None:
    """Every model the tests of this module use, each test on its own model(s)."""
    for dtype in ROUND_TRIP_VALUES:
        repo.python(f"echo_{dtype}", textproto=textproto_single(dtype, "[4]"))
    repo.python("pair", main=FRAMED_ECHO_MAIN, textproto=PAIR_TEXTPROTO)
    repo.python("bytes2", textproto=textproto_single("BYTES", "[2]"))
    repo.python("bf16_3", textproto=textproto_single("BF16", "[3]"))
    repo.python("big", textproto=textproto_single("FP32", "[-1]", max_batch_size=0))
    repo.python("var", textproto=textproto_single("FP64", "[-1, 3]", max_batch_size=4))
    repo.python("unbatched", main=SHAPE_RECORDING_MAIN, textproto=textproto_single("INT8", max_batch_size=0))
    for name in ("expand", "batched"):
        repo.python(name, main=SHAPE_RECORDING_MAIN, textproto=textproto_single("INT16"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for the whole module (starting one per test would dominate the run time).

    Built exactly as the ``repo`` and ``serve`` fixtures build theirs. Tests that
    look at what a model saw (seen_shape.txt) have a model of their own; the
    others only ever get echoes or errors, which leave nothing behind.
    """
    repo = ModelRepo(tmp_path_factory.mktemp("codec"))
    models_of(repo)
    running = RunningServer(repo.write_config())
    running.repo = repo
    yield running
    running.stop()


def pair_inputs(batch: int = 2) -> tuple[np.ndarray, np.ndarray]:
    a = np.arange(batch * 2, dtype=np.int32).reshape(batch, 2) - 3
    b = np.linspace(-1.5, 2.5, batch * 3, dtype=np.float32).reshape(batch, 3)
    return a, b


# --------------------------------------------------------------------------- datatypes


@pytest.mark.parametrize("dtype", sorted(ROUND_TRIP_VALUES))
def test_every_datatype_round_trips_exactly_through_raw_contents(server, dtype):
    values = ROUND_TRIP_VALUES[dtype]
    # tritonclient takes BF16 as float32 and sends the top 16 bits of each value.
    sent = values.astype(np.float32) if dtype == "BF16" else values

    result = server.client.infer(f"echo_{dtype}", [triton_input("input", sent, dtype)], request_id=f"rt-{dtype}")

    response = result.get_response()
    assert response.id == f"rt-{dtype}"
    assert (response.model_name, response.model_version) == (f"echo_{dtype}", "1")
    assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [("output", dtype, [2, 4])]
    # Outputs always travel as raw_output_contents, never typed contents.
    assert len(response.raw_output_contents) == 1
    assert not response.outputs[0].HasField("contents")
    assert response.raw_output_contents[0] == wire_bytes(dtype, values)
    returned = result.as_numpy("output")
    if dtype == "BYTES":
        assert returned.tolist() == values.tolist()
    else:
        assert returned.dtype == sent.dtype
        assert returned.tobytes() == sent.tobytes()  # bitwise: NaN, -0.0 and denormals included


@pytest.mark.parametrize("dtype", sorted(CONTENTS_FIELD))
def test_every_typed_datatype_round_trips_exactly_through_typed_contents(server, dtype):
    values = ROUND_TRIP_VALUES[dtype]
    request = service_pb2.ModelInferRequest(model_name=f"echo_{dtype}", id=f"typed-{dtype}")
    tensor = request.inputs.add(name="input", datatype=dtype, shape=list(values.shape))
    getattr(tensor.contents, CONTENTS_FIELD[dtype]).extend(values.reshape(-1).tolist())

    response = raw_infer(server, request)

    assert response.id == f"typed-{dtype}"
    assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [("output", dtype, [2, 4])]
    assert not response.outputs[0].HasField("contents")
    assert list(response.raw_output_contents) == [wire_bytes(dtype, values)]


def test_bf16_raw_bytes_round_trip_bit_for_bit(server):
    # NaN payloads and denormals that tritonclient's float32 path cannot express, sent as raw bytes.
    bits = np.array([0x7FC1, 0xFF81, 0x0001, 0x8000, 0x7F7F, 0x3F80], dtype="<u2")
    raw = bits.tobytes()

    response = raw_infer(server, raw_request("bf16_3", ("input", "BF16", [2, 3], raw)))

    assert [(o.datatype, list(o.shape)) for o in response.outputs] == [("BF16", [2, 3])]
    assert response.raw_output_contents[0] == raw
    assert np.frombuffer(response.raw_output_contents[0], ml_dtypes.bfloat16).view("<u2").tolist() == bits.tolist()


@pytest.mark.parametrize("dtype", ["FP16", "BF16"])
def test_half_precision_in_typed_contents_is_invalid_argument(server, dtype):
    request = service_pb2.ModelInferRequest(model_name=f"echo_{dtype}")
    request.inputs.add(name="input", datatype=dtype, shape=[4]).contents.fp32_contents.extend([1.0, 2.0, 3.0, 4.0])

    expect_grpc_error("INVALID_ARGUMENT", lambda: raw_infer(server, request),
                 f"model 'echo_{dtype}'", "input 'input'", dtype, "raw_input_contents")


@pytest.mark.parametrize(("dtype", "field", "value"), [
    ("INT8", "int_contents", 200), ("UINT8", "uint_contents", 256), ("INT16", "int_contents", -40000)])
def test_typed_contents_out_of_the_datatype_range_are_invalid_argument(server, dtype, field, value):
    request = service_pb2.ModelInferRequest(model_name=f"echo_{dtype}")
    getattr(request.inputs.add(name="input", datatype=dtype, shape=[4]).contents, field).extend([1, 2, 3, value])

    expect_grpc_error("INVALID_ARGUMENT", lambda: raw_infer(server, request),
                 f"model 'echo_{dtype}'", "input 'input'", f"contents.{field}", dtype, str(value))


def test_typed_contents_in_the_wrong_field_or_count_are_invalid_argument(server):
    wrong_field = service_pb2.ModelInferRequest(model_name="echo_INT32")
    wrong_field.inputs.add(name="input", datatype="INT32", shape=[4]).contents.fp32_contents.extend([1, 2, 3, 4])
    short = service_pb2.ModelInferRequest(model_name="echo_INT32")
    short.inputs.add(name="input", datatype="INT32", shape=[2, 4]).contents.int_contents.extend(range(7))

    expect_grpc_error("INVALID_ARGUMENT", lambda: raw_infer(server, wrong_field),
                 "model 'echo_INT32'", "input 'input'",
                 "contents.int_contents holds 0 elements, expected 4 for shape [4] (INT32 data goes in "
                 "contents.int_contents; the request filled contents.fp32_contents instead)")
    expect_grpc_error("INVALID_ARGUMENT", lambda: raw_infer(server, short),
                 "model 'echo_INT32'", "input 'input'", "holds 7 elements, expected 8", "[2, 4]")


def test_typed_contents_alongside_raw_contents_are_invalid_argument(server):
    request = raw_request("echo_INT8", ("input", "INT8", [4], bytes([1, 2, 3, 4])))
    request.inputs[0].contents.int_contents.extend([5, 6, 7, 8])

    expect_grpc_error("INVALID_ARGUMENT", lambda: raw_infer(server, request),
                 "model 'echo_INT8'", "input 'input'", "contents", "raw_input_contents")


def test_typed_contents_in_two_fields_are_invalid_argument():
    """int_contents beside the fp32_contents an FP32 input reads were dropped without a word (Triton refuses)."""
    request = service_pb2.ModelInferRequest(model_name="m")
    contents = request.inputs.add(name="x", datatype="FP32", shape=[2]).contents
    contents.fp32_contents.extend([1, 2])
    contents.int_contents.extend([7, 7, 7])
    with pytest.raises(InvalidArgument) as refused:
        decode_infer_request(request, None)
    assert str(refused.value) == ("model 'm': input 'x': FP32 data goes in contents.fp32_contents, and the request "
                                  "filled contents.int_contents too; send it in one field")


def test_a_sequence_id_in_the_fields_triton_reads_is_ignored_and_any_other_refused():
    """nereid refused every sequence_id but 0 and "", saying Triton does; Triton 2.41 runs the request (a model
    without sequence batching ignores its correlation ID), so a client tagging requests with one failed here
    only (the Triton client hunt). Triton refuses one outside int64_param and string_param, uint64_param too."""
    request = raw_request("m", ("x", "INT8", [4], bytes(4)))
    for kept in (service_pb2.InferParameter(int64_param=7), service_pb2.InferParameter(int64_param=-7),
                 service_pb2.InferParameter(string_param="user-1"), service_pb2.InferParameter(int64_param=0)):
        request.parameters["sequence_id"].CopyFrom(kept)
        assert decode_infer_request(request, None).model_name == "m"
    for refused, shown in ((service_pb2.InferParameter(uint64_param=7), "uint64_param 7"),
                           (service_pb2.InferParameter(bool_param=True), "bool_param True"),
                           (service_pb2.InferParameter(), "no value")):
        request.parameters["sequence_id"].CopyFrom(refused)
        with pytest.raises(InvalidArgument) as error:
            decode_infer_request(request, None)
        assert str(error.value) == ("model 'm': parameter 'sequence_id' must be a correlation ID in an int64_param "
                                    f"or a string_param, got {shown}")


@pytest.mark.parametrize(("key", "parameter", "problem"), [
    ("priority", service_pb2.InferParameter(string_param="high"), "parameter 'priority' must be an integer >= 0, "
                                                                   "got 'high'"),
    ("priority", service_pb2.InferParameter(int64_param=-1), "parameter 'priority' must be an integer >= 0, got -1"),
    ("sequence_start", service_pb2.InferParameter(int64_param=1), "parameter 'sequence_start' must be true or "
                                                                   "false, got 1"),
    ("sequence_end", service_pb2.InferParameter(string_param="yes"), "parameter 'sequence_end' must be true or "
                                                                      "false, got 'yes'"),
])
def test_scheduling_parameters_of_the_wrong_type_are_refused_as_triton_refuses_them(key, parameter, problem):
    """Found by a bug hunt: accepted and ignored, where Triton answers INVALID_ARGUMENT."""
    request = raw_request("m", ("x", "INT8", [4], bytes(4)))
    request.parameters[key].CopyFrom(parameter)
    with pytest.raises(InvalidArgument, match=f"^model 'm': {re.escape(problem)}$"):
        decode_infer_request(request, None)
    for key, good in (("priority", service_pb2.InferParameter(uint64_param=3)),
                      ("sequence_start", service_pb2.InferParameter(bool_param=False))):
        request = raw_request("m", ("x", "INT8", [4], bytes(4)))
        request.parameters[key].CopyFrom(good)
        assert decode_infer_request(request, None).model_name == "m"


def test_large_tensor_over_the_default_grpc_message_limit_round_trips(server):
    values = np.random.default_rng(7).standard_normal(3_000_000).astype(np.float32)  # 12 MB

    result = server.client.infer("big", [triton_input("input", values, "FP32")], client_timeout=60)

    assert result.as_numpy("output").tobytes() == values.tobytes()


# --------------------------------------------------------------------------- response, id, outputs


def test_request_id_and_model_are_echoed_and_outputs_are_raw(server):
    a, b = pair_inputs()

    result = server.client.infer("pair", [triton_input("a", a, "INT32"), triton_input("b", b, "FP32")],
                                 request_id="request-7f3a")

    response = result.get_response()
    assert (response.id, response.model_name, response.model_version) == ("request-7f3a", "pair", "1")
    assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [
        ("x", "INT32", [2, 2]), ("y", "FP32", [2, 3])]
    assert list(response.raw_output_contents) == [a.tobytes(), b.tobytes()]
    assert all(not o.HasField("contents") for o in response.outputs)


def test_requested_outputs_select_the_returned_outputs(server):
    a, b = pair_inputs()
    inputs = [triton_input("a", a, "INT32"), triton_input("b", b, "FP32")]

    only_y = server.client.infer("pair", inputs, outputs=[triton.InferRequestedOutput("y")])
    only_x = server.client.infer("pair", inputs, outputs=[triton.InferRequestedOutput("x")])

    assert [o.name for o in only_y.get_response().outputs] == ["y"]
    assert only_y.as_numpy("x") is None
    np.testing.assert_array_equal(only_y.as_numpy("y"), b)
    assert [o.name for o in only_x.get_response().outputs] == ["x"]
    assert list(only_x.get_response().raw_output_contents) == [a.tobytes()]


def test_unknown_requested_output_is_invalid_argument(server):
    a, b = pair_inputs()

    expect_grpc_error("INVALID_ARGUMENT",
                 lambda: server.client.infer("pair", [triton_input("a", a, "INT32"), triton_input("b", b, "FP32")],
                                             outputs=[triton.InferRequestedOutput("z")]),
                 "model 'pair'", "output 'z'", "'x'", "'y'")


# --------------------------------------------------------------------------- shapes and batching


def test_request_without_batch_axis_is_expanded_to_batch_one_and_answered_without_it(server):
    values = np.array([7, -8, 9, -10], dtype=np.int16)

    result = server.client.infer("expand", [triton_input("input", values, "INT16")])

    assert (server.repo.models_dir / "expand" / "seen_shape.txt").read_text() == "1,4"  # the model saw batch 1
    assert list(result.get_response().outputs[0].shape) == [4]  # the client gets no batch axis back
    np.testing.assert_array_equal(result.as_numpy("output"), values)


def test_batched_request_keeps_its_batch_axis(server):
    values = np.arange(32, dtype=np.int16).reshape(8, 4)  # exactly max_batch_size

    result = server.client.infer("batched", [triton_input("input", values, "INT16")])

    assert (server.repo.models_dir / "batched" / "seen_shape.txt").read_text() == "8,4"
    np.testing.assert_array_equal(result.as_numpy("output"), values)


def test_multi_tensor_request_without_batch_axis_is_answered_without_it(server):
    a, b = pair_inputs(batch=1)

    result = server.client.infer("pair", [triton_input("a", a[0], "INT32"), triton_input("b", b[0], "FP32")])

    assert [list(o.shape) for o in result.get_response().outputs] == [[2], [3]]
    np.testing.assert_array_equal(result.as_numpy("x"), a[0])
    np.testing.assert_array_equal(result.as_numpy("y"), b[0])


def test_model_without_batching_must_match_the_rank_exactly(server):
    values = np.array([1, 2, 3, 4], dtype=np.int8)

    result = server.client.infer("unbatched", [triton_input("input", values, "INT8")])
    assert (server.repo.models_dir / "unbatched" / "seen_shape.txt").read_text() == "4"
    assert list(result.get_response().outputs[0].shape) == [4]
    np.testing.assert_array_equal(result.as_numpy("output"), values)

    expect_grpc_error("INVALID_ARGUMENT",
                 lambda: server.client.infer("unbatched", [triton_input("input", values[None], "INT8")]),
                 "model 'unbatched'", "input 'input'", "[1, 4]", "expected [4]")


def test_variable_dims_accept_any_size(server):
    for shape in [(2, 5, 3), (4, 1, 3), (7, 3), (1, 3)]:
        values = np.arange(np.prod(shape), dtype=np.float64).reshape(shape) / 3
        result = server.client.infer("var", [triton_input("input", values, "FP64")])
        assert list(result.get_response().outputs[0].shape) == list(shape)
        assert result.as_numpy("output").tobytes() == values.tobytes()

    bad = np.zeros((2, 5, 4), dtype=np.float64)
    expect_grpc_error("INVALID_ARGUMENT", lambda: server.client.infer("var", [triton_input("input", bad, "FP64")]),
                 "model 'var'", "input 'input'", "[2, 5, 4]", "[batch, -1, 3]", "[-1, 3]")


# --------------------------------------------------------------------------- validation errors


def test_wrong_rank_is_invalid_argument(server):
    values = np.zeros((2, 2, 4), dtype=np.int8)

    expect_grpc_error("INVALID_ARGUMENT", lambda: server.client.infer("echo_INT8", [triton_input("input", values, "INT8")]),
                 "model 'echo_INT8'", "input 'input'", "has shape [2, 2, 4]", "expected [batch, 4] or [4]")


def test_wrong_fixed_dimension_is_invalid_argument(server):
    values = np.zeros((2, 5), dtype=np.int8)

    expect_grpc_error("INVALID_ARGUMENT", lambda: server.client.infer("echo_INT8", [triton_input("input", values, "INT8")]),
                 "model 'echo_INT8'", "input 'input'", "has shape [2, 5]", "expected [batch, 4] or [4]")


def test_batch_over_max_batch_size_is_invalid_argument(server):
    values = np.zeros((9, 4), dtype=np.int8)

    expect_grpc_error("INVALID_ARGUMENT", lambda: server.client.infer("echo_INT8", [triton_input("input", values, "INT8")]),
                 "model 'echo_INT8'", "input 'input'", "batch size 9", "max_batch_size 8")


def test_datatype_mismatch_is_invalid_argument(server):
    values = np.zeros(4, dtype=np.int16)

    expect_grpc_error("INVALID_ARGUMENT", lambda: server.client.infer("echo_INT8", [triton_input("input", values, "INT16")]),
                 "model 'echo_INT8'", "input 'input'", "datatype INT16", "expected INT8")


def test_raw_byte_size_not_matching_the_shape_is_invalid_argument(server):
    tensor = triton_input("input", np.zeros((2, 4), dtype=np.float32), "FP32")
    tensor.set_shape([3, 4])  # 32 bytes of data declared as 48

    expect_grpc_error("INVALID_ARGUMENT", lambda: server.client.infer("echo_FP32", [tensor]),
                 "model 'echo_FP32'", "input 'input'", "32 bytes", "expected 48", "FP32 [3, 4]")


def test_missing_input_is_invalid_argument(server):
    a, _ = pair_inputs()

    expect_grpc_error("INVALID_ARGUMENT", lambda: server.client.infer("pair", [triton_input("a", a, "INT32")]),
                 "model 'pair'", "missing input 'b'", "expected inputs: 'a', 'b'")


def test_unexpected_input_is_invalid_argument(server):
    a, b = pair_inputs()
    inputs = [triton_input("a", a, "INT32"), triton_input("b", b, "FP32"), triton_input("c", a, "INT32")]

    expect_grpc_error("INVALID_ARGUMENT", lambda: server.client.infer("pair", inputs),
                 "model 'pair'", "unexpected input 'c'", "expected inputs: 'a', 'b'")


def test_inputs_disagreeing_on_batch_size_are_invalid_argument(server):
    a, _ = pair_inputs(batch=2)
    _, b = pair_inputs(batch=3)

    expect_grpc_error("INVALID_ARGUMENT",
                 lambda: server.client.infer("pair", [triton_input("a", a, "INT32"), triton_input("b", b, "FP32")]),
                 "model 'pair'", "batch size", "'a': 2", "'b': 3")


def test_unknown_datatype_string_is_invalid_argument(server):
    message = expect_grpc_error("INVALID_ARGUMENT",
                           lambda: raw_infer(server, raw_request("echo_INT8", ("input", "FP8", [4], b"\0" * 4))),
                           "model 'echo_INT8'", "input 'input'", "'FP8'")
    assert "INT8" in message and "BYTES" in message  # the valid datatypes are listed


@pytest.mark.parametrize(("model", "shape", "problem"), [
    ("echo_INT8", [-1, 4], "shape [-1, 4] has a negative dimension"),
    ("echo_INT8", [0, 4], "has batch size 0, expected 1 to max_batch_size 8"),
    ("echo_INT8", [1, 0], "has shape [1, 0], expected [batch, 4] or [4]"),  # a zero where the model fixes 4
    ("echo_INT8", [2**62, 2**62, 0], "shape [4611686018427387904, 4611686018427387904, 0] is too large"),
])
def test_negative_zero_batch_and_unrepresentable_dimensions_are_invalid_argument(server, model, shape, problem):
    expect_grpc_error("INVALID_ARGUMENT",
                 lambda: raw_infer(server, raw_request(model, ("input", "INT8", shape, b""))),
                 f"model '{model}'", "input 'input'", problem)


def test_a_zero_size_dimension_where_the_model_takes_any_size_is_an_empty_tensor(server):
    """Refused before ("dimensions must be positive"), though the model's -1 takes any size, as Triton's
    does: a client could receive empty tensors but not send one."""
    for model, shape in (("big", [0]), ("var", [2, 0, 3]), ("var", [0, 3])):
        response = raw_infer(server, raw_request(model, ("input", "FP32" if model == "big" else "FP64", shape,
                                                         b"")))
        assert list(response.outputs[0].shape) == shape and response.raw_output_contents == [b""], model
    result = server.client.infer("var", [triton_input("input", np.zeros((1, 0, 3)), "FP64")])
    assert result.as_numpy("output").shape == (1, 0, 3)


@pytest.mark.parametrize(("raw", "problem"), [
    (b"\x02\x00", "inside a 4-byte length prefix"),
    (struct.pack("<I", 10) + b"abc", "runs past the end"),
    (serialize_bytes([b"only one"]), "1 BYTES elements, expected 2"),
    (serialize_bytes([b"a", b"b", b"c"]), "more than the 2 BYTES element(s) the shape allows"),
])
def test_malformed_bytes_raw_contents_are_invalid_argument(server, raw, problem):
    expect_grpc_error("INVALID_ARGUMENT",
                 lambda: raw_infer(server, raw_request("bytes2", ("input", "BYTES", [2], raw))),
                 "model 'bytes2'", "input 'input'", problem)


def test_raw_input_contents_count_mismatch_is_invalid_argument(server):
    request = raw_request("pair", ("a", "INT32", [2], np.zeros(2, np.int32).tobytes()), ("b", "FP32", [3], None))

    expect_grpc_error("INVALID_ARGUMENT", lambda: raw_infer(server, request),
                 "model 'pair'", "1 raw_input_contents for 2 inputs")


@pytest.mark.parametrize(("parameter", "problem"), [
    (service_pb2.InferParameter(int64_param=-5), "must be a non-negative integer number of microseconds, got -5"),
    # (The error hunt: the field alone was said, not what it held.)
    (service_pb2.InferParameter(string_param="5000"), "(int64_param or uint64_param), got string_param '5000'"),
])
def test_bad_timeout_parameter_is_invalid_argument(server, parameter, problem):
    request = raw_request("echo_INT8", ("input", "INT8", [4], bytes(4)))
    request.parameters["timeout"].CopyFrom(parameter)

    expect_grpc_error("INVALID_ARGUMENT", lambda: raw_infer(server, request), "model 'echo_INT8'", "'timeout'", problem)


def test_timeout_parameter_as_uint64_is_accepted(server):
    request = raw_request("echo_INT8", ("input", "INT8", [4], bytes([1, 2, 3, 4])))
    request.parameters["timeout"].uint64_param = 30_000_000

    assert raw_infer(server, request).raw_output_contents[0] == bytes([1, 2, 3, 4])


@pytest.mark.parametrize("array", [
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2],  # strided: converted
    np.arange(6, dtype=">i4"),  # big-endian: converted
    np.array(7, dtype=np.int64),  # 0-d
    np.zeros((0, 3), dtype=np.uint8),
    np.array([1.5, -2.25], dtype=ml_dtypes.bfloat16),
    np.array([True, False, True]),
    np.array([b"", b"abc", "\u00e9"], dtype=object),  # BYTES
])
def test_serialized_responses_equal_protobuf_serialization(array):
    """serialize_infer_response writes outputs with one copy; the bytes must mean the same message."""
    from nereid._proto import grpc_service_pb2 as pb
    from nereid.dtypes import DType
    from nereid.protocol.grpc_codec import encode_infer_response, serialize_infer_response
    from nereid.tensors import InferResponse, NamedTensor

    dtype = DType.BYTES if array.dtype == object else DType.of(array.astype(array.dtype.newbyteorder("=")))
    response = InferResponse("m", [NamedTensor("y", dtype, array), NamedTensor("z", DType.INT8, np.ones(3, np.int8))],
                             "id-1")
    expected = encode_infer_response(response)
    assert pb.ModelInferResponse.FromString(serialize_infer_response(response)) == expected
    streamed = pb.ModelStreamInferResponse.FromString(serialize_infer_response(response, streamed=True))
    # A streamed answer also carries Triton's final-response flag (each request gets one answer).
    assert streamed.infer_response.parameters["triton_final_response"].bool_param and not streamed.error_message
    del streamed.infer_response.parameters["triton_final_response"]
    assert streamed.infer_response == expected


# -- the codec functions on their own (no server) ------------------------------------------------

def _request(**fields):
    from nereid._proto import grpc_service_pb2 as pb

    message = pb.ModelInferRequest(model_name="m", id="r1", **fields)
    return message


def test_decode_raw_and_typed_contents_directly():
    import time

    from nereid.dtypes import DType
    from nereid.protocol.grpc_codec import decode_infer_request

    raw = _request()
    raw.inputs.add(name="x", datatype="FP32", shape=[1, 2])
    raw.raw_input_contents.append(np.array([1.5, 2.5], "<f4").tobytes())
    raw.outputs.add(name="y")
    raw.parameters["timeout"].int64_param = 5_000_000
    decoded = decode_infer_request(raw, time_remaining_s=0.5)
    (x,) = decoded.inputs
    assert (x.dtype, x.data.tolist(), decoded.id, decoded.requested_outputs) == (DType.FP32, [[1.5, 2.5]], "r1", ["y"])
    budget_ns = decoded.deadline_ns - time.monotonic_ns()
    assert 0 < budget_ns <= 500_000_000  # the earlier of the gRPC deadline and the timeout parameter
    typed = _request()
    typed.inputs.add(name="x", datatype="INT8", shape=[2]).contents.int_contents.extend([1, -2])
    assert decode_infer_request(typed, None).inputs[0].data.tolist() == [1, -2]
    # An empty FP16 tensor carries no data: taken beside typed contents (the gRPC read hunt: refused for a field it
    # has none of, every typed request to a model with such an input refused with it).
    typed.inputs.add(name="h", datatype="FP16", shape=[0, 3])
    h = decode_infer_request(typed, None).inputs[1]
    assert h.dtype == DType.FP16 and h.data.shape == (0, 3)


@pytest.mark.parametrize("build, message", [
    (lambda r: (r.inputs.add(name="x", datatype="INT8", shape=[1]).contents.int_contents.append(300)),
     "contents.int_contents value 300 does not fit INT8"),
    (lambda r: (r.inputs.add(name="x", datatype="FP32", shape=[2]), r.raw_input_contents.append(b"\0" * 4)),
     "raw contents are 4 bytes, expected 8"),
    (lambda r: (r.inputs.add(name="x", datatype="FP16", shape=[1]).contents.fp32_contents.append(1.0)),
     "FP16 data must be sent in raw_input_contents"),
    (lambda r: (r.inputs.add(name="x", datatype="FP32", shape=[-1])), "shape [-1] has a negative dimension"),
    (lambda r: (r.inputs.add(name="x", datatype="FP32", shape=[0, 2 ** 40, 2 ** 40])),
     "shape [0, 1099511627776, 1099511627776] is too large"),
    # A BOOL is one byte, 0 or 1: 2 or 255 is no bool (undefined behaviour for a C++ model reading it).
    (lambda r: (r.inputs.add(name="x", datatype="BOOL", shape=[4]),
                r.raw_input_contents.append(bytes([0, 1, 2, 255]))),
     "input 'x': BOOL raw contents hold byte 2 at element 2; each element must be 0 (false) or 1 (true)"),
    (lambda r: (r.inputs.add(name="x", datatype="FP32", shape=[1]), r.inputs.add(name="z", datatype="FP32", shape=[1]),
                r.raw_input_contents.append(b"\0" * 4)), "1 raw_input_contents for 2 inputs"),
])
def test_decode_refusals_directly(build, message):
    from nereid.errors import InvalidArgument
    from nereid.protocol.grpc_codec import decode_infer_request

    from nereid.errors import PublicText

    request = _request()
    build(request)
    with pytest.raises(InvalidArgument, match=re.escape(message)) as caught:
        decode_infer_request(request, None)
    assert isinstance(str(caught.value), PublicText)  # built from the request alone: echoed, never scrubbed


def test_shared_memory_tensors_and_bad_classification_counts_are_refused_directly():
    from nereid.errors import InvalidArgument
    from nereid.protocol.grpc_codec import decode_infer_request

    def request_with(tensor) -> object:  # tritonclient's own message for one input or output
        request = _request()
        kind = request.inputs if isinstance(tensor, triton.InferInput) else request.outputs
        kind.add().ParseFromString(tensor._get_tensor().SerializeToString())
        if isinstance(tensor, triton.InferRequestedOutput):
            request.inputs.add(name="x", datatype="INT8", shape=[1]).contents.int_contents.append(1)
        return request

    placed = triton.InferInput("x", [1, 4], "FP32")
    placed.set_shared_memory("region0", 16)
    returned = triton.InferRequestedOutput("y")
    returned.set_shared_memory("region1", 16)
    for tensor, where in ((placed, "input 'x'"), (returned, "output 'y'")):
        with pytest.raises(InvalidArgument, match=f"model 'm': {where}: names a shared-memory region, but nereid "
                                                  "does not support Triton's shared-memory extensions"):
            decode_infer_request(request_with(tensor), None)
    assert decode_infer_request(request_with(triton.InferRequestedOutput("y", class_count=3)),
                                None).classifications == {"y": 3}
    assert decode_infer_request(request_with(triton.InferRequestedOutput("y")), None).classifications == {}
    negative = request_with(triton.InferRequestedOutput("y"))
    negative.outputs[0].parameters["classification"].int64_param = -2
    with pytest.raises(InvalidArgument, match="output 'y': parameter 'classification' must be a non-negative "
                                              "integer count of classes, got int64_param -2"):
        decode_infer_request(negative, None)


def test_an_input_in_shared_memory_beside_one_sent_in_the_request_is_refused_for_the_shared_memory():
    """The protocol-parity hunt: tritonclient sends no raw contents for an input in a shared-memory region, and the
    mix was refused for its count of raw contents, where HTTP named the region (as an all-shared request does)."""
    from tritonclient.grpc import _utils as grpc_utils

    sent = triton_input("a", np.ones(4, np.float32), "FP32")
    placed = triton.InferInput("b", [4], "FP32")
    placed.set_shared_memory("input_region", 16)
    request = grpc_utils._get_inference_request(model_name="m", inputs=[sent, placed], model_version="",
                                                request_id="", outputs=None, sequence_id=0, sequence_start=False,
                                                sequence_end=False, priority=0, timeout=None, parameters=None)
    assert len(request.raw_input_contents) == 1  # (what the client sends: the mix this is about)
    with pytest.raises(InvalidArgument, match=re.escape(
            "model 'm': input 'b': names a shared-memory region, but nereid does not support Triton's "
            "shared-memory extensions")):
        decode_infer_request(request, None)


@pytest.mark.parametrize(("field", "value", "shown"), [
    ("string_param", "3", "string_param '3'"),
    ("double_param", 3.0, "double_param 3.0"),
    ("bool_param", True, "bool_param True"),
    (None, None, "no value"),
])
def test_a_classification_count_of_the_wrong_type_is_named_by_its_field_and_value(field, value, shown):
    """Defect: it read "got 'a string_param'" (and "got 'a None'"), as though the client had sent that text."""
    request = _request()
    requested = request.outputs.add(name="y")
    if field is None:
        requested.parameters["classification"].SetInParent()  # present, no field of it set
    else:
        setattr(requested.parameters["classification"], field, value)
    message = (f"model 'm': output 'y': parameter 'classification' must be a non-negative integer count of classes "
               f"(int64_param or uint64_param), got {shown}")
    with pytest.raises(InvalidArgument, match=f"^{re.escape(message)}$"):
        decode_infer_request(request, None)


def test_large_requests_keep_raw_inputs_as_views_of_the_wire_bytes():
    from nereid.protocol.grpc_codec import parse_infer_request

    request = _request()
    request.inputs.add(name="x", datatype="UINT8", shape=[1 << 20])
    request.raw_input_contents.append(b"\x07" * (1 << 20))
    wire = request.SerializeToString()
    message, raws = parse_infer_request(wire)
    assert isinstance(raws[0], memoryview) and raws[0].obj is wire and len(raws[0]) == 1 << 20
    assert message.inputs[0].name == "x" and not message.raw_input_contents



def test_a_request_of_more_top_level_fields_than_any_model_needs_is_refused_as_it_is_read_whatever_its_size():
    """Found by the gRPC read hunt: 4 million empty inputs in a 64 MiB request took 18 s of the server's CPU and
    2.4 GiB, the event loop held while protobuf parsed them, before any model refused them; past 16,384 fields the
    scan handed the message to protobuf whole (and a group field in front did so at once: the review hunt). Such
    a request is refused as it is read now, small or large (a small one's parameters were taken, a large one's
    refused, before an earlier fix)."""
    from nereid.protocol.grpc_codec import MAX_TOP_LEVEL_FIELDS, ZERO_COPY_MIN_BYTES, parse_infer_request

    for padding in (0, ZERO_COPY_MIN_BYTES):  # parsed whole, and scanned
        for fill in ("inputs", "parameters"):
            request = _request()
            for index in range(MAX_TOP_LEVEL_FIELDS + 1):
                if fill == "inputs":
                    request.inputs.add(name="x", datatype="BOOL", shape=[0])
                else:
                    request.parameters[f"key{index}"].string_param = ""
            request.id = "p" * padding
            with pytest.raises(ValueError, match=rf"^it has more than {MAX_TOP_LEVEL_FIELDS} top-level fields"):
                parse_infer_request(request.SerializeToString())
    # A group (wire type 3) in front is skipped, its fields counted: the message is still scanned, not parsed whole.
    group = bytes([(15 << 3) | 3, (1 << 3) | 0, 7, (15 << 3) | 4])  # (one-byte keys: field 15)
    request = _request()
    request.inputs.add(name="x", datatype="UINT8", shape=[4])
    request.raw_input_contents.append(b"\x01\x02\x03\x04" * (ZERO_COPY_MIN_BYTES // 4))
    message, raws = parse_infer_request(group + request.SerializeToString())
    assert message.inputs[0].name == "x" and isinstance(raws[0], memoryview)
    many = bytes([(15 << 3) | 3]) + bytes([(1 << 3) | 0, 7]) * MAX_TOP_LEVEL_FIELDS + bytes([(15 << 3) | 4])
    with pytest.raises(ValueError, match="top-level fields"):
        parse_infer_request(many + request.SerializeToString())


def test_a_request_of_thousands_of_inputs_is_read_and_refused_by_its_model_naming_it():
    """The review hunt of d07cc73: refused as unreadable, a request of more inputs than any model declares named
    no model, and a stream's answer carried no id. It is read now, and its model refuses it before any tensor is
    decoded, naming the input given twice."""
    from nereid.protocol.grpc_codec import ZERO_COPY_MIN_BYTES, parse_infer_request

    request = _request()
    for _ in range(5000):
        request.inputs.add(name="x", datatype="BOOL", shape=[0])
    request.id = "p" * ZERO_COPY_MIN_BYTES
    message, raws = parse_infer_request(request.SerializeToString())
    with pytest.raises(InvalidArgument, match=r"^model 'm': input 'x' is given more than once$"):
        decode_infer_request(message, None, raws, declared={"x": DType.BOOL})


def test_more_inputs_than_the_model_declares_are_refused_before_any_is_decoded():
    """Found by the gRPC read hunt: each of millions of tiny inputs was decoded into a tensor (9 s, +900 MB on a
    thread of the server's) before the data plane refused the request for naming an input twice."""
    request = _request()
    for _ in range(3):
        request.inputs.add(name="x", datatype="NOT_A_TYPE", shape=[1])  # (never read: refused by name first)
    with pytest.raises(InvalidArgument, match=r"^model 'm': input 'x' is given more than once$"):
        decode_infer_request(request, None, declared={"x": DType.FP32})
    request = _request()
    request.inputs.add(name="x", datatype="NOT_A_TYPE", shape=[1])
    request.inputs.add(name="y", datatype="NOT_A_TYPE", shape=[1])
    with pytest.raises(InvalidArgument, match=r"^model 'm': unexpected input 'y' \(expected inputs: 'x'\)$"):
        decode_infer_request(request, None, declared={"x": DType.FP32})


# -- names the client sent, echoed as sent ---------------------------------------------------------------------

def test_decode_refusals_echo_the_clients_names_as_sent_through_the_path_scrubbing(tmp_path):
    # An input or output name starting with one of the server's private folders came back rewritten
    # ("/opt/nereid/core/in" as "<nereid>/in") while any other path came back as sent: an oracle for which
    # absolute paths are the server's.
    from nereid.errors import InvalidArgument
    from nereid.protocol.grpc_codec import decode_infer_request
    from toy_backends import toy_dataplane

    repository = toy_dataplane(tmp_path).repository
    for name in private_names(repository, "x"):
        typeless = _request()
        typeless.inputs.add(name=name, datatype="FP33", shape=[1])
        placed = _request()
        placed.outputs.add(name=name).parameters["shared_memory_region"].string_param = "region0"
        for request, message in ((typeless, f"model 'm': input '{name}': unknown datatype 'FP33'"),
                                 (placed, f"model 'm': output '{name}': names a shared-memory region")):
            with pytest.raises(InvalidArgument) as caught:
                decode_infer_request(request, None)
            assert repository.public_text(str(caught.value)).startswith(message)


def test_the_server_echoes_input_output_and_load_parameter_names_as_sent(server):
    # The same over the wire, for each kind of name a refusal echoes (the input's through the signature check).
    x = np.ones((1, 4), np.float32).tobytes()
    with raw_stub(server) as stub:
        for name in private_names(server.server.repository, "in"):
            for request, message in (
                    (raw_request("echo_FP32", (name, "FP32", [1, 4], x)),
                     f"model 'echo_FP32': unexpected input '{name}' (expected inputs: 'input')"),
                    (raw_request("echo_FP32", ("input", "FP32", [1, 4], x), outputs=[{"name": name}]),
                     f"model 'echo_FP32': unknown requested output '{name}' (outputs: 'output')")):
                with pytest.raises(grpc.RpcError) as caught:
                    stub.ModelInfer(request, timeout=30)
                assert (caught.value.code(), caught.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)
            key = f"file:{name}"[:64]  # (a refusal quotes a load parameter's first 64 characters)
            with pytest.raises(grpc.RpcError) as caught:
                stub.RepositoryModelLoad(service_pb2.RepositoryModelLoadRequest(
                    model_name="echo_FP32", parameters={key: service_pb2.ModelRepositoryParameter(bytes_param=b"")}),
                    timeout=30)
            assert caught.value.details().startswith(f"model 'echo_FP32': load parameters '{key}' are not supported")


def test_typed_contents_past_their_element_bound_are_refused_before_any_is_read(monkeypatch):
    """The complexity hunt: 32 million empty BYTES elements in bytes_contents (61 MiB on the wire) held the event
    loop 3 s and grew the server by 1.6 GiB, each element made a Python object, where the tensor sent raw costs a
    copy. All inputs' typed elements together are bounded; raw contents are not."""
    from nereid.protocol import grpc_codec

    monkeypatch.setattr(grpc_codec, "MAX_TYPED_ELEMENTS", 6)
    request = service_pb2.ModelInferRequest(model_name="m")
    request.inputs.add(name="a", datatype="INT32", shape=[4]).contents.int_contents.extend([1, 2, 3, 4])
    request.inputs.add(name="b", datatype="BYTES", shape=[3]).contents.bytes_contents.extend([b"", b"", b""])
    with pytest.raises(InvalidArgument) as refused:
        decode_infer_request(request, None)
    assert str(refused.value) == ("model 'm': the request's typed contents hold 7 elements, more than the 6 nereid "
                                  "decodes from them (each is a Python object); send large tensors in "
                                  "raw_input_contents, as tritonclient does")
    del request.inputs[1]
    assert decode_infer_request(request, None).inputs[0].data.tolist() == [1, 2, 3, 4]
    assert len(decode_infer_request(raw_request("m", ("x", "INT8", [8], bytes(8))), None).inputs) == 1
