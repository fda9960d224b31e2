"""The REST codec on its own: JSON and binary bodies to neutral requests and back."""

from __future__ import annotations

import http.client
import json
import re

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.http import _utils as http_utils

import toy_backends
from nereid.dtypes import DType
from nereid.errors import InvalidArgument, PublicText
from nereid.plugins import make_plugin_manager
from nereid.protocol.http_codec import OutputChoice, decode_infer, encode_infer
from nereid.tensors import InferResponse, NamedTensor, bytes_array
from support import private_names
from toy_backends import toy_dataplane, write_toy


def with_parameter(name: str, raw: bytes) -> bytes:
    """A request with one input and parameter ``name`` holding the JSON text ``raw`` (written out, as no JSON
    encoder writes a value nested a thousand levels deep)."""
    return (b'{"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}], "parameters": {"'
            + name.encode() + b'": ' + raw + b"}}")


NESTED = b"[" * 1000 + b"]" * 1000  # orjson reads up to 1024 levels


def body(*inputs, **extra) -> bytes:
    return json.dumps({"inputs": list(inputs), **extra}).encode()


def test_a_sequence_id_triton_can_read_is_ignored_and_any_other_refused():
    """nereid refused every sequence_id but 0 and "", saying Triton does; Triton 2.41 runs the request (a model
    without sequence batching ignores its correlation ID; the Triton client hunt). Its HTTP endpoint reads an
    unsigned 64-bit integer or a string, and answers 400 to anything else."""
    for raw in (b"7", b'"user-1"', b"0", b'""', b"18446744073709551615"):
        assert decode_infer("m", with_parameter("sequence_id", raw), None)[0].model_name == "m"
    for raw, shown in ((b"1.5", "1.5"), (b"true", "true"), (b"-1", "-1"),
                       # (Found by a bug hunt: 0.0 equals 0, and was read as none where 5.0 was refused.)
                       (b"0.0", "0.0"), (b"-0.0", "-0.0"),
                       (b"18446744073709551616", "a number past 64 bits (about 1.84467e+19)")):
        with pytest.raises(InvalidArgument) as error:
            decode_infer("m", with_parameter("sequence_id", raw), None)
        assert str(error.value) == ("model 'm': parameter 'sequence_id' must be a correlation ID: an integer from 0 "
                                    f"to 2**64 - 1 or a string, got {shown}")


def test_scheduling_parameters_of_the_wrong_type_are_refused():
    """Found by a bug hunt: accepted and ignored, where Triton answers 400."""
    for key, raw, problem in (("priority", b'"high"', "parameter 'priority' must be an integer >= 0, got \"high\""),
                              ("priority", b"-1", "parameter 'priority' must be an integer >= 0, got -1"),
                              # (Found by a bug hunt: "got 1.8446744073709552e+19", as though a float was sent.)
                              ("priority", b"18446744073709551616", "parameter 'priority' must be an integer >= 0, "
                                                                    "got a number past 64 bits (about 1.84467e+19)"),
                              ("sequence_end", b"1", "parameter 'sequence_end' must be true or false, got 1")):
        with pytest.raises(InvalidArgument, match=f"^model 'm': {re.escape(problem)}$"):
            decode_infer("m", with_parameter(key, raw), None)
    assert decode_infer("m", with_parameter("priority", b"2"), None)[0].model_name == "m"


def test_json_nested_and_flat_lists_give_the_same_tensor():
    flat, _ = decode_infer("m", body({"name": "x", "shape": [2, 2], "datatype": "INT32", "data": [1, 2, 3, 4]}), None)
    nested, _ = decode_infer("m", body({"name": "x", "shape": [2, 2], "datatype": "INT32",
                                        "data": [[1, 2], [3, 4]]}), None)
    assert flat.inputs[0].data.tolist() == nested.inputs[0].data.tolist() == [[1, 2], [3, 4]]
    assert flat.inputs[0].dtype is DType.INT32


def test_binary_inputs_are_views_of_the_body_and_json_mixes_in():
    header = body({"name": "a", "shape": [1, 2], "datatype": "FP32", "parameters": {"binary_data_size": 8}},
                  {"name": "b", "shape": [1], "datatype": "BYTES", "data": ["hi"]},
                  {"name": "c", "shape": [1, 1], "datatype": "BYTES", "parameters": {"binary_data_size": 7}},
                  id="7", outputs=[{"name": "y", "parameters": {"binary_data": True}}],
                  parameters={"timeout": 5_000_000})
    raw = header + np.array([1.5, 2.5], np.float32).tobytes() + (3).to_bytes(4, "little") + b"abc"
    request, choice = decode_infer("m", raw, len(header))
    a, b, c = request.inputs
    assert a.data.tolist() == [[1.5, 2.5]] and not a.data.flags.writeable  # a view, not a copy
    assert b.data.tolist() == [b"hi"] and c.data.tolist() == [[b"abc"]]
    assert request.id == "7" and request.requested_outputs == ["y"] and request.deadline_ns > 0
    assert choice.is_binary("y") and not choice.is_binary("z")


def test_a_null_data_beside_binary_data_size_is_no_data_as_the_kserve_sdk_sends_an_empty_tensor():
    """Found by the clients hunt: the KServe SDK's REST client writes "data": null beside binary_data_size 0 for a
    tensor of no elements (its default, binary), refused as data sent twice, where Triton serves it."""
    header = body({"name": "x", "shape": [0], "datatype": "FP32", "data": None,
                   "parameters": {"binary_data_size": 0}},
                  {"name": "y", "shape": [2], "datatype": "INT32", "data": None,
                   "parameters": {"binary_data_size": 8}})
    request, _ = decode_infer("m", header + np.array([3, 4], np.int32).tobytes(), len(header))
    empty, pair = request.inputs
    assert empty.data.shape == (0,) and empty.data.dtype == np.float32 and pair.data.tolist() == [3, 4]
    both = body({"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0], "parameters": {"binary_data_size": 4}})
    with pytest.raises(InvalidArgument, match="data sent both as JSON 'data' and as binary data"):
        decode_infer("m", both + b"\0" * 4, len(both))


def test_an_empty_inputs_list_is_a_request_without_inputs():
    # What tritonclient.http sends to a model without inputs; the model's signature judges it, as over gRPC.
    request, _ = decode_infer("m", body(), None)
    assert request.inputs == []


@pytest.mark.parametrize("raw, length, message", [
    (b"[1, 2]", None, "the request body must be a JSON object"),
    (b'{"inputs": {}}', None, "'inputs' must be a list of tensors"),
    # Read as false, these answered JSON without a word.
    (body(parameters={"binary_data_output": "yes"}), None,
     "model 'm': parameter 'binary_data_output' must be true or false, got \"yes\""),
    # Nested past json.dumps's recursion limit (a 500 with a traceback), or long: quoted from a bounded part.
    (with_parameter("binary_data_output", NESTED), None,
     "model 'm': parameter 'binary_data_output' must be true or false, got [[[[[[[[[[[[[[[[[[[[[[[[[[[[[["),
    (body({"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}, outputs=[{"name": "y", "parameters": {}}])
     .replace(b'"parameters": {}', b'"parameters": {"classification": ' + NESTED + b"}"), None,
     "output 'y': parameter 'classification' must be a non-negative integer count of classes, got [[[[["),
    (with_parameter("timeout", NESTED), None,
     "parameter 'timeout' must be a non-negative integer number of microseconds, got [[[[[[[[["),
    (body(outputs=[{"name": "y", "parameters": {"binary_data": 1}}]), None,
     "model 'm': output 'y': parameter 'binary_data' must be true or false, got 1"),
    (b"{}", None, "'inputs' must be a list of tensors"),
    (body({"name": "x", "shape": [1], "datatype": "FP32", "data": "1"}), None, "'data' must be a list"),
    # Each naming the first element refused (the HTTP clients hunt: JavaScript writes a NaN as null, and "FP32 data
    # must be a list of numbers" said neither where nor what).
    (body({"name": "x", "shape": [2], "datatype": "BOOL", "data": [True, 1]}), None,
     "BOOL data must be a list of true/false; element 1 is 1"),
    (body({"name": "x", "shape": [1], "datatype": "INT32", "data": [1.5]}), None,
     "INT32 data must be integers; element 0 is 1.5"),
    (body({"name": "x", "shape": [2, 2], "datatype": "FP32", "data": [[1, 2], [None, "a"]]}), None,
     "FP32 data must be a list of numbers; element 2 is null"),
    (body({"name": "x", "shape": [1], "datatype": "FP32", "data": [True]}), None,
     "FP32 data must be a list of numbers; element 0 is true"),
    (body({"name": "x", "shape": [1], "datatype": "BYTES", "data": [1]}), None,
     "BYTES data must be a list of strings; element 0 is 1"),
    (body({"name": "x", "shape": [1], "datatype": "FP99", "data": [1]}), None, "unknown datatype 'FP99'"),
    (body({"name": "x", "shape": [-2], "datatype": "FP32", "data": []}), None, "has a negative dimension"),
    (body({"name": "x", "shape": [1], "datatype": "FP32"}), None, "no 'data' and no binary_data_size"),
    (body({"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}, parameters={"timeout": -1}), None,
     "parameter 'timeout' must be a non-negative integer"),
    # Past 64 bits (JSON reads it as a float): too large, where it was answered "got 1e+23", as if not an integer.
    (body({"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}, parameters={"timeout": 10 ** 23}), None,
     "parameter 'timeout' must be a non-negative integer number of microseconds of at most 64 bits; got about "
     "1e+23"),
    (body({"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}).replace(b'"inputs"', b'"parameters": '
     b'{"timeout": 1e19}, "inputs"'), None,  # within 64 bits, but written as a float
     "parameter 'timeout' must be a non-negative integer number of microseconds, got 1e+19"),
    (b"{}", 99, "Inference-Header-Content-Length is 99, but the body has 2 bytes"),
    # Found by a README check: a dimension past 64 bits (read as a float) was "not a list of integers", unnamed.
    (body({"name": "x", "shape": [1, 10 ** 23], "datatype": "FP32", "data": [1]}), None,
     "input 'x': 'shape' must be a list of integers; element 1 is 1e+23, past what a 64-bit integer holds"),
    (body({"name": "x", "shape": [1, 2.5], "datatype": "FP32", "data": [1]}), None,
     "input 'x': 'shape' must be a list of integers; element 1 is 2.5"),
    (body({"name": "x", "shape": [1], "datatype": "FP32", "parameters": {"shared_memory_region": "r0",
                                                                          "shared_memory_byte_size": 4}}),
     None, "input 'x': names a shared-memory region, but nereid does not support"),
    (body({"name": "x", "shape": [1], "datatype": "FP32", "data": [1]},
          outputs=[{"name": "y", "parameters": {"shared_memory_region": "r1"}}]),
     None, "output 'y': names a shared-memory region"),
    # Quoted as JSON (found by a bug hunt: true read 'True', and "3" and 3 alike).
    (body({"name": "x", "shape": [1], "datatype": "FP32", "data": [1]},
          outputs=[{"name": "y", "parameters": {"classification": True}}]),
     None, "output 'y': parameter 'classification' must be a non-negative integer count of classes, got true"),
    (body({"name": "x", "shape": [1], "datatype": "FP32", "data": [1]},
          outputs=[{"name": "y", "parameters": {"classification": "3"}}]),
     None, "output 'y': parameter 'classification' must be a non-negative integer count of classes, got \"3\""),
    (body({"name": "x", "shape": [1], "datatype": "FP32", "data": [1]},
          outputs=[{"name": "y", "parameters": {"classification": 1.5}}]),
     None, "output 'y': parameter 'classification' must be a non-negative integer count of classes, got 1.5"),
    (body({"name": "x", "shape": [2], "datatype": "BOOL", "parameters": {"binary_data_size": 2}}) + b"\x01\x07",
     len(body({"name": "x", "shape": [2], "datatype": "BOOL", "parameters": {"binary_data_size": 2}})),
     "input 'x': BOOL raw contents hold byte 7 at element 1; each element must be 0 (false) or 1 (true)"),
    # JSON has no infinity: a finite number too large for the datatype is the client's mistake.
    (body({"name": "x", "shape": [2], "datatype": "FP16", "data": [1, 70000]}), None,
     "input 'x': value 70000 does not fit FP16 (largest magnitude 65504.0)"),
    (body({"name": "x", "shape": [1], "datatype": "BF16", "data": [1e39]}), None,
     "input 'x': value 1e+39 does not fit BF16 (largest magnitude 3.3895313892515355e+38)"),
    (body({"name": "x", "shape": [1], "datatype": "FP32", "data": [-1e39]}), None,
     "input 'x': value -1e+39 does not fit FP32 (largest magnitude 3.4028234663852886e+38)"),
    # An integer past 64 bits (JSON reads it as a float) is out of range, not "not an integer".
    (body({"name": "x", "shape": [1], "datatype": "INT64", "data": [10 ** 20]}), None,
     "input 'x': a value of about 1e+20 does not fit INT64 (range -9223372036854775808 to 9223372036854775807)"),
    # (JSON's float for -2**63 - 1 is -2**63 itself, as is -2**63 written as a float: either is named.)
    (body({"name": "x", "shape": [1], "datatype": "INT64", "data": [-2 ** 63 - 1]}), None,
     "input 'x': INT64 data must be integers within -9223372036854775808 to 9223372036854775807; got about "
     "-9.22337e+18, read as a number with a fraction or exponent, or an integer past 64 bits"),
    (body({"name": "x", "shape": [1], "datatype": "UINT64", "data": [1e19]}), None,
     "input 'x': UINT64 data must be integers within 0 to 18446744073709551615; got about 1e+19"),
    (body({"name": "x", "shape": [1], "datatype": "INT64", "data": [1.5]}), None,
     "input 'x': INT64 data must be integers"),
])
def test_malformed_bodies_are_invalid_arguments(raw, length, message):
    with pytest.raises(InvalidArgument, match=re.escape(message)) as caught:
        decode_infer("m", raw, length)
    assert isinstance(str(caught.value), PublicText)  # built from the request alone: echoed, never scrubbed


def test_decode_refusals_echo_the_clients_names_as_sent_through_the_path_scrubbing(tmp_path):
    # An input or output name starting with one of the server's private folders came back rewritten
    # ("/opt/nereid/core/in" as "<nereid>/in") while any other path came back as sent: an oracle for which
    # absolute paths are the server's.
    repository = toy_dataplane(tmp_path).repository
    for name in private_names(repository, "x"):
        for raw, message in (
                (body({"name": name, "shape": [1], "datatype": "FP33", "data": [1]}),
                 f"model 'm': input '{name}': unknown datatype 'FP33'"),
                (body(outputs=[{"name": name, "parameters": {"binary_data": "yes"}}]),
                 f"model 'm': output '{name}': parameter 'binary_data' must be true or false, got \"yes\"")):
            with pytest.raises(InvalidArgument) as caught:
                decode_infer("m", raw, None)
            assert repository.public_text(str(caught.value)).startswith(message)


def test_the_server_echoes_input_output_and_load_parameter_names_as_sent(repo, serve):
    # The same over the wire, for each kind of name a refusal echoes (the input's through the signature check).
    write_toy(repo.models_dir, "toy")
    server = serve(repo.write_config("- name: toy\n"),
                   manager=make_plugin_manager(load_entry_points=False, extra_plugins=(toy_backends,)))
    connection = http.client.HTTPConnection("127.0.0.1", server.server.http_port, timeout=30)

    def error_of(path: str, document: dict) -> tuple[int, str]:
        connection.request("POST", path, json.dumps(document))
        response = connection.getresponse()
        return response.status, json.loads(response.read())["error"]

    x = {"name": "input", "shape": [1, 4], "datatype": "FP32", "data": [0] * 4}
    for name in private_names(server.server.repository, "in"):
        assert error_of("/v2/models/toy/infer", {"inputs": [{**x, "name": name}]}) == (
            400, f"model 'toy': unexpected input '{name}' (expected inputs: 'input')")
        assert error_of("/v2/models/toy/infer", {"inputs": [x], "outputs": [{"name": name}]}) == (
            400, f"model 'toy': unknown requested output '{name}' (outputs: 'output')")
        key = f"file:{name}"[:64]  # (a refusal quotes a load parameter's first 64 characters)
        status, message = error_of("/v2/repository/models/toy/load", {"parameters": {key: ""}})
        assert status == 400 and message.startswith(f"model 'toy': load parameters '{key}' are not supported")
    connection.close()


def test_json_numbers_are_rounded_once_to_their_float_datatype():
    """BF16 went through float32 (two roundings: 1 + 2**-8 + 2**-40 became 1.0), and an integer from 2**63 up
    was a 500 (ml_dtypes takes no int past int64)."""
    just_above_a_tie = 1 + 2 ** -8 + 2 ** -40
    request, _ = decode_infer("m", body({"name": "x", "shape": [4], "datatype": "BF16",
                                         "data": [just_above_a_tie, -just_above_a_tie, 2 ** 63, 2 ** 64 - 1]}), None)
    assert request.inputs[0].data.astype(np.float64).tolist() == [1.0078125, -1.0078125, 2.0 ** 63, 2.0 ** 64]
    for dtype, value in (("FP16", 2 ** 15 + 1), ("FP32", 2 ** 64 - 1), ("FP64", 2 ** 64 - 1)):
        request, _ = decode_infer("m", body({"name": "x", "shape": [1], "datatype": dtype, "data": [value]}), None)
        assert request.inputs[0].data.astype(np.float64).tolist() == [
            float(np.float64(value).astype(request.inputs[0].data.dtype))]


def test_deep_nesting_is_flattened_without_recursion():
    for depth in (500, 100_000):
        data = b"[" * depth + b"1.0" + b"]" * depth
        raw = b'{"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": ' + data + b"}]}"
        try:
            request, _ = decode_infer("m", raw, None)
        except InvalidArgument as err:  # the JSON parser itself refuses such depth: a 400, never a crash
            assert depth > 500 and "depth limit exceeded" in str(err)
        else:
            assert request.inputs[0].data.tolist() == [1.0]


def test_encode_json_and_binary_outputs():
    response = InferResponse("m", [NamedTensor("y", DType.FP16, np.array([[0.5, 1.0]], np.float16)),
                                   NamedTensor("s", DType.BYTES, bytes_array([b"ok"], (1,)))], "id-1")
    parts, length = encode_infer(response, OutputChoice((), frozenset({"s"}), False))
    header = json.loads(parts[0])
    assert header["id"] == "id-1" and header["outputs"][0]["data"] == [0.5, 1.0]
    assert header["outputs"][1]["parameters"] == {"binary_data_size": 6} and length == len(parts[0])
    assert b"".join(bytes(p) for p in parts[1:]) == (2).to_bytes(4, "little") + b"ok"


def test_an_outputs_own_binary_data_overrides_binary_data_output():
    raw = body({"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}, parameters={"binary_data_output": True},
               outputs=[{"name": "a", "parameters": {"binary_data": False}}, {"name": "b"},
                        {"name": "c", "parameters": {"binary_data": True}}])
    _, choice = decode_infer("m", raw, None)
    assert [choice.is_binary(n) for n in "abc"] == [False, True, True]
    _, choice = decode_infer("m", body({"name": "x", "shape": [1], "datatype": "FP32", "data": [1]},
                                       outputs=[{"name": "a", "parameters": {"binary_data": False}}, {"name": "c",
                                                "parameters": {"binary_data": True}}]), None)
    assert [choice.is_binary(n) for n in "abc"] == [False, False, True]


def test_bytes_json_cannot_carry_ask_for_binary():
    tensor = NamedTensor("y", DType.BYTES, bytes_array([b"\xff"], (1,)))
    with pytest.raises(InvalidArgument, match="not UTF-8 text"):
        encode_infer(InferResponse("m", [tensor]), OutputChoice((), frozenset(), False))
    parts, length = encode_infer(InferResponse("m", [tensor]), OutputChoice((), frozenset(), True))
    assert length is not None


def test_nan_and_infinities_go_both_ways_as_the_literals_triton_reads_and_writes():
    """Found by a bug hunt: tritonclient.http sends a NaN or infinity of a JSON input as the NaN / Infinity
    literals (as Triton, which reads and writes them), and nereid refused the body as "not valid JSON" naming a
    parser position; an output holding one was refused with a 400 where Triton answers it."""
    import rapidjson  # what tritonclient.http reads and writes JSON with

    sent = np.array([np.nan, np.inf, -np.inf, 1.5], np.float32)
    inputs = [httpclient.InferInput("x", [4], "FP32")]
    inputs[0].set_data_from_numpy(sent, binary_data=False)
    raw, header_length = http_utils._get_inference_request(
        inputs=inputs, request_id="", outputs=None, sequence_id=0, sequence_start=False, sequence_end=False,
        priority=0, timeout=None, custom_parameters=None)
    assert header_length is None and b"[NaN,Infinity,-Infinity,1.5]" in raw.replace(b" ", b"")
    request, _ = decode_infer("m", raw, None)
    np.testing.assert_array_equal(request.inputs[0].data, sent)
    parts, length = encode_infer(InferResponse("m", [NamedTensor("y", DType.FP32, sent)]),
                                 OutputChoice((), frozenset(), False))
    assert length is None
    assert b'"data":[NaN,Infinity,-Infinity,1.5]' in parts[0]
    np.testing.assert_array_equal(rapidjson.loads(parts[0])["outputs"][0]["data"], sent)


@pytest.mark.parametrize("where", ["data", "parameters"])
def test_an_integer_too_large_for_a_double_beside_a_nan_literal_is_refused_as_without_it(where):
    """Found by the HTTP clients hunt: an integer of 309 digits or more in a body with a NaN literal raised
    OverflowError (a 500 and an ERROR traceback per request, counted nowhere), where without the NaN it is a 400."""
    huge = "1" + "0" * 400
    data, parameters = (f"[{huge}, NaN]", "{}") if where == "data" else ("[1, NaN]", f'{{"seed": {huge}}}')
    document = ('{"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": ' + data + '}], "parameters": '
                + parameters + '}').encode()
    with pytest.raises(InvalidArgument, match="not valid JSON") as refused:  # (orjson's reason: what it met first)
        decode_infer("m", document, None)
    if where == "data":
        assert "number is infinity when parsed as double" in str(refused.value)


@pytest.mark.parametrize("document", [
    b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [nan]}]}',  # not the literal's spelling
    b'{"inputs": [{"name": "\\ud800", "datatype": "FP32", "shape": [1], "data": [NaN]}]}',  # a lone surrogate
])
def test_with_the_nan_literals_the_rest_of_the_body_is_read_as_strictly(document):
    with pytest.raises(InvalidArgument, match="not valid JSON"):
        decode_infer("m", document, None)


def test_a_nan_literal_is_read_however_deep_the_body_nests_within_the_parsers_limit():
    """Found by a bug hunt: the check behind the literals (orjson.dumps) stops at 255 levels, so a body nested
    deeper with a NaN was refused as invalid JSON, blamed on the NaN, where the same body with 1.0 was read."""
    deep = 300
    body = ('{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": ' + "[" * deep + "NaN" + "]" * deep
            + '}], "parameters": {"' + "k" * 3 + '": {"\\ud800": 1}}}').encode()
    with pytest.raises(InvalidArgument, match="not valid JSON"):  # a lone surrogate in a key: still refused
        decode_infer("m", body, None)
    request = decode_infer("m", body.replace(b', "parameters": {"kkk": {"\\ud800": 1}}', b""), None)[0]
    assert np.isnan(request.inputs[0].data).all()


def test_a_value_past_the_datatype_is_refused_beside_an_infinity_sent_as_one():
    document = b'{"inputs": [{"name": "x", "datatype": "FP16", "shape": [2], "data": [Infinity, 70000]}]}'
    with pytest.raises(InvalidArgument, match="value 70000 does not fit FP16"):
        decode_infer("m", document, None)


def test_binary_data_without_its_header_length_is_told_so():
    """Found by a bug hunt: binary tensor data sent without Inference-Header-Content-Length got "not valid
    JSON (str is not valid UTF-8: surrogates not allowed: line 1 column 1 (char 0))", blaming a valid header."""
    header = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [16],
                                     "parameters": {"binary_data_size": 64}}]}).encode()
    for tail in (np.full(16, np.nan, np.float32).tobytes(), b"A" * 64):
        with pytest.raises(InvalidArgument) as refused:
            decode_infer("m", header + tail, None)
        assert str(refused.value) == (
            f"model 'm': the request body is a JSON document of {len(header)} bytes followed by 64 more bytes, and "
            f"has no Inference-Header-Content-Length header; binary tensor data needs "
            f"Inference-Header-Content-Length: {len(header)}")


@pytest.mark.parametrize("off_by", [-2, 4])
def test_a_header_length_off_from_the_json_header_s_is_told_so(off_by: int) -> None:
    """Found by the error hunt: Inference-Header-Content-Length counted in characters (a non-ASCII id takes more
    bytes), or too long, got "the request body is not valid JSON" of a valid document."""
    header = json.dumps({"id": "café-é", "inputs": [{"name": "x", "datatype": "FP32", "shape": [16],
                                                      "parameters": {"binary_data_size": 64}}]},
                        ensure_ascii=False).encode()
    with pytest.raises(InvalidArgument) as refused:
        decode_infer("m", header + b"A" * 64, len(header) + off_by)
    assert str(refused.value) == (
        f"model 'm': Inference-Header-Content-Length is {len(header) + off_by}, but the body starts with a JSON "
        f"document of {len(header)} bytes (the header's length counts its bytes, as UTF-8)")


def test_a_bad_json_header_s_length_is_looked_for_near_it_not_in_the_whole_body(monkeypatch) -> None:
    """Found by the review: the whole body, its binary data too, was decoded as text to find where the JSON
    ended, holding the GIL a second per 64 MiB refused."""
    from nereid.protocol import http_codec
    looked_at: list[int] = []
    leading = http_codec._leading_document_length
    monkeypatch.setattr(http_codec, "_leading_document_length", lambda body: looked_at.append(len(body)) or
                        leading(body))
    body = b'{"inputs": [},' + bytes(8 << 20)
    with pytest.raises(InvalidArgument, match="is not valid JSON"):
        decode_infer("m", body, 14)
    assert looked_at == [14 + http_codec.HEADER_LENGTH_SLACK]


def test_a_json_header_of_the_length_said_that_is_not_json_names_the_header() -> None:
    body = b'{"inputs": [}' + b"A" * 8
    with pytest.raises(InvalidArgument, match=r"^model 'm': the JSON header \(the body's first 13 bytes, as "
                                              r"Inference-Header-Content-Length says\) is not valid JSON \("):
        decode_infer("m", body, 13)


def test_a_refused_body_leaves_nothing_it_decoded_behind_in_its_traceback() -> None:
    """Defect: the error's traceback held the decode's frames, whose locals held every object parsed; through a
    cycle with the handler's future they stayed until the collector's next full pass (four 16 MiB bodies refused
    one after another held 1.1 GiB)."""
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [[1.0], [2.0], [3.0]]}]})
    with pytest.raises(InvalidArgument, match="'data' holds 3 elements, expected 2") as caught:
        decode_infer("m", body.encode(), None)
    frames, tb = [], caught.value.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert frames[-1] == "decode_infer" and "_json_array" not in frames, frames


def test_orjsons_allocation_failure_is_a_memory_error_not_invalid_json(monkeypatch) -> None:
    """Defect: orjson's "Not enough memory to allocate buffer for parsing" was answered 400 "not valid JSON"."""
    import orjson

    from nereid.protocol import http_codec

    def loads(data):
        raise orjson.JSONDecodeError("Not enough memory to allocate buffer for parsing", "", 0)

    monkeypatch.setattr(http_codec.orjson, "loads", loads)
    with pytest.raises(MemoryError, match="Not enough memory"):
        decode_infer("m", b'{"inputs": []}', None)


def _fp64_body(data: str, extra: str = "") -> bytes:
    return ('{"inputs": [{"name": "x", "datatype": "FP64", "shape": [2], "data": ' + data + '}]' + extra
            + '}').encode()


@pytest.mark.parametrize("document", [
    _fp64_body("[1e400, Infinity]"),  # a number past a double is no infinity literal
    _fp64_body("[1e400, 1]", ', "id": "NaN"'),  # "NaN" in a string let the rest be read leniently
    b"\xef\xbb\xbf" + _fp64_body("[1, NaN]"),  # a byte order mark
    _fp64_body("[1, NaN]").decode().encode("utf-16"),
])
def test_the_literals_are_the_only_leniency(document):
    """Found by a review: a body holding NaN or Infinity anywhere (a string included) was read again by
    json.loads, which also took a number past a double as infinity, a byte order mark, and UTF-16."""
    with pytest.raises(InvalidArgument, match="not valid JSON"):
        decode_infer("m", document, None)


def test_an_integer_past_64_bits_beside_a_literal_is_read_as_orjson_reads_it():
    """Found by a review: with a NaN in the data, a parameter of 2**64 failed the whole body as "not valid JSON"
    pointing at the NaN; orjson reads such an integer as a float, which the parameter's check names."""
    with pytest.raises(InvalidArgument, match="parameter 'timeout' must be a non-negative integer number of "
                                              "microseconds of at most 64 bits; got about 1.84467e"):
        decode_infer("m", _fp64_body("[1, NaN]", ', "parameters": {"timeout": 18446744073709551616}'), None)


@pytest.mark.parametrize("value, shown", [("NaN", "NaN"), ("Infinity", "Infinity"), ("-Infinity", "-Infinity")])
def test_a_parameter_sent_as_a_literal_is_quoted_as_sent(value, shown):
    """Found by a review: quoted through orjson, a NaN parameter read "got null"."""
    with pytest.raises(InvalidArgument, match=f"parameter 'priority' .*got {shown}$"):
        decode_infer("m", _fp64_body("[1, 2]", ', "parameters": {"priority": ' + value + '}'), None)


def test_large_json_outputs_are_written_a_chunk_at_a_time_into_the_same_answer(monkeypatch):
    """Found by the HTTP hunt: a 64 MB FP32 output answered as JSON cost about 1 GB (a list of Python floats,
    then its text), and held the GIL for its whole encode. Outputs past JSON_CHUNK_ELEMENTS are written a chunk at
    a time: the answer is the one the whole list made, NaN literals and binary outputs around it included."""
    from nereid.protocol import http_codec

    rng = np.random.default_rng(5)
    floats = rng.standard_normal(70).astype(np.float32)
    floats[33] = np.nan  # in the third chunk only
    outputs = [NamedTensor("f", DType.FP32, floats.reshape(7, 10)),
               NamedTensor("small", DType.INT32, np.arange(3, dtype=np.int32)),
               NamedTensor("h", DType.FP16, rng.standard_normal(41).astype(np.float16)),
               NamedTensor("b", DType.BF16, rng.standard_normal(17).astype(DType.BF16.numpy)),
               NamedTensor("raw", DType.INT64, np.arange(20, dtype=np.int64)),
               NamedTensor("s", DType.BYTES, bytes_array([f"é{i}".encode() for i in range(25)], (25,))),
               NamedTensor("flags", DType.BOOL, np.arange(30) % 3 == 0)]
    response = InferResponse("m", outputs, "req-7")
    choice = OutputChoice((), frozenset({"raw"}), False)
    whole_parts, whole_length = encode_infer(response, choice)  # (every output under the chunk size: one list)
    monkeypatch.setattr(http_codec, "JSON_CHUNK_ELEMENTS", 16)
    parts, length = encode_infer(response, choice)
    assert len(parts) > len(whole_parts) + 10  # chunked
    assert b"".join(parts) == b"".join(whole_parts) and length == whole_length
    assert b"NaN" in b"".join(parts[:-1])
    header = json.loads(b"".join(parts)[:length].decode())
    assert header["outputs"][0]["data"][33] != header["outputs"][0]["data"][33]  # NaN
    assert header["id"] == "req-7" and [o["name"] for o in header["outputs"]] == [o.name for o in outputs]


def test_a_text_like_the_placeholder_of_a_chunked_output_cannot_take_its_data(monkeypatch):
    """The hunt of the chunked answers: a BYTES output echoing the client's "\\0nereid-chunked-output-data-0\\0",
    written before a chunked output, was where that output's data went (and its own text into the other): the
    placeholder was a fixed text. It now holds a nonce of the answer's own."""
    from nereid.protocol import http_codec

    monkeypatch.setattr(http_codec, "JSON_CHUNK_ELEMENTS", 4)
    forged = f"{http_codec._PLACEHOLDER}0\0"
    outputs = [NamedTensor("echo", DType.BYTES, bytes_array([forged.encode()], (1,))),
               NamedTensor(forged, DType.INT32, np.arange(10, dtype=np.int32)),
               NamedTensor("big", DType.FP32, np.arange(10, dtype=np.float32))]
    parts, _ = encode_infer(InferResponse("m", outputs), OutputChoice((), frozenset(), False))
    answer = json.loads(b"".join(parts))
    assert [(o["name"], o["data"]) for o in answer["outputs"]] == [
        ("echo", [forged]), (forged, list(range(10))), ("big", [float(i) for i in range(10)])]


def test_a_request_with_several_bad_parameters_is_told_of_the_same_one_as_over_grpc():
    """HTTP checked the outputs first and the timeout last, gRPC the other way round: a request with two bad
    parameters was told of a different one over each protocol."""
    from nereid._proto import grpc_service_pb2 as pb
    from nereid.protocol.grpc_codec import decode_infer_request

    # Each bad, in the order both codecs check them; each request drops the first of the rest.
    bad = [("timeout", -5, pb.InferParameter(int64_param=-5)),
           ("sequence_id", True, pb.InferParameter(bool_param=True)),
           ("priority", -1, pb.InferParameter(int64_param=-1)),
           ("sequence_end", 7, pb.InferParameter(int64_param=7)),
           ("classification", -1, pb.InferParameter(int64_param=-1))]
    for start in range(len(bad)):
        json_parameters = {name: value for name, value, _ in bad[start:] if name != "classification"}
        output = {"name": "y"}
        grpc_request = pb.ModelInferRequest(model_name="m")
        grpc_request.inputs.add(name="x", datatype="FP32", shape=[1]).contents.fp32_contents.append(1.0)
        grpc_output = grpc_request.outputs.add(name="y")
        for name, value, parameter in bad[start:]:
            if name == "classification":
                output["parameters"] = {name: value}
                grpc_output.parameters[name].CopyFrom(parameter)
            else:
                grpc_request.parameters[name].CopyFrom(parameter)
        with pytest.raises(InvalidArgument) as over_http:
            decode_infer("m", body({"name": "x", "shape": [1], "datatype": "FP32", "data": [1]},
                                   parameters=json_parameters, outputs=[output]), None)
        with pytest.raises(InvalidArgument) as over_grpc:
            decode_infer_request(grpc_request, None)
        named = [re.search(r"parameter '(\w+)'", str(error.value)).group(1) for error in (over_http, over_grpc)]
        assert named == [bad[start][0]] * 2, (str(over_http.value), str(over_grpc.value))
