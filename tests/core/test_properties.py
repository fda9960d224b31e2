"""Property-based tests (hypothesis) of every parser that reads untrusted bytes, and of both surfaces.

The property is the same for each parser: whatever the input, it either
returns a result or raises its own error type (gRPC status / ConfigError /
ModelFailure) — never an unexpected exception, never a hang. For the REST
application and the gRPC service as a whole: every request gets exactly one
answer, and none is a server error. Examples are bounded (count and size) so
the whole module runs in a few seconds.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import struct
import tempfile
from pathlib import Path

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nereid._proto import grpc_service_pb2 as pb
from nereid.backends.subprocess.framing import read_body, read_header
from nereid.backends.xla.manifest import parse_manifest, parse_manifest_text
from nereid.backends.xla.safetensors import read_header as read_safetensors_header
from nereid.dtypes import DType
from nereid.errors import ConfigError, InvalidArgument, ModelFailure
from nereid.plugins import make_plugin_manager
from nereid.protocol.grpc_codec import decode_infer_request, parse_infer_request
from nereid.protocol.grpc_service import Received, Unreadable, request_parser
from nereid.protocol.http_codec import decode_infer
from nereid.protocol.http_service import HttpSurface
from nereid.signature import load_textproto_signature

import toy_backends
from support import ModelRepo, RunningServer
from toy_backends import toy_dataplane, write_toy

# NEREID_HYPOTHESIS_EXAMPLES=5000 searches deeper (a few minutes) than the suite does by default.
BOUNDED = settings(max_examples=int(os.environ.get("NEREID_HYPOTHESIS_EXAMPLES", 150)), deadline=None, database=None,
                   suppress_health_check=[HealthCheck.too_slow])
DATATYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32",
             "FP64", "BF16", "BYTES", "", "NOPE"]
parse_infer = request_parser(pb.ModelInferRequest)


def decode(data: bytes) -> None:
    """The server's path for one message: parse, then decode; only the expected outcomes pass."""
    if data.startswith(b"scan:"):
        try:
            message, raws = parse_infer_request(data[5:], zero_copy_min_bytes=0)
        except ValueError:
            return
        try:
            decode_infer_request(message, None, raws)
        except InvalidArgument:
            pass
        return
    received = parse_infer(data)
    if isinstance(received, Unreadable):
        assert received.describe().startswith("cannot parse the")
        return
    assert isinstance(received, Received)
    try:
        decode_infer_request(received.message, None, received.raws)
    except InvalidArgument:
        pass


@BOUNDED
@given(st.binary(max_size=512))
def test_any_bytes_are_a_request_or_an_invalid_argument(data: bytes) -> None:
    decode(data)


@BOUNDED
@given(st.binary(max_size=512))
def test_the_zero_copy_scan_agrees_with_protobuf_on_any_bytes(data: bytes) -> None:
    """Large requests are split by nereid's own field scan: it must read exactly what protobuf reads."""
    try:
        whole, whole_raws = parse_infer_request(data)
    except ValueError:
        whole = None
    try:
        scanned, scanned_raws = parse_infer_request(data, zero_copy_min_bytes=0)
    except ValueError:
        scanned = None
    assert (scanned is None) == (whole is None)
    if whole is None:
        return
    assert [bytes(raw) for raw in scanned_raws] == [bytes(raw) for raw in whole_raws]
    whole.ClearField("raw_input_contents")
    assert scanned == whole


@st.composite
def infer_requests(draw) -> bytes:
    """Structurally valid messages with arbitrary (mostly inconsistent) tensors."""
    request = pb.ModelInferRequest(model_name=draw(st.text(max_size=20)), id=draw(st.text(max_size=8)))
    with_raw = draw(st.booleans())
    for index in range(draw(st.integers(0, 3))):
        tensor = request.inputs.add(name=draw(st.text(max_size=8)), datatype=draw(st.sampled_from(DATATYPES)),
                                    shape=draw(st.lists(st.integers(-3, 2 ** 40), max_size=6)))
        if with_raw:
            request.raw_input_contents.append(draw(st.binary(max_size=64)))
        elif draw(st.booleans()):
            tensor.contents.int_contents.extend(draw(st.lists(st.integers(-2 ** 31, 2 ** 31 - 1), max_size=8)))
            tensor.contents.bytes_contents.extend(draw(st.lists(st.binary(max_size=4), max_size=4)))
            tensor.contents.fp32_contents.extend(draw(st.lists(st.floats(width=32), max_size=4)))
    if draw(st.booleans()):
        request.parameters["timeout"].int64_param = draw(st.integers(-10, 10 ** 6))
    data = request.SerializeToString()
    if draw(st.booleans()):  # as large requests are parsed: by the zero-copy scan
        return b"scan:" + data
    if draw(st.booleans()) and data:  # and damaged ones
        cut = draw(st.integers(0, len(data)))
        data = data[:cut] + draw(st.binary(max_size=8))
    return data


@BOUNDED
@given(infer_requests())
def test_any_tensor_description_is_decoded_or_invalid_argument(data: bytes) -> None:
    decode(data)


# -- ModelInfer over the wire ------------------------------------------------------------

# What a server answers client input with; INTERNAL and UNKNOWN (a server fault) are not among them.
CLIENT_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}


@pytest.fixture(scope="module")
def toy_grpc(tmp_path_factory):
    """A real server (gRPC on a free port) serving the toy model, and a channel to it."""
    repo = ModelRepo(tmp_path_factory.mktemp("grpc"))
    write_toy(repo.models_dir, "toy")
    server = RunningServer(repo.write_config(metrics_addr=""),
                           manager=make_plugin_manager(load_entry_points=False, extra_plugins=(toy_backends,)))
    channel = grpc.insecure_channel(server.url)
    yield channel
    channel.close()
    server.stop()


@st.composite
def toy_infer_messages(draw) -> bytes:
    """ModelInfer requests for the toy model (FP32 [n, 4] "input"): well-formed, inconsistent or damaged."""
    hostile = draw(st.booleans())

    def pick(usual, *others):
        return draw(st.sampled_from([usual, *others])) if hostile else usual

    request = pb.ModelInferRequest(model_name=pick("toy", "nope", ""), model_version=pick("", "1", "2"))
    for _ in range(draw(st.integers(0, 2)) if hostile else 1):
        rows = draw(st.integers(0, 9) if hostile else st.integers(1, 8))
        tensor = request.inputs.add(name=pick("input", "other"), datatype=pick("FP32", "INT8", "BYTES", "nope"),
                                    shape=pick([rows, 4], [4], [rows, 3], [rows]))
        values = [float(v) for v in range(pick(rows * 4, 3))]
        if draw(st.booleans()):
            request.raw_input_contents.append(np.array(values, np.float32).tobytes())
        else:
            tensor.contents.fp32_contents.extend(values)
    if draw(st.booleans()):
        request.outputs.add(name=pick("output", "nope"))
    if draw(st.booleans()):
        request.parameters["timeout"].int64_param = draw(st.integers(-10, 10 ** 6) if hostile
                                                         else st.integers(10 ** 6, 10 ** 7))
    data = request.SerializeToString()
    if hostile and draw(st.booleans()) and data:  # damaged
        data = data[:draw(st.integers(0, len(data)))] + draw(st.binary(max_size=8))
    return data


@BOUNDED
@given(toy_infer_messages())
def test_no_infer_request_is_a_server_error(toy_grpc, message: bytes) -> None:
    try:
        answer = toy_grpc.unary_unary("/inference.GRPCInferenceService/ModelInfer")(message, timeout=30)
    except grpc.RpcError as err:
        assert err.code() in CLIENT_CODES, (err.code(), err.details())
        assert err.details()
    else:
        response = pb.ModelInferResponse.FromString(answer)
        assert response.model_name == "toy" and response.outputs[0].name == "output"


@BOUNDED
@given(st.lists(toy_infer_messages(), min_size=1, max_size=6))
def test_a_stream_answers_every_message_once(toy_grpc, messages: list[bytes]) -> None:
    stream = toy_grpc.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
    answers = [pb.ModelStreamInferResponse.FromString(answer) for answer in stream(iter(messages), timeout=30)]
    assert len(answers) == len(messages)
    for answer in answers:  # an error in the stream names the model, or says what could not be parsed
        if answer.error_message:
            assert answer.error_message.startswith(("model '", "unknown model", "cannot parse")), answer.error_message
        else:
            assert answer.infer_response.model_name == "toy"


JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70),
                        st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=4))
JSON_DATA = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=4), max_leaves=12)


def _well_formed_rest_input(draw, binary: bytearray) -> dict:
    dims = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    count = int(np.prod(dims))
    datatype = draw(st.sampled_from(["FP32", "INT64", "BOOL", "BYTES", "UINT8"]))
    if draw(st.booleans()) and datatype != "BYTES":
        raw = np.zeros(count, DType.from_kserve(datatype).numpy).tobytes()
        binary += raw
        return {"name": "x", "datatype": datatype, "shape": dims, "parameters": {"binary_data_size": len(raw)}}
    element = {"FP32": 1.5, "INT64": -3, "BOOL": True, "BYTES": "a", "UINT8": 7}[datatype]
    return {"name": "x", "datatype": datatype, "shape": dims, "data": [element] * count}


def _hostile_rest_input(draw) -> dict:
    tensor = {"name": draw(st.one_of(st.sampled_from(["x", "y"]), JSON_SCALARS)),
              "datatype": draw(st.one_of(st.sampled_from(DATATYPES), JSON_SCALARS)),
              "shape": draw(st.one_of(st.lists(st.integers(-2, 2 ** 40), max_size=5), JSON_SCALARS))}
    if draw(st.booleans()):
        tensor["data"] = draw(JSON_DATA)
    if draw(st.booleans()):
        tensor["parameters"] = {"binary_data_size": draw(st.one_of(st.integers(-1, 80), JSON_SCALARS))}
    return tensor


@st.composite
def http_infer_bodies(draw) -> tuple[bytes, int | None]:
    """REST infer bodies: well-formed ones, and plausible JSON headers with hostile fields, some damaged."""
    hostile = draw(st.booleans())
    binary = bytearray()
    inputs = [_hostile_rest_input(draw) if hostile and draw(st.booleans()) else _well_formed_rest_input(draw, binary)
              for _ in range(draw(st.integers(0 if hostile else 1, 3)))]
    document: dict = {"inputs": inputs if not hostile or draw(st.booleans()) else draw(JSON_DATA)}
    if draw(st.booleans()):
        document["outputs"] = draw(st.one_of(
            st.lists(st.fixed_dictionaries({"name": st.sampled_from(["x", "y"])},
                                           optional={"parameters": st.fixed_dictionaries(
                                               {"binary_data": st.booleans()})}), max_size=2),
            *([JSON_DATA] if hostile else [])))
    if draw(st.booleans()):
        document["parameters"] = draw(st.fixed_dictionaries(
            {}, optional={"timeout": st.integers(0, 10 ** 6) if not hostile else JSON_SCALARS,
                          "binary_data_output": st.booleans() if not hostile else JSON_SCALARS}))
    if draw(st.booleans()):
        document["id"] = draw(st.text(max_size=4) if not hostile else JSON_SCALARS)
    header = json.dumps(document).encode()
    if hostile and draw(st.booleans()):  # damaged
        header = header[:draw(st.integers(0, len(header)))] + draw(st.binary(max_size=6))
        binary += draw(st.binary(max_size=96))
    if not binary and draw(st.booleans()):
        return header, None  # a JSON body
    length = draw(st.integers(-2, len(header) + len(binary) + 2)) if hostile else len(header)
    return header + bytes(binary), length


@BOUNDED
@given(http_infer_bodies())
def test_any_rest_infer_body_is_decoded_or_invalid_argument(case: tuple[bytes, int | None]) -> None:
    body, header_length = case
    try:
        request, _ = decode_infer("m", body, header_length)
    except InvalidArgument as err:
        assert str(err).startswith("model 'm'") and len(str(err)) <= 4096, str(err)[:300]
    else:
        assert request.model_name == "m" and isinstance(request.inputs, list)  # empty: a model without inputs
        for tensor in request.inputs:
            assert isinstance(tensor.data, np.ndarray) and min(tensor.data.shape, default=1) >= 1


# -- the REST surface as a whole ----------------------------------------------------------

PATH_SEGMENTS = ["v2", "models", "toy", "spare", "nope", "versions", "1", "2", "infer", "ready", "config", "stats",
                 "repository", "index", "load", "unload", "health", "live", "", "..", "%00", "\u00e9", "x" * 300]
HEADER_VALUES = st.one_of(st.none(), st.sampled_from(["0", "12", "-1", "abc", "99999999999999999999", ""]),
                          st.binary(max_size=8).map(lambda b: b.decode("latin-1")))
# What the surface may answer client input with; 500 (a server fault) is not among them.
CLIENT_STATUSES = {200, 400, 403, 404, 405, 413, 501, 503, 504}


@pytest.fixture(scope="module")
def rest_surface(tmp_path_factory):
    """The REST application over a toy data plane (``toy`` loaded, ``spare`` not), and its event loop."""
    loop = asyncio.new_event_loop()
    plane = toy_dataplane(tmp_path_factory.mktemp("rest"), control=False)
    loop.run_until_complete(plane.repository.load("toy"))
    yield loop, HttpSurface(plane, max_body_bytes=2048)
    loop.run_until_complete(plane.repository.unload("toy"))
    loop.close()


@st.composite
def toy_infer_bodies(draw) -> tuple[bytes, int | None]:
    """Requests the toy model accepts (FP32 [n, 4] "input"), as JSON or binary; most of them succeed."""
    rows = draw(st.integers(1, 9))  # 9: one past the toy's max_batch_size
    values = np.arange(rows * 4, dtype=np.float32)
    tensor: dict = {"name": "input", "datatype": "FP32", "shape": [rows, 4]}
    if draw(st.booleans()):
        tensor["parameters"] = {"binary_data_size": values.nbytes}
        header = json.dumps({"inputs": [tensor], "parameters": {"binary_data_output": draw(st.booleans())}}).encode()
        return header + values.tobytes(), len(header)
    tensor["data"] = values.tolist()
    return json.dumps({"inputs": [tensor]}).encode(), None


@st.composite
def rest_calls(draw) -> tuple[dict, list[bytes], bool]:
    """An ASGI scope, the body's chunks, and whether the client disconnects after them."""
    method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE"]))
    segments = draw(st.lists(st.sampled_from(PATH_SEGMENTS), max_size=6))
    if draw(st.booleans()):
        method, segments = "POST", ["v2", "models", draw(st.sampled_from(["toy", "toy", "spare", "nope"])), "infer"]
    body, header_length = draw(st.one_of(toy_infer_bodies(), http_infer_bodies(),
                                         st.tuples(st.binary(max_size=64), st.none())))
    headers = []
    for name, value in (("content-type", draw(st.one_of(st.sampled_from(
                            ["application/json", "application/octet-stream", "text/plain",
                             "application/json; charset=utf-8"]), HEADER_VALUES))),
                        ("inference-header-content-length",
                         str(header_length) if header_length is not None else draw(HEADER_VALUES)),
                        ("content-length", draw(st.one_of(st.just(str(len(body))), HEADER_VALUES))),
                        ("content-encoding", draw(st.one_of(st.none(), st.sampled_from(["gzip", "identity"]))))):
        if value is not None:
            headers.append((name.encode(), value.encode("latin-1")))
    scope = {"type": "http", "method": method, "path": "/" + "/".join(segments), "headers": headers}
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=3)))
    chunks = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)])]
    return scope, chunks, draw(st.integers(0, 9)) == 0


@BOUNDED
@given(rest_calls())
def test_no_client_input_is_a_server_error(rest_surface, call: tuple[dict, list[bytes], bool]) -> None:
    loop, surface = rest_surface
    scope, chunks, disconnects = call
    incoming = [{"type": "http.request", "body": chunk, "more_body": index < len(chunks) - 1}
                for index, chunk in enumerate(chunks)]
    if disconnects:
        incoming[-1]["more_body"] = True
        incoming.append({"type": "http.disconnect"})
    sent: list[dict] = []

    async def receive() -> dict:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    loop.run_until_complete(surface(scope, receive, send))
    if disconnects and not sent:
        return  # the client went away before its body was whole: nobody to answer
    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert len(starts) == 1 and starts[0]["status"] in CLIENT_STATUSES, (starts, sent[-1:])
    body = b"".join(bytes(m["body"]) for m in sent if m["type"] == "http.response.body")
    assert int(dict(starts[0]["headers"])[b"content-length"]) == len(body)
    if starts[0]["status"] >= 400:
        message = json.loads(body)["error"]
        assert message and not message.startswith("internal error"), message


def _textproto_file(content: bytes) -> ConfigError | None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "model_inference.textproto"
        path.write_bytes(content)
        try:
            load_textproto_signature(path)
        except ConfigError as err:
            assert str(err).startswith(str(path))  # every failure names the file
            return err
    return None


TEXTPROTO_WORDS = ["input", "output", "{", "}", "name:", "data_type:", "dims:", "[", "]", ",", "-1", "0", "3",
                   '"x"', '"FP32"', '"BYTES"', "max_batch_size:", "input_shape:", "output_shape:", "\n", "#"]


@BOUNDED
@given(st.one_of(st.binary(max_size=256),
                 st.lists(st.sampled_from(TEXTPROTO_WORDS), max_size=40).map(lambda w: " ".join(w).encode())))
def test_any_textproto_loads_or_names_the_file(content: bytes) -> None:
    _textproto_file(content)


yaml_scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 100), st.text(max_size=6),
                         st.sampled_from(["f32", "n", "chwn", "2.1", "xn"]))
yaml_documents = st.recursive(
    yaml_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.sampled_from(["format_version", "executable_inputs",
                                                             "executable_outputs", "name", "dtype", "shape",
                                                             "dims", "batching", "compiled_batch_sizes",
                                                             "input_shapes", "weights_file", "n", "c"]),
                                            inner, max_size=5)),
    max_leaves=20)


@BOUNDED
@given(yaml_documents)
def test_any_manifest_document_parses_or_is_a_config_error(document) -> None:
    try:
        parse_manifest(document, Path("manifest.yaml"))
    except ConfigError as err:
        assert str(err).startswith("manifest.yaml")


@BOUNDED
@given(st.text(alphabet=st.sampled_from(list("ab:-[]{}&*!|>'\"\n #0123,.n")), max_size=200))
def test_any_manifest_text_parses_or_is_a_config_error(text: str) -> None:
    try:
        parse_manifest_text(text, Path("manifest.yaml"))
    except ConfigError as err:
        assert str(err).startswith("manifest.yaml") and len(str(err)) <= 4096


header_values = st.recursive(st.one_of(st.none(), st.integers(-2, 2 ** 40), st.text(max_size=5),
                                       st.sampled_from(["F32", "U8", "BF16", "argument_order", "axis_order"])),
                             lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                     st.dictionaries(st.sampled_from(
                                                         ["dtype", "shape", "data_offsets", "__metadata__",
                                                          "w", "argument_order"]), inner, max_size=4)),
                             max_leaves=15)


@BOUNDED
@given(st.one_of(st.binary(max_size=128), header_values.map(lambda v: json.dumps(v).encode())),
       st.binary(max_size=32), st.booleans())
def test_any_safetensors_header_is_read_or_a_config_error(header: bytes, data: bytes, honest_length: bool) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "weights.safetensors"
        length = len(header) if honest_length else struct.unpack("<Q", (header + bytes(8))[:8])[0]
        path.write_bytes(struct.pack("<Q", length) + header + data)
        try:
            read_safetensors_header(path)
        except ConfigError as err:
            assert str(err).startswith(str(path)) and len(str(err)) <= 4096


@BOUNDED
@given(st.one_of(st.binary(max_size=256),
                 st.tuples(st.sampled_from(["float32", "int8", "uint16", "bytes", "bfloat16", "nope", ""]),
                           st.lists(st.integers(-1, 2 ** 33), max_size=4), st.binary(max_size=64))
                 .map(lambda t: f"{t[0]} {','.join(map(str, t[1]))}\n".encode() + t[2])))
def test_any_frame_is_read_or_a_model_failure(frame: bytes) -> None:
    stream = io.BytesIO(frame)
    try:
        dtype, shape = read_header(stream, "output 'y'")
        array = read_body(stream, dtype, shape, "output 'y'")
        assert isinstance(array, np.ndarray) and array.shape == shape
    except ModelFailure as err:
        assert str(err).startswith("output 'y'")


@BOUNDED
@given(st.lists(st.one_of(st.binary(max_size=40), st.text(max_size=8)), max_size=300), st.integers(1, 3))
def test_any_bytes_elements_join_as_the_element_by_element_form_and_split_back(elements: list, rows: int) -> None:
    """The numpy layout of many BYTES elements (past 64) gives exactly the form of one element after another."""
    import struct

    from nereid.tensors import join_bytes_elements, split_bytes_elements

    elements = elements[:len(elements) - len(elements) % rows]  # (a whole number of rows)
    array = np.empty(len(elements), dtype=object)
    array[:] = elements
    array = array.reshape(rows, -1) if elements else array
    encoded = [e.encode("utf-8", "surrogatepass") if isinstance(e, str) else e for e in elements]
    try:
        expected = b"".join(struct.pack("<I", len(e)) + e for e in encoded)
        assert join_bytes_elements(array) == expected
    except UnicodeEncodeError:  # a lone surrogate: no UTF-8 form (refused before here on every path)
        return
    assert split_bytes_elements(expected) == encoded
