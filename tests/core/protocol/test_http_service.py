"""The KServe V2 REST endpoints against a real server: tritonclient.http (binary and JSON) and plain urllib."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from urllib.parse import quote
from typing import Any

import numpy as np
import pytest
import tritonclient.http as http
import tritonclient.http.aio as http_aio
from tritonclient.utils import InferenceServerException

from support import ECHO_MAIN, textproto_single, unreadable_chunked_infer, wait_until

SLOW_MAIN = '''
import os, sys, time
data = sys.stdin.buffer.read()
time.sleep(1)
with open(os.environ["NEREID_OUTPUT_PATH"], "wb") as out:
    out.write(("%s %s\\n" % (os.environ["NEREID_INPUT_DTYPE"], os.environ["NEREID_INPUT_SHAPE"])).encode() + data)
'''

FAILING_MAIN = "import sys\nsys.stderr.write('broken on purpose')\nsys.exit(3)\n"


@pytest.fixture
def served(repo, serve):
    """A server with an FP32 echo, a BYTES echo, a slow echo and a failing model; its HTTP base URL."""
    repo.python("echo")
    repo.python("words", main=ECHO_MAIN, textproto=textproto_single("BYTES", input_shape="[2]"))
    repo.python("slow", main=SLOW_MAIN)
    repo.python("failing", main=FAILING_MAIN)
    server = serve(repo.write_config())
    return server, f"127.0.0.1:{server.server.http_port}"


def call(base: str, method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, bytes, Any]:
    """A plain HTTP request, as curl would send it; (status, body, headers)."""
    request = urllib.request.Request(f"http://{base}{path}", data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read(), response.headers  # case-insensitive
    except urllib.error.HTTPError as err:
        return err.code, err.read(), err.headers


def error_of(status_body: tuple[int, bytes, dict]) -> tuple[int, str]:
    status, body, _ = status_body
    return status, json.loads(body)["error"]


def test_health_metadata_config_with_tritonclient(served):
    server, base = served
    client = http.InferenceServerClient(base)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("echo")
    metadata = client.get_server_metadata()
    assert metadata["name"] == "nereid" and "model_repository" in metadata["extensions"]
    model = client.get_model_metadata("echo")
    assert model["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 4]}]
    assert model["versions"] == ["1"] and model["platform"] == "nereid_python"
    config = client.get_model_config("echo")
    assert config["max_batch_size"] == 8 and config["input"][0] == {"name": "input", "data_type": "TYPE_FP32",
                                                                      "dims": [4]}
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 0
    assert config["instance_group"][0]["kind"] == "KIND_CPU"
    assert config["instance_group"][0]["name"] == f"{config['name']}_0"  # as Triton names an unnamed group
    assert call(base, "GET", "/v2/models/echo/versions/1/ready")[0] == 200
    # Triton's statuses with KServe's JSON bodies, which the KServe SDK's REST client reads
    for path, answer in (("/v2/health/live", {"live": True}), ("/v2/health/ready", {"ready": True}),
                         ("/v2/models/echo/ready", {"name": "echo", "ready": True})):
        status, raw, headers = call(base, "GET", path)
        assert (status, json.loads(raw), headers["Content-Type"]) == (200, answer, "application/json"), path
    assert error_of(call(base, "GET", "/v2/models/echo/versions/2")) == (
        404, "model 'echo' has no version '2' (nereid serves version 1)")
    assert error_of(call(base, "GET", "/v2/models/nope"))[0] == 404
    assert call(base, "GET", "/v2/models/nope")[2]["Content-Type"] == "application/json"  # errors too
    # An empty version in the path is a client's slip, not the default version (it was served as one).
    assert error_of(call(base, "POST", "/v2/models/echo/versions//infer", b'{"inputs": []}')) == (
        404, "model 'echo': the path names an empty version (/v2/models/echo/versions//infer); give one (1) or "
             "leave out /versions/")
    # A version left out before the action was read as the version "infer" (405, "use GET": the metadata path).
    assert error_of(call(base, "POST", "/v2/models/echo/versions/infer", b'{"inputs": []}')) == (
        404, "model 'echo': the path names no version before /infer (/v2/models/echo/versions/infer); give one "
             "(.../versions/1/infer) or leave out /versions/")
    assert error_of(call(base, "GET", "/v2/models/echo/versions/ready"))[0] == 404
    # A path naming a version twice is no endpoint (a bug hunt: 405 "GET is not allowed ... (use GET)").
    for method, path in (("GET", "/v2/models/echo/versions/1/versions/1"),
                         ("GET", "/v2/models/echo/versions/1/versions/1/config"),
                         ("POST", "/v2/models/echo/versions/1/versions/1/infer")):
        assert error_of(call(base, method, path, b"{}" if method == "POST" else None)) == (
            404, f"no such endpoint: {method} {path}"), path
    # An unknown model or version is not ready (Triton's 400), not missing, as gRPC's ModelReady answers it.
    for path, name in (("/v2/models/nope/ready", "nope"), ("/v2/models/echo/versions/2/ready", "echo")):
        status, raw, _ = call(base, "GET", path)
        assert (status, json.loads(raw)) == (400, {"name": name, "ready": False}), path
    # Triton's generate extension is refused as the other unimplemented extensions are: 501, naming it.
    for path in ("/v2/models/echo/generate", "/v2/models/echo/generate_stream"):
        status, message = error_of(call(base, "POST", path, b"{}"))
        assert status == 501 and "generate extension" in message, path


@pytest.mark.parametrize("binary", [True, False])
def test_infer_binary_and_json(served, binary):
    _, base = served
    client = http.InferenceServerClient(base)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    tensor = http.InferInput("input", [2, 4], "FP32")
    tensor.set_data_from_numpy(x, binary_data=binary)
    result = client.infer("echo", [tensor], outputs=[http.InferRequestedOutput("output", binary_data=binary)],
                          request_id="abc")
    np.testing.assert_array_equal(result.as_numpy("output"), x)
    assert result.get_response()["id"] == "abc"
    words = http.InferInput("input", [1, 2], "BYTES")
    words.set_data_from_numpy(np.array([["héllo", "wörld"]], dtype=object), binary_data=binary)
    answer = client.infer("words", [words], outputs=[http.InferRequestedOutput("output", binary_data=binary)])
    got = [e.decode() if isinstance(e, bytes) else e for e in answer.as_numpy("output").reshape(-1)]
    assert got == ["héllo", "wörld"]  # binary: bytes; JSON: strings, as tritonclient gives them


@pytest.mark.parametrize("binary_input", [False, True])
def test_tritonclient_http_aio_with_json_and_binary_inputs(served, binary_input):
    # The aio client labels every body application/octet-stream, also one whose tensors are all JSON
    # (then without Inference-Header-Content-Length): the body is the JSON document.
    _, base = served
    x = np.arange(4, dtype=np.float32).reshape(1, 4)

    async def scenario():
        client = http_aio.InferenceServerClient(base)
        try:
            tensor = http_aio.InferInput("input", [1, 4], "FP32")
            tensor.set_data_from_numpy(x, binary_data=binary_input)
            result = await client.infer("echo", [tensor], outputs=[http_aio.InferRequestedOutput("output",
                                                                                                 binary_data=False)])
            return result.as_numpy("output")
        finally:
            await client.close()
    np.testing.assert_array_equal(asyncio.run(scenario()), x)


JSON_VALUES = {
    "BOOL": [True, False, True, False], "INT8": [-128, 0, 1, 127], "UINT8": [0, 1, 2, 255],
    "INT16": [-3, 0, 3, 32767], "UINT16": [0, 1, 2, 65535], "INT32": [-1, 0, 1, 2147483647],
    "UINT32": [0, 1, 2, 4294967295], "INT64": [-(2**62), 0, 1, 2**62], "UINT64": [0, 1, 2, 2**63],
    "FP16": [0.5, -1.0, 2.0, 1024.0], "FP32": [0.25, -1.5, 3.0, 65536.0], "FP64": [1e-300, -2.0, 3.5, 1e300],
}


def test_every_json_datatype_round_trips_as_plain_json(repo, serve):
    for datatype in JSON_VALUES:
        repo.python(datatype.lower(), textproto=textproto_single(datatype))
    server = serve(repo.write_config())
    base = f"127.0.0.1:{server.server.http_port}"
    for datatype, values in JSON_VALUES.items():
        nested = [[values[0], values[1]], [values[2], values[3]]]  # nested lists, as numpy's tolist() gives
        body = json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": datatype, "data": nested}]})
        status, raw, headers = call(base, "POST", f"/v2/models/{datatype.lower()}/infer", body.encode(),
                                    {"Content-Type": "application/json"})
        assert status == 200, raw
        output = json.loads(raw)["outputs"][0]
        assert output == {"name": "output", "datatype": datatype, "shape": [1, 4], "data": values}
        assert headers["Content-Type"] == "application/json"


def test_outputs_selection_binary_data_output_and_timeout(served):
    server, base = served
    header = json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                                     "parameters": {"binary_data_size": 16}}],
                         "parameters": {"binary_data_output": True}}).encode()
    body = header + np.ones(4, np.float32).tobytes()
    status, raw, headers = call(base, "POST", "/v2/models/echo/infer", body,
                                {"Inference-Header-Content-Length": str(len(header)),
                                 "Content-Type": "application/octet-stream"})
    assert status == 200
    length = int(headers["Inference-Header-Content-Length"])
    response = json.loads(raw[:length])
    assert response["outputs"][0]["parameters"] == {"binary_data_size": 16}
    assert np.frombuffer(raw[length:], np.float32).tolist() == [1.0] * 4
    # a request whose timeout passes while it waits behind a running one: 504, as for a gRPC deadline
    plain = {"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
    busy = threading.Thread(target=call, args=(base, "POST", "/v2/models/slow/infer", json.dumps(plain).encode()))
    busy.start()
    # Running (the review of the tests: after a fixed sleep, the timed request could find the instance idle).
    slow = server.server.repository.ready_model("slow").scheduler
    assert wait_until(lambda: slow.running_threads == 1)
    timed = json.dumps({**plain, "parameters": {"timeout": 100_000}}).encode()
    status, message = error_of(call(base, "POST", "/v2/models/slow/infer", timed))
    busy.join()
    assert status == 504 and "deadline" in message.lower(), message
    # Triton's classification extension, as tritonclient asks for it, in binary and in JSON
    client = http.InferenceServerClient(base)
    tensor = http.InferInput("input", [2, 4], "FP32")
    tensor.set_data_from_numpy(np.array([[0.5, 0.25, 0.125, 2.0], [1, 2, 3, 4]], np.float32))
    for binary in (True, False):
        result = client.infer("echo", [tensor], outputs=[http.InferRequestedOutput("output", binary, class_count=3)])
        classes = [[e.decode() if binary else e for e in row] for row in result.as_numpy("output").tolist()]
        assert classes == [["2.000000:3", "0.500000:0", "0.250000:1"], ["4.000000:3", "3.000000:2", "2.000000:1"]]
    negative = json.dumps({**plain, "outputs": [{"name": "output", "parameters": {"classification": -1}}]}).encode()
    assert error_of(call(base, "POST", "/v2/models/echo/infer", negative)) == (
        400, "model 'echo': output 'output': parameter 'classification' must be a non-negative integer count of "
             "classes, got -1")
    unknown = json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}],
                          "outputs": [{"name": "nope"}]}).encode()
    assert error_of(call(base, "POST", "/v2/models/echo/infer", unknown)) == (
        400, "model 'echo': unknown requested output 'nope' (outputs: 'output')")


BAD_REQUESTS = [
    ("malformed JSON", b"{not json", {}, 400, "the request body is not valid JSON"),
    ("wrong content type", b"{}", {"Content-Type": "text/plain"}, 400, "Content-Type 'text/plain' is not accepted"),
    ("compressed with a coding Triton does not take", b"{}", {"Content-Encoding": "br"}, 400,
     "Content-Encoding 'br' is not supported: send the body uncompressed, or compressed once, with gzip or deflate"),
    ("binary size that does not add up",
     json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                             "parameters": {"binary_data_size": 64}}]}).encode() + b"\0" * 16,
     {"binary": "1"}, 400, "binary_data_size is 64, but only 16 bytes of binary data are left"),
    ("binary bytes left over",
     json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                             "parameters": {"binary_data_size": 16}}]}).encode() + b"\0" * 20,
     {"binary": "1"}, 400, "carries 20 bytes of binary data after its JSON header"),
    ("wrong element count", json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                                                     "data": [1, 2, 3]}]}).encode(), {}, 400,
     "'data' holds 3 elements, expected 4 for shape [1, 4]"),
    ("number out of range", json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                                                     "data": [1, 2, 3, 1e39]}]}).encode(), {}, 400,
     "value 1e+39 does not fit FP32"),
    # Refused as its datatype is read, before its data is (its 300 would not fit INT8 either).
    ("datatype mismatch", json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "INT8",
                                                   "data": [1, 2, 3, 300]}]}).encode(), {}, 400,
     "model 'echo': input 'input' has datatype INT8, expected FP32"),
    ("wrong shape for the model", json.dumps({"inputs": [{"name": "input", "shape": [1, 5], "datatype": "FP32",
                                                           "data": [1, 2, 3, 4, 5]}]}).encode(), {}, 400,
     "model 'echo'"),
]


def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(served):
    _, base = served
    for case, body, headers, status, fragment in BAD_REQUESTS:
        if "binary" in headers:
            header_length = body.index(b"}]}") + 3
            headers = {"Inference-Header-Content-Length": str(header_length),
                       "Content-Type": "application/octet-stream"}
        got_status, message = error_of(call(base, "POST", "/v2/models/echo/infer", body, headers))
        assert got_status == status and fragment in message, (case, message)
        assert call(base, "GET", "/v2/health/live")[0] == 200


CONSTANT_MAIN = '''
import os
with open(os.environ["NEREID_OUTPUT_PATH"], "wb") as out:
    out.write(b"float32 1,3\\n" + bytes(__import__("array").array("f", [1, 2, 3])))
'''


def test_an_unreadable_body_to_a_model_not_ready_is_counted_as_the_400_it_was_answered(repo, serve):
    """From the hunt of the not-ready paths: a chunked body whose bad chunk came in the same read as its head got
    the HTTP parser's 400, but was counted "unavailable" (the readiness check ran after the listener answered)."""
    from support import scrape

    repo.add("broken", "input_shape: [4\n", main_py="print()")  # fails to load
    server = serve(repo.write_config())
    answer = unreadable_chunked_infer(server.server.http_port, "broken")
    assert answer.startswith(b"HTTP/1.1 400 "), answer
    outcomes = {dict(labels)["outcome"]: value for (name, labels), value in scrape(server.server.metrics_port).items()
                if name == "nereid_protocol_requests_total" and dict(labels)["model"] == "broken"}
    assert outcomes == {"invalid_argument": 1}, outcomes  # (as a 400 for a model that is READY is counted)


def test_a_model_without_inputs_is_called_with_an_empty_inputs_list(repo, serve):
    repo.python("constant", main=CONSTANT_MAIN, textproto="output_shape: [3]\nmax_batch_size: 4\n")
    repo.python("echo")
    server = serve(repo.write_config())
    base = f"127.0.0.1:{server.server.http_port}"
    client = http.InferenceServerClient(base)
    assert client.infer("constant", []).as_numpy("output").tolist() == [1, 2, 3]  # sends "inputs": []
    status, message = error_of(call(base, "POST", "/v2/models/echo/infer", b'{"inputs": []}'))
    assert status == 400 and "model 'echo'" in message and "'input'" in message, message


def test_extensions_nereid_does_not_implement_are_501_by_name(served):
    _, base = served
    client = http.InferenceServerClient(base)
    for call, extension in ((client.get_system_shared_memory_status, "system_shared_memory"),
                            (lambda: client.unregister_cuda_shared_memory("r"), "cuda_shared_memory"),
                            (client.get_trace_settings, "trace"), (lambda: client.get_trace_settings("echo"), "trace"),
                            (client.get_log_settings, "logging")):
        with pytest.raises(InferenceServerException) as caught:
            call()
        assert caught.value.status() == "501", caught.value
        assert f"nereid does not implement Triton's {extension} extension" in caught.value.message()
    assert client.is_server_live()


def test_statuses_of_model_errors(served):
    server, base = served
    body = json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                                   "data": [1, 2, 3, 4]}]}).encode()
    status, message = error_of(call(base, "POST", "/v2/models/failing/infer", body))
    assert status == 500 and "model 'failing' exited with code 3" in message and "broken on purpose" in message
    assert error_of(call(base, "POST", "/v2/models/nope/infer", body))[0] == 404
    status, raw, headers = call(base, "POST", "/v2/repository/models/echo/unload", b"")
    # Triton answers a load or unload with an empty body, which is no JSON document.
    assert (status, raw, headers["Content-Length"], headers["Content-Type"]) == (200, b"", "0", None)
    status, message = error_of(call(base, "POST", "/v2/models/echo/infer", body))
    assert status == 503 and "model 'echo' is not ready" in message
    status, raw, _ = call(base, "GET", "/v2/models/echo/ready")
    assert (status, json.loads(raw)) == (400, {"name": "echo", "ready": False})
    assert call(base, "POST", "/v2/repository/models/echo/load", b"")[0] == 200
    assert call(base, "POST", "/v2/models/echo/infer", body)[0] == 200


def test_oversized_and_truncated_bodies(repo, serve):
    repo.python("echo")
    server = serve(repo.write_config(server_extra="  max_message_bytes: 4096\n"))
    base = f"127.0.0.1:{server.server.http_port}"
    status, message = error_of(call(base, "POST", "/v2/models/echo/infer", b" " * 5000,
                                    {"Content-Type": "application/json"}))
    assert status == 413 and "the request body is 5000 bytes; the limit is 4096 (server.max_message_bytes)" in message
    # A client that promises 1000 bytes, sends 10 and goes away: nothing to answer, and the server goes on.
    with socket.create_connection(("127.0.0.1", server.server.http_port)) as raw:
        raw.sendall(b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n0123456789")
    assert call(base, "GET", "/v2/health/live")[0] == 200


def _answer_on(connection: socket.socket) -> tuple[bytes, bytes]:
    """One answer read off a raw connection: (its status line and headers, its body by its content-length)."""
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = connection.recv(65536)
        assert chunk, f"the connection closed after {received!r}"
        received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    length = re.search(rb"\r\ncontent-length: (\d+)", head, re.IGNORECASE)
    while length is not None and len(body) < int(length.group(1)):
        body += connection.recv(65536)
    return head, body


def test_an_expect_100_continue_request_answered_before_its_body_closes_its_connection(repo, serve):
    """A request with Expect: 100-continue refused before its body was asked for (413, a Content-Type or a
    Content-Encoding refused) kept its connection open without saying so: its client, which need not send the
    body then, sent its next request there, the server read it as the missing body, and it hung."""
    repo.python("echo")
    server = serve(repo.write_config(server_extra="  max_message_bytes: 4096\n"))
    port = server.server.http_port
    infer = b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
    for headers, status, message in [
        (b"Content-Type: application/json\r\nContent-Length: 5000", 413, "the request body is 5000 bytes"),
        (b"Content-Type: text/plain\r\nContent-Length: 50", 400, "Content-Type 'text/plain' is not accepted"),
        (b"Content-Encoding: br\r\nContent-Length: 50", 400, "Content-Encoding 'br' is not supported"),
    ]:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as connection:
            connection.sendall(infer + headers + b"\r\n\r\n")
            head, body = _answer_on(connection)
            assert head.startswith(b"HTTP/1.1 %d " % status) and b"\r\nconnection: close" in head, head
            assert message in json.loads(body)["error"]
            try:
                closed = connection.recv(1) == b""
            except TimeoutError:
                closed = False
            assert closed, f"{headers!r}: the connection stayed open after {head!r}"
    body = json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                                   "data": [1, 2, 3, 4]}]}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as connection:
        # Its body asked for (100 Continue), sent, and answered: the connection serves on.
        connection.sendall(infer + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
        assert _answer_on(connection) == (b"HTTP/1.1 100 Continue", b"")
        connection.sendall(body)
        assert _answer_on(connection)[0].startswith(b"HTTP/1.1 200 OK\r\n")
        # Refused, its body sent along without waiting (all of it read): the connection serves on too.
        connection.sendall(infer + b"Content-Type: text/plain\r\nContent-Length: 5\r\n\r\nhello")
        head, _ = _answer_on(connection)
        assert head.startswith(b"HTTP/1.1 400 ") and b"connection: close" not in head, head
        connection.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _answer_on(connection)[0].startswith(b"HTTP/1.1 200 OK\r\n")


def test_a_model_named_stats_has_its_metadata_under_its_version(repo, serve):
    # /v2/models/stats is every model's statistics (the README says where a model of that name has its metadata).
    repo.python("stats")
    server = serve(repo.write_config())
    base = f"127.0.0.1:{server.server.http_port}"
    status, body, _ = call(base, "GET", "/v2/models/stats/versions/1")
    assert status == 200 and json.loads(body)["name"] == "stats"
    status, body, _ = call(base, "GET", "/v2/models/stats")
    assert status == 200 and [s["name"] for s in json.loads(body)["model_stats"]] == ["stats"]


def test_stats_index_and_repository_control(repo, serve):
    repo.python("echo")
    repo.python("other")
    server = serve(repo.write_config("- name: echo\n"))
    base = f"127.0.0.1:{server.server.http_port}"
    client = http.InferenceServerClient(base)
    tensor = http.InferInput("input", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
    client.infer("echo", [tensor])
    stats = client.get_inference_statistics("echo")["model_stats"][0]
    assert stats["name"] == "echo" and stats["inference_count"] == 1 and stats["inference_stats"]["success"]["count"]
    # Triton's fields, the response cache's included (nereid has none: zeros), as a client written against it reads
    assert sorted(stats["inference_stats"]) == ["cache_hit", "cache_miss", "compute_infer", "compute_input",
                                                "compute_output", "fail", "queue", "success"]
    assert stats["inference_stats"]["cache_hit"] == stats["inference_stats"]["cache_miss"] == {"count": 0, "ns": 0}
    assert stats["memory_usage"] == []  # (the HTTP hunt: Triton 2.41's document has the list; it was missing)
    assert [s["name"] for s in client.get_inference_statistics()["model_stats"]] == ["echo"]
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert {name: m["state"] for name, m in index.items()} == {"echo": "READY", "other": "UNAVAILABLE"}
    # An empty reason is left out, as Triton writes the index (the Triton client hunt: "reason": "").
    assert "reason" not in index["echo"] and index["other"]["reason"]
    status, body, _ = call(base, "POST", "/v2/repository/index", b'{"ready": true}')
    assert (status, [m["name"] for m in json.loads(body)]) == (200, ["echo"])
    for ready in (b"1", b'"yes"', b"null"):  # Defect: taken for false, so every model was listed
        assert error_of(call(base, "POST", "/v2/repository/index", b'{"ready": ' + ready + b"}")) == (
            400, f"the repository index request: 'ready' must be true or false, got {ready.decode()}")
    client.load_model("other")
    assert client.is_model_ready("other")
    client.unload_model("other")
    assert not client.is_model_ready("other")
    # Triton's load overrides are refused with the reason, not silently ignored.
    with pytest.raises(InferenceServerException) as caught:
        client.load_model("other", config='{"max_batch_size": 4}')
    assert caught.value.status() == "400" and "load parameters 'config' are not supported" in caught.value.message()
    status, message = error_of(call(base, "POST", "/v2/repository/models/echo/unload",
                                    b'{"parameters": {"unload_dependents": "yes"}}'))
    assert status == 400 and "'unload_dependents' must be true or false, got \"yes\"" in message
    status, message = error_of(call(base, "POST", "/v2/repository/models/echo/load", b'{"parameters": [1]}'))
    assert status == 400 and "model 'echo': the load request: 'parameters' must be a JSON object" in message
    assert client.is_model_ready("echo") and not client.is_model_ready("other")
    samples = urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics").read().decode()
    assert 'nereid_protocol_requests_total{model="echo",outcome="success",protocol="http"} 1.0' in samples


def test_a_client_s_load_and_unload_are_logged_with_who_asked(repo, serve, caplog):
    """Found by the log hunt: a model unloaded (or loaded) by a client left lines that read as a change nobody
    made, with no word of the call or the client, over either protocol."""
    repo.python("echo")
    server = serve(repo.write_config())
    caplog.set_level(logging.INFO, logger="nereid.dataplane")
    http.InferenceServerClient(f"127.0.0.1:{server.server.http_port}").unload_model("echo")
    server.client.load_model("echo")
    asked = [r.getMessage() for r in caplog.records if r.name == "nereid.dataplane" and " asked by " in r.getMessage()]
    assert len(asked) == 2, asked
    assert re.fullmatch(r"POST /v2/repository/models/\.\.\./unload of model 'echo' asked by 127\.0\.0\.1:\d+", asked[0])
    assert re.fullmatch(r"RepositoryModelLoad of model 'echo' asked by (ipv4:)?127\.0\.0\.1:\d+", asked[1]), asked[1]


def test_repository_control_off_is_403(repo, serve):
    repo.python("echo")
    server = serve(repo.write_config(server_extra="  repository_control: false\n"))
    client = http.InferenceServerClient(f"127.0.0.1:{server.server.http_port}")
    with pytest.raises(InferenceServerException) as caught:
        client.unload_model("echo")
    # Found by the error hunt: the gRPC method's name, and no model, were said.
    assert caught.value.status() == "403" and caught.value.message() == (
        "model 'echo': POST /v2/repository/models/.../unload is turned off on this server "
        "(server.repository_control: false)")


def test_a_web_pages_repository_load_or_unload_is_403(repo, serve):
    """Defect: any web page the server's user opened could unload (or load) models through the loopback port,
    where repository control is on by default: a form POST needs no CORS preflight, so the browser sent it."""
    repo.python("echo")
    server = serve(repo.write_config())
    base = f"127.0.0.1:{server.server.http_port}"
    page = {"Origin": "https://evil.example", "Content-Type": "application/x-www-form-urlencoded"}
    for action in ("unload", "load"):
        status, message = error_of(call(base, "POST", f"/v2/repository/models/echo/{action}", b"", page))
        assert status == 403 and message == (f"model 'echo': a repository {action} from a web page (Origin: "
                                             "'https://evil.example') is refused; send it from a client that is "
                                             "not a browser"), message
    assert server.server.repository.entry("echo").state.value == "READY"  # still loaded
    assert call(base, "POST", "/v2/repository/models/echo/unload", b"")[0] == 200  # curl's, without Origin


def read_response(connection: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (fails after 10 s)."""
    connection.settimeout(10)
    received = b""
    while chunk := connection.recv(65536):
        received += chunk
    return received


def test_headers_past_the_head_limit_are_431_and_the_server_keeps_serving(served):
    """One endless header was buffered whole (256 MiB sent 1 MiB at a time: RSS 269 -> 728 MiB)."""
    from nereid.protocol.http_listener import MAX_HEAD_BYTES

    server, base = served
    start = b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nX-Big: "
    with socket.create_connection(("127.0.0.1", server.server.http_port)) as raw:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        raw.sendall(start)
        sent = len(start)
        while sent <= MAX_HEAD_BYTES:  # in pieces read one by one: the bound counts across reads
            piece = b"a" * min(4096, MAX_HEAD_BYTES + 1 - sent)
            raw.sendall(piece)
            sent += len(piece)
            time.sleep(0.002)
        answer = read_response(raw)
    assert answer.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
    assert answer.endswith(b'{"error":"the request line and headers exceed 65536 bytes"}')
    assert call(base, "GET", "/v2/health/live")[0] == 200


def test_heads_within_the_limit_are_served_when_they_share_reads_with_bodies(served):
    """Heads near the bound, and a head whose read also carries a large body, are not mistaken for long heads."""
    from nereid.protocol.http_listener import MAX_HEAD_BYTES

    server, _ = served
    document = b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}'
    body = document + b" " * (1 << 20)  # one sendall: the head and 256 KiB reads of body arrive together
    head = (b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n" % len(body))
    padding = b"X-Pad: " + b"p" * (MAX_HEAD_BYTES - len(head) - len(b"X-Pad: \r\n\r\n")) + b"\r\n"
    request = head + padding + b"\r\n"
    assert len(request) == MAX_HEAD_BYTES
    with socket.create_connection(("127.0.0.1", server.server.http_port)) as raw:
        for _ in range(2):  # two on one connection: the bound starts again with each request
            raw.sendall(request + body)
            status, rest = raw.recv(65536).split(b"\r\n", 1)
            assert status == b"HTTP/1.1 200 OK", rest
            while b'"data":[1.0,2.0,3.0,4.0]' not in rest:
                rest += raw.recv(65536)
        raw.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert read_response(raw).startswith(b"HTTP/1.1 200 OK\r\n")


RUN_LOGGING_MAIN = '''
import os, struct, sys, time
data = sys.stdin.buffer.read()
with open("runs.log", "a") as runs:
    runs.write("%g\\n" % struct.unpack("<f", data[:4]))
while not os.path.exists("go"):  # held until the test lets it finish
    time.sleep(0.01)
with open(os.environ["NEREID_OUTPUT_PATH"], "wb") as out:
    out.write(("%s %s\\n" % (os.environ["NEREID_INPUT_DTYPE"], os.environ["NEREID_INPUT_SHAPE"])).encode() + data)
'''


@pytest.mark.parametrize("padding", [0, 300_000])
def test_a_client_that_disconnects_while_queued_has_its_request_dropped(repo, serve, padding):
    # As over gRPC, where the client's cancellation reaches its queued request. (With a body past uvicorn's
    # 64 KiB high-water mark, its reading stayed paused once the body was complete, and the client's close went
    # unseen: the request ran, counted a success; the HTTP read hunt.)
    folder = repo.python("logged", main=RUN_LOGGING_MAIN)
    server = serve(repo.write_config('- name: "logged"\n  batching: {enabled: false}\n'))
    port = server.server.http_port
    scheduler = server.server.repository.ready_model("logged").scheduler

    def request(value: float) -> bytes:
        payload = json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                                          "data": [value, 0, 0, 0]}]}).encode() + b" " * padding
        return (b"POST /v2/models/logged/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(payload) + payload)

    def post(value: float) -> socket.socket:
        raw = socket.create_connection(("127.0.0.1", port))
        raw.sendall(request(value))
        return raw

    running = post(1)
    assert wait_until(lambda: (folder / "runs.log").is_file())  # running now, held until "go"
    queued = post(2)
    pipelined = post(3)
    assert wait_until(lambda: scheduler.queue_depth == 2)  # 2 and 3
    # Defect: the one answered first was never told its connection had gone. And a flaky one: a request
    # pipelined behind it once its handler had read its body stopped the server reading that connection
    # (uvicorn waits for the answer before it reads the next request), so its close went unseen and 3 ran.
    pipelined.sendall(request(4))
    time.sleep(0.2)  # its head read
    queued.close()  # gone while queued
    pipelined.close()
    assert wait_until(lambda: scheduler.queue_depth == 0, timeout_s=5)  # dropped, not run
    (folder / "go").write_text("")
    assert running.recv(65536).startswith(b"HTTP/1.1 200")
    running.close()
    time.sleep(0.3)  # the instance has been free long enough to have run anything left
    assert (folder / "runs.log").read_text().split() == ["1"]
    stats = http.InferenceServerClient(f"127.0.0.1:{port}").get_inference_statistics("logged")["model_stats"][0]
    assert stats["inference_stats"]["success"]["count"] == 1  # the dropped requests are no success
    assert stats["inference_stats"]["fail"]["count"] == 2  # each cancelled, once (the 4th never started)


def test_a_request_whose_connection_was_lost_before_it_reached_the_model_never_runs_and_counts_once(served):
    """A connection lost after the body was read and before the handler reached the model: the request is not
    run; it counted in /metrics but not in the model's statistics (a regression of that check)."""
    from nereid.protocol.http_service import HttpSurface

    server, _ = served
    body = json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                                   "data": [1, 2, 3, 4]}]}).encode()

    class LostCycle:  # uvicorn's request cycle, its connection already lost
        disconnected = True

        async def receive(self):
            return {"type": "http.request", "body": body, "more_body": False}

    sent: list = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v2/models/echo/infer",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    surface = HttpSurface(server.server.dataplane, 1 << 20)
    server.call(surface(scope, LostCycle().receive, send))
    assert sent == []  # no one to answer
    stats = server.server.repository.ready_model("echo").stats
    assert (stats.success.count, stats.fail.count, stats.failures_by_reason) == (0, 1, {"cancelled": 1})


def test_a_body_refused_while_decoding_counts_as_the_models_failure(served):
    server, base = served
    wrong = json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3]}]})
    status, message = error_of(call(base, "POST", "/v2/models/echo/infer", wrong.encode()))
    assert status == 400 and "'data' holds 3 elements, expected 4" in message
    stats = http.InferenceServerClient(base).get_inference_statistics("echo")["model_stats"][0]
    assert stats["inference_stats"]["fail"]["count"] == 1
    # Defects: refused by the HTTP layer before decoding (a Content-Type, an encoding), or by the encoding of
    # its answer (infinity as JSON) after the model ran, a request counted nowhere, or as a success.
    right = json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]})
    header = json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                                     "parameters": {"binary_data_size": 16}}]}).encode()
    refusals = [
        ({"Content-Type": "text/plain"}, right.encode(), "Content-Type 'text/plain' is not accepted"),
        ({"Content-Encoding": "br"}, right.encode(), "Content-Encoding 'br' is not supported"),
        ({"Content-Encoding": "gzip"}, right.encode(), "the request body is not valid gzip data"),
        ({"Inference-Header-Content-Length": "0"}, right.encode(), "Inference-Header-Content-Length 0"),
        # Digits only: int() took "+148" and "1_0", and "-5" was told it did not match the body.
        *(({"Inference-Header-Content-Length": value, "Content-Type": "application/octet-stream"}, header,
           f"Inference-Header-Content-Length must be a whole number of bytes (digits only), got {value!r}")
          for value in (f"+{len(header)}", f"{len(header) // 10}_{len(header) % 10}", "-5")),
        # From the HTTP hunt: a 30-digit length was told it must be "digits only".
        ({"Inference-Header-Content-Length": "1" * 30, "Content-Type": "application/octet-stream"}, header,
         f"Inference-Header-Content-Length {'1' * 30} has 30 digits, more than any request body's length"),
        # Found by a README check: a length past the body's was a 413 saying the JSON part "is" that long.
        ({"Inference-Header-Content-Length": "1000000000", "Content-Type": "application/octet-stream"}, header,
         f"Inference-Header-Content-Length is 1000000000, but the body has {len(header)} bytes (Content-Length)"),
    ]
    for headers, body, expected in refusals:
        status, message = error_of(call(base, "POST", "/v2/models/echo/infer", body, headers))
        assert status == 400 and expected in message, message
    stats = http.InferenceServerClient(base).get_inference_statistics("echo")["model_stats"][0]
    assert stats["inference_stats"]["fail"]["count"] == 1 + len(refusals)
    assert stats["inference_stats"]["success"]["count"] == 0
    # An output JSON cannot carry (bytes that are not UTF-8), found after the model ran.
    words = json.dumps({"inputs": [{"name": "input", "shape": [1, 2], "datatype": "BYTES",
                                    "parameters": {"binary_data_size": 10}}]}).encode()
    status, message = error_of(call(base, "POST", "/v2/models/words/infer", words + b"\x01\x00\x00\x00\xff" * 2,
                                    {"Inference-Header-Content-Length": str(len(words)),
                                     "Content-Type": "application/octet-stream"}))
    assert status == 400 and "holds bytes that are not UTF-8 text" in message, message
    stats = http.InferenceServerClient(base).get_inference_statistics("words")["model_stats"][0]
    assert (stats["inference_stats"]["fail"]["count"], stats["inference_stats"]["success"]["count"]) == (1, 0)


def test_a_tensor_in_another_datatype_than_its_input_is_refused_before_its_data_is_read(served, monkeypatch):
    """Defect (the limits hunt, as over gRPC): a binary BYTES tensor of many elements sent to an FP32 input was
    split into as many Python objects, and JSON data converted element by element, before the data plane refused
    its datatype. Refused now as the tensor's datatype is read, in the data plane's words."""
    from nereid.protocol import http_codec, wire

    server, base = served
    read: list[str] = []
    split, convert = wire.split_bytes_elements, http_codec._json_array
    monkeypatch.setattr(wire, "split_bytes_elements", lambda *args: read.append("split") or split(*args))
    monkeypatch.setattr(http_codec, "_json_array", lambda *args: read.append("json") or convert(*args))
    count = 100_000
    header = json.dumps({"inputs": [{"name": "input", "shape": [1, count], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": 5 * count}}]}).encode()
    binary = call(base, "POST", "/v2/models/echo/infer", header + b"\x01\x00\x00\x00x" * count,
                  {"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"})
    as_json = json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "INT32", "data": [1, 2, 3, 4]}]})
    assert error_of(binary) == (400, "model 'echo': input 'input' has datatype BYTES, expected FP32")
    assert error_of(call(base, "POST", "/v2/models/echo/infer", as_json.encode())) == (
        400, "model 'echo': input 'input' has datatype INT32, expected FP32")
    assert read == []  # neither split nor converted
    stats = server.server.repository.ready_model("echo").stats
    assert (stats.fail.count, dict(stats.failures_by_reason)) == (2, {"invalid_argument": 2})
    right = json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]})
    status, body, _ = call(base, "POST", "/v2/models/echo/infer", right.encode())
    assert status == 200 and json.loads(body)["outputs"][0]["data"] == [1, 2, 3, 4]


def _exchange(base: str, data: bytes, *later: bytes, wait_s: float = 5.0, ports: list[int] | None = None) -> bytes:
    """Send ``data`` (then each of ``later``, 0.3 s apart) on one raw connection; all it answers until closed.
    ``ports`` gets the connection's own port (to tell its log lines from those of other connections)."""
    host, port = base.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=wait_s) as conn:
        if ports is not None:
            ports.append(conn.getsockname()[1])
        conn.sendall(data)
        for part in later:
            time.sleep(0.3)
            try:
                conn.sendall(part)
            except OSError:
                break
        received = b""
        try:
            while chunk := conn.recv(65536):
                received += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return received


def test_a_request_asking_to_switch_protocols_is_answered_once_and_its_body_never_run(served):
    """Upgrade: h2c (curl --http2 sends it) made llhttp take the body for the new protocol: it was then read
    as a request of its own and run, two answers for one request (smuggling, behind a proxy)."""
    _, base = served
    inner = json.dumps({"id": "SMUGGLED", "inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                                                      "data": [1, 2, 3, 4]}]}).encode()
    smuggled = (b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(inner), inner))
    head = (b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
            b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(smuggled))
    answer = _exchange(base, head, smuggled)
    assert len(re.findall(rb"HTTP/1\.1 \d{3} ", answer)) == 1 and b"SMUGGLED" not in answer
    assert answer.startswith(b"HTTP/1.1 400 ") and b"asks to switch to 'h2c' (Upgrade)" in answer
    # A bodiless request asking the same is simply answered (then its connection closed).
    answer = _exchange(base, b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 ") and len(re.findall(rb"HTTP/1\.1 \d{3} ", answer)) == 1


def test_a_large_body_asking_to_switch_protocols_gets_its_400_not_a_reset(served):
    """Found by a bug hunt: `curl --http2` over http:// with a body of 100 KB or more saw "connection reset"
    instead of the 400 saying what to do: the connection was closed with the body unread, which resets it, and
    a reset makes the client's system drop the answer it had not read yet. The server now ends its side, reads
    (and drops) what the client still sends, and closes once it has."""
    _, base = served
    body = b"[" + b"1," * 400_000 + b"1]"
    head = (b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
            b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    host, port = base.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(head)
        time.sleep(0.3)  # the answer is written before the body has all arrived, as curl's would be
        conn.sendall(body)
        received = b""
        while chunk := conn.recv(65536):
            received += chunk
    assert received.startswith(b"HTTP/1.1 400 ") and b"send it as plain HTTP/1.1" in received


def test_connections_silent_in_the_middle_of_a_request_are_closed(served, monkeypatch, caplog):
    """A connection that never finished its request (a partial head, a partial body, nothing at all) stayed
    open for ever: enough of them took every file descriptor."""
    from nereid.log_limit import RateLimitedLog
    from nereid.protocol import http_listener, http_service
    from nereid.protocol.http_listener import _BoundedHeadProtocol

    monkeypatch.setattr(_BoundedHeadProtocol, "request_idle_timeout_s", 0.5)
    unspent = RateLimitedLog(http_service.log)
    monkeypatch.setattr(http_service, "client_log", unspent)
    monkeypatch.setattr(http_listener, "_client_log", unspent.sharing(http_listener.log))
    caplog.set_level(logging.INFO, logger=http_service.__name__)
    caplog.set_level(logging.INFO, logger=http_listener.__name__)
    _, base = served
    for partial in (b"", b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n",
                    b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"in"):
        caplog.clear()
        started, ports = time.monotonic(), []
        assert _exchange(base, partial, wait_s=10, ports=ports) == b""  # closed, unanswered
        assert time.monotonic() - started < 5, partial
        # Found by a README check: a stalled body was logged twice, the second line blaming the client. (This
        # connection's lines only: an earlier test's connection, closed late, may log meanwhile.)
        lines = [r.getMessage() for r in caplog.records if r.name in (http_service.__name__, http_listener.__name__)
                 and f"127.0.0.1:{ports[0]} " in r.getMessage()]
        assert len(lines) == 1 and "closed: it sent no complete request for" in lines[0], (partial, lines)
    # A slow model's request is not cut: the client is waiting for the server, not the other way round.
    body = json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32", "data": [0] * 4}]})
    assert _exchange(base, b"POST /v2/models/slow/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n"
                           b"Connection: close\r\n\r\n%s" % (len(body), body.encode())).startswith(b"HTTP/1.1 200 ")


def test_wrong_methods_are_405_with_allow_head_is_get_without_a_body_and_other_codings_501(served):
    _, base = served
    for method, path, allow in (("POST", "/v2/health/live", "GET, HEAD"), ("GET", "/v2/models/echo/infer", "POST"),
                                ("DELETE", "/v2", "GET, HEAD"), ("GET", "/v2/repository/index", "POST")):
        status, raw, headers = call(base, method, path)
        assert (status, headers["Allow"]) == (405, allow), (method, path)
        assert json.loads(raw)["error"].startswith(f"{method} is not allowed on {path}")
    answer = _exchange(base, b"HEAD /v2/health/ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"\r\n\r\n")  # the head alone
    answer = _exchange(base, b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n"
                             b"Connection: close\r\n\r\n2\r\n{}\r\n0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 501 ") and b"Transfer-Encoding 'gzip, chunked' is not supported" in answer
    # Found by a README check: without chunked last the request is malformed (the client got the parser's 400),
    # yet the model counted it as "unimplemented".
    failures = served[0].server.dataplane.statistics("echo")[0][1].failures_by_reason
    answer = _exchange(base, b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n"
                             b"Connection: close\r\n\r\n{}")
    assert answer.startswith(b"HTTP/1.1 400 "), answer
    # Any whitespace between codings (found by a review: a tab read "gzip,\tchunked" as not ending in chunked).
    answer = _exchange(base, b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip,\tchunked\r\n"
                             b"Connection: close\r\n\r\n2\r\n{}\r\n0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 501 "), answer
    counted = served[0].server.dataplane.statistics("echo")[0][1].failures_by_reason
    assert counted.get("unimplemented", 0) == failures.get("unimplemented", 0) + 1  # (the tab's 501 alone)
    assert counted.get("invalid_argument", 0) == failures.get("invalid_argument", 0) + 1
    status, message = error_of(call(base, "POST", "/v2/models/echo/infer", bytes(16),
                                    {"Content-Type": "application/octet-stream",
                                     "Inference-Header-Content-Length": "0"}))
    assert status == 400 and "Inference-Header-Content-Length 0 (Triton's raw binary request" in message



def test_a_body_the_parser_cannot_read_is_one_400_counted_and_logged_as_such(repo, serve, monkeypatch, caplog):
    """Defects: a chunked infer body whose later chunk is malformed got its 400, but was logged as "the client
    disconnected" and counted nowhere; and one answered before its body was read (a 404) got a second,
    unrequested 400 after that answer."""
    from nereid.log_limit import RateLimitedLog
    from nereid.protocol import http_listener, http_service

    unspent = RateLimitedLog(http_service.log)
    monkeypatch.setattr(http_service, "client_log", unspent)
    monkeypatch.setattr(http_listener, "_client_log", unspent.sharing(http_listener.log))
    caplog.set_level(logging.INFO, logger=http_service.__name__)
    caplog.set_level(logging.INFO, logger=http_listener.__name__)
    repo.python("echo")
    server = serve(repo.write_config())
    base = f"127.0.0.1:{server.server.http_port}"
    chunked = b"Host: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"inp\r\n"
    answer = _exchange(base, b"POST /v2/models/echo/infer HTTP/1.1\r\n" + chunked, b"zz\r\n")
    assert len(re.findall(rb"HTTP/1\.1 \d{3} ", answer)) == 1 and answer.startswith(b"HTTP/1.1 400 "), answer
    assert answer.endswith(b'{"error":"the request cannot be parsed as HTTP/1.1: Invalid character in chunk size"}')
    stats = server.server.repository.ready_model("echo").stats
    deadline = time.monotonic() + 2
    while not stats.fail.count and time.monotonic() < deadline:  # its handler hears once the connection closed
        time.sleep(0.01)
    assert (stats.success.count, stats.fail.count, stats.failures_by_reason) == (0, 1, {"invalid_argument": 1})
    samples = urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics").read().decode()
    assert 'nereid_protocol_requests_total{model="echo",outcome="invalid_argument",protocol="http"} 1.0' in samples
    lines = [r.getMessage() for r in caplog.records if r.name in (http_service.__name__, http_listener.__name__)]
    pattern = (r"HTTP POST /v2/models/echo/infer from 127\.0\.0\.1:\d+ refused with 400: its body cannot be parsed "
               r"as HTTP/1\.1 \(Invalid character in chunk size\)")
    assert len([line for line in lines if re.fullmatch(pattern, line)]) == 1 and len(lines) == 1, lines
    # Refused by the listener, and one of the model's failures (its name was in the path).
    assert 'nereid_protocol_refused_total{protocol="http",reason="unparsable"} 1.0' in samples
    # The same body on a call that never reads one: refused, counted and logged all the same (it was neither).
    caplog.clear()
    answer = _exchange(base, b"GET /v2/health/live HTTP/1.1\r\n" + chunked + b"zz\r\n")
    assert answer.startswith(b"HTTP/1.1 400 ") and len(re.findall(rb"HTTP/1\.1 \d{3} ", answer)) == 1, answer
    samples = urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics").read().decode()
    assert 'nereid_protocol_refused_total{protocol="http",reason="unparsable"} 2.0' in samples
    lines = [r.getMessage() for r in caplog.records if r.name == http_listener.__name__]
    assert [line for line in lines if line.startswith("HTTP GET /v2/health/live from 127.0.0.1:")] == lines != [], lines
    # Answered (404) before its body was read: that answer is its only one; the malformed rest only closes.
    started = time.monotonic()
    answer = _exchange(base, b"POST /v2/models/nope/versions/2/infer HTTP/1.1\r\n" + chunked, b"zz\r\n", wait_s=3)
    assert answer.startswith(b"HTTP/1.1 404 ") and len(re.findall(rb"HTTP/1\.1 \d{3} ", answer)) == 1, answer
    assert b"unknown model 'nope'" in answer, answer
    assert time.monotonic() - started < 2  # closed, not left to time out


def test_an_unknown_models_404_says_what_grpc_says_for_the_same_call(served):
    """The wording of an unknown model's 404 differed between calls (infer with or without a version, metadata,
    stats): every call says the same, as gRPC's NOT_FOUND does, which tritonclient.http raises as its message."""
    import tritonclient.grpc as grpc_client

    server, base = served
    client = http.InferenceServerClient(base)
    http_input, grpc_input = http.InferInput("input", [1, 4], "FP32"), grpc_client.InferInput("input", [1, 4], "FP32")
    http_input.set_data_from_numpy(np.ones((1, 4), np.float32))
    grpc_input.set_data_from_numpy(np.ones((1, 4), np.float32))
    for call, version in (("get_model_metadata", ""), ("get_model_metadata", "2"), ("get_model_config", ""),
                          ("get_inference_statistics", ""), ("get_inference_statistics", "2"), ("infer", ""),
                          ("infer", "1"), ("infer", "2")):
        args = {"infer": lambda tensor: ("nope", [tensor])}.get(call, lambda tensor: ("nope",))
        with pytest.raises(InferenceServerException) as over_http:
            getattr(client, call)(*args(http_input), model_version=version)
        with pytest.raises(InferenceServerException) as over_grpc:
            getattr(server.client, call)(*args(grpc_input), model_version=version)
        # (Statistics: INVALID_ARGUMENT, 400, as Triton answers them; the Triton client hunt.)
        statuses = (("400", "StatusCode.INVALID_ARGUMENT") if call == "get_inference_statistics"
                    else ("404", "StatusCode.NOT_FOUND"))
        assert (over_http.value.status(), over_grpc.value.status()) == statuses, call
        assert over_http.value.message() == over_grpc.value.message(), (call, version)
        # One wording for every call, with or without a version (the dataplane's two lookups gave two).
        assert over_http.value.message() == "unknown model 'nope' (no folder 'nope' under ml_backends_path)", \
            (call, version)


def test_an_unknown_model_close_to_a_known_one_is_told_that_one_over_http_and_grpc(served):
    """Defect (the new user's hunt): a typo in a model's name got "unknown model 'slwo'" alone, where the
    repository knew a 'slow'."""
    server, base = served
    client = http.InferenceServerClient(base)
    told = "unknown model 'slwo' (no folder 'slwo' under ml_backends_path; did you mean 'slow'?)"
    for tritonclient in (client, server.client):
        with pytest.raises(InferenceServerException) as refused:
            tritonclient.get_model_metadata("slwo")
        assert refused.value.message() == told
    status, answer, _ = call(base, "POST", "/v2/models/slwo/infer", b"{}", {"Content-Type": "application/json"})
    assert (status, json.loads(answer)) == (404, {"error": told})
    # Nothing close: nothing suggested.
    with pytest.raises(InferenceServerException) as refused:
        server.client.get_model_metadata("nope")
    assert refused.value.message() == "unknown model 'nope' (no folder 'nope' under ml_backends_path)"


def test_an_unknown_model_is_404_whatever_its_body_holds(served):
    # A malformed body was decoded first for version "" or "1", and answered 400 naming the body's fault, where
    # Triton looks the model up first (and a version "2" was already 404).
    import grpc
    from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc as pb_grpc

    server, base = served
    unknown = "unknown model 'nope' (no folder 'nope' under ml_backends_path)"
    for path in ("/v2/models/nope/infer", "/v2/models/nope/versions/1/infer"):
        for body in (b"{not json", json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 4],
                                                           "data": [1, 2]}]}).encode()):
            status, answer, _ = call(base, "POST", path, body, {"Content-Type": "application/json"})
            assert (status, json.loads(answer)) == (404, {"error": unknown}), (path, body)
    with grpc.insecure_channel(server.url) as channel:
        for version in ("", "1"):
            request = pb.ModelInferRequest(model_name="nope", model_version=version)
            request.inputs.add(name="input", datatype="FP32", shape=[1, 4])
            request.raw_input_contents.append(b"7 bytes")
            with pytest.raises(grpc.RpcError) as refused:
                pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
            assert (refused.value.code(), refused.value.details()) == (grpc.StatusCode.NOT_FOUND, unknown), version


def test_an_encoded_slash_is_part_of_its_segment_never_a_separator(served):
    # The router split the decoded path: /v2/repository%2Fmodels%2Fecho%2Funload unloaded echo, past a proxy's
    # rule on /v2/repository/ (Triton matches its routes on the raw path).
    server, base = served
    status, answer, _ = call(base, "POST", "/v2/repository%2Fmodels%2Fecho%2Funload", b"")
    assert status == 404, answer
    # Found by a README check: the 404 quoted the decoded path, an endpoint that exists.
    assert json.loads(answer)["error"] == "no such endpoint: POST /v2/repository%2Fmodels%2Fecho%2Funload"
    assert server.client.is_model_ready("echo")
    assert call(base, "GET", "/v2%2Fhealth%2Flive")[0] == 404
    status, answer, _ = call(base, "GET", "/v2/models/echo%2Fconfig")
    assert (status, json.loads(answer)["error"]) == (
        404, "unknown model 'echo/config' (no folder 'echo/config' under ml_backends_path)")
    # Other escapes are decoded within their segment, as before.
    assert call(base, "GET", "/v2/models/%65cho/ready")[0] == 200


def test_a_path_is_matched_whole_as_sent(served):
    """Found by a bug hunt: the router stripped every slash at either end and decoded an endpoint's own words, so
    //v2/repository/models/echo/unload (and /v2/%72epository/..., and one ending in //) unloaded echo past a
    proxy's rule on /v2/repository/ that matches the raw prefix; Triton matches its routes on the whole raw
    path, and answers each of these 404."""
    server, base = served
    for path in ("//v2/repository/models/echo/unload", "///v2/repository/models/echo/unload/",
                 "/v2/repository/models/echo/unload//", "/%76%32/%72epository/models/echo/unload",
                 "/v2/repository/models/echo/%75nload"):
        status, answer, _ = call(base, "POST", path, b"")
        assert status == 404 and json.loads(answer)["error"].startswith(("no such endpoint: POST " + path,
                                                                          "no such endpoint: " + path)), path
        assert server.client.is_model_ready("echo"), path
    for path in ("//v2/health/live", "/v2/health/live/", "/%76%32/health/live", "/v2/", "/v2/models/echo/ready/",
                 "/v2/models/echo/", "/v2/models/echo/versions/1/"):  # (the last two: metadata, once)
        assert call(base, "GET", path)[0] == 404, path
        assert call(base, "HEAD", path)[0] == 404, path
    assert call(base, "GET", "/v2/models/echo/versions/1")[0] == 200
    # A model's name and a version are values, decoded: they may be spelled encoded.
    assert call(base, "GET", "/v2/models/%65cho/versions/%31/ready")[0] == 200


def test_http_1_1_requests_need_exactly_one_valid_host_and_http_1_0_ones_none(served):
    """RFC 9112 3.2: a request without Host, with two, or with one that is no host[:port] is answered 400 (a proxy
    and this server disagreeing on the Host is how requests get routed past the proxy's rules)."""
    _, base = served
    for head, reason in ((b"", "this one has none"), (b"Host: a\r\nHost: b\r\n", "this one has 2"),
                         (b"Host: a b\r\n", "its Host header is no host[:port] ('a b')")):
        answer = _exchange(base, b"GET /v2/health/live HTTP/1.1\r\n" + head + b"\r\n")
        assert answer.startswith(b"HTTP/1.1 400 "), answer
        assert reason.encode() in answer and len(re.findall(rb"HTTP/1\.1 \d{3} ", answer)) == 1, answer  # closed
    for head in (b"GET /v2/health/live HTTP/1.1\r\nHost: [::1]:8000\r\nConnection: close\r\n\r\n",
                 b"GET /v2/health/live HTTP/1.1\r\nHost: \tx:1 \t\r\nConnection: close\r\n\r\n",  # (OWS)
                 b"GET /v2/health/live HTTP/1.1\r\nHost: \r\nConnection: close\r\n\r\n",  # (empty: allowed)
                 b"GET /v2/health/live HTTP/1.0\r\n\r\n"):
        assert _exchange(base, head).startswith(b"HTTP/1.1 200 "), head
    # Found by the HTTP clients hunt: quoted as latin-1, a UTF-8 Host came back as mojibake ('bÃ¼cher.example').
    answer = _exchange(base, "GET /v2/health/live HTTP/1.1\r\nHost: bücher.example\r\n\r\n".encode())
    assert "its Host header is no host[:port] ('bücher.example')".encode() in answer, answer
    answer = _exchange(base, b"GET /v2/health/live HTTP/1.1\r\nHost: b\xfc\r\n\r\n")
    assert "its Host header is no host[:port] ('b\ufffd')".encode() in answer, answer


def test_a_target_in_absolute_form_without_a_path_is_read_as_the_root(served):
    """Found by the HTTP clients hunt: what a forward proxy sends for http://host (RFC 9112 3.2.2) was refused with
    a 400 quoting a Python error ('NoneType' object has no attribute 'decode'); it is the root path, not the API's."""
    _, base = served
    for target in (f"http://{base}", f"http://{base}?x=1", f"HTTP://{base}"):
        answer = _exchange(base, f"GET {target} HTTP/1.1\r\nHost: {base}\r\nConnection: close\r\n\r\n".encode())
        assert answer.startswith(b"HTTP/1.1 404 ") and b"NoneType" not in answer, (target, answer)
    answer = _exchange(base, f"GET http://{base}/v2/health/live HTTP/1.1\r\nHost: {base}\r\nConnection: "
                             "close\r\n\r\n".encode())
    assert answer.startswith(b"HTTP/1.1 200 "), answer
    # (An HTTP hunt: any scheme was served as its path, ftp://x/v2/health/live answering 200.)
    answer = _exchange(base, f"GET ftp://{base}/v2/health/live HTTP/1.1\r\nHost: {base}\r\nConnection: "
                             "close\r\n\r\n".encode())
    assert answer.startswith(b"HTTP/1.1 400 ") and b"its target's scheme is 'ftp'" in answer, answer


def test_an_http_1_0_client_asking_for_100_continue_gets_only_its_answer(served):
    # RFC 9110 10.1.1 and 15.2: a 100 is never sent to HTTP/1.0, which may take it for the final answer.
    _, base = served
    body = json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                                   "data": [1, 2, 3, 4]}]}).encode()
    head = (b"POST /v2/models/echo/infer HTTP/1.0\r\nExpect: 100-continue\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    answer = _exchange(base, head, body)
    assert answer.startswith(b"HTTP/1.1 200 ") and b"100 Continue" not in answer, answer


def test_a_version_is_read_as_a_number_as_triton_reads_it(served):
    server, base = served
    assert call(base, "GET", "/v2/models/echo/versions/01/ready")[0] == 200
    tensor = http.InferInput("input", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
    answer = http.InferenceServerClient(base).infer("echo", [tensor], model_version="001")
    np.testing.assert_array_equal(answer.as_numpy("output"), np.ones((1, 4)))
    assert server.client.get_model_metadata("echo", model_version="01").name == "echo"
    # Found by a bug hunt: an empty model name read as every model's statistics (Triton's route needs a name).
    for path in ("/v2/models//stats", "/v2/models//versions/7/stats"):
        assert call(base, "GET", path)[0] == 404
    for version in ("2", "10"):
        status, answer, _ = call(base, "GET", f"/v2/models/echo/versions/{quote(version)}/ready")
        assert status == 400, (version, answer)  # not ready: no such version
        assert call(base, "GET", f"/v2/models/echo/versions/{version}")[0] == 404
    # Triton's routes take digits only: anything else in the path is a 400, on every endpoint.
    for version in ("1.0", "+1", "abc", "١"):  # (the last: an Arabic-Indic one, a digit to str.isdigit)
        for method, endpoint in (("GET", "/ready"), ("GET", ""), ("GET", "/config"), ("POST", "/infer")):
            status, answer, _ = call(base, method, f"/v2/models/echo/versions/{quote(version)}{endpoint}", b"{}",
                                     {"Content-Type": "application/json"})
            assert status == 400 and json.loads(answer)["error"] == (
                f"model 'echo': the path's version '{version}' is no number (a version is digits only: "
                ".../versions/1/...)"), (version, endpoint, answer)


def test_content_encoding_identity_in_any_case_is_an_uncompressed_body(served):
    _, base = served
    body = json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                                   "data": [1, 2, 3, 4]}]}).encode()
    for coding in ("Identity", " IDENTITY "):
        status, answer, _ = call(base, "POST", "/v2/models/echo/infer", body,
                                 {"Content-Type": "application/json", "Content-Encoding": coding})
        assert status == 200, (coding, answer)
    status, answer, _ = call(base, "POST", "/v2/models/echo/infer", body,
                             {"Content-Type": "application/json", "Content-Encoding": "BR"})
    assert status == 400 and b"Content-Encoding 'BR' is not supported" in answer


def test_a_client_is_named_as_host_and_port_in_log_lines() -> None:
    from nereid.protocol.http_service import peer

    assert (peer(("127.0.0.1", 40312)), peer(("::1", 8)), peer(None)) == ("127.0.0.1:40312", "[::1]:8", "unknown")


def test_each_endpoint_is_known_with_its_method_with_or_without_a_version():
    """The 405's Allow comes from the same table the endpoints are listed in (a route added to one place only
    answered a wrong method 404)."""
    from nereid.protocol.http_service import MODEL_ENDPOINTS, SERVER_ENDPOINTS, _allowed_method

    for parts, method in SERVER_ENDPOINTS.items():
        assert _allowed_method(list(parts)) == method
    for action, method in MODEL_ENDPOINTS.items():
        tail = [action] if action else []
        assert _allowed_method(["models", "m", *tail]) == method
        assert _allowed_method(["models", "m", "versions", "1", *tail]) == method
    assert [_allowed_method(["repository", "models", "m", verb]) for verb in ("load", "unload")] == ["POST", "POST"]
    for unknown in (["nope"], ["models", "m", "labels"], ["models", "m", "ready", "more"], ["repository"],
                    ["models", "m", ""]):
        assert _allowed_method(unknown) is None, unknown


def test_the_surface_serves_each_listed_endpoint_and_refuses_other_methods_with_405(tmp_path):
    """The endpoint tables and the dispatch must agree: an endpoint listed but not served answered its own method
    405 "use GET" (and one served but not listed answered a wrong method 404)."""
    from nereid.protocol.http_service import MODEL_ENDPOINTS, SERVER_ENDPOINTS, HttpSurface
    from toy_backends import toy_dataplane

    plane = toy_dataplane(tmp_path)
    surface = HttpSurface(plane, max_body_bytes=1 << 20)

    async def call(method: str, path: str) -> int:
        body = b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}'
        scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "query_string": b"",
                 "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
                 "client": ("127.0.0.1", 1)}
        sent: list[dict] = []

        async def receive() -> dict:
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict) -> None:
            sent.append(message)
        await surface(scope, receive, send)
        return sent[0]["status"]

    async def scenario() -> None:
        await plane.repository.load("toy")
        paths = {"/v2" + "".join(f"/{part}" for part in parts): method for parts, method in SERVER_ENDPOINTS.items()}
        for action, method in MODEL_ENDPOINTS.items():
            for model in ("/v2/models/toy", "/v2/models/toy/versions/1"):
                paths[f"{model}/{action}" if action else model] = method
        for path, method in paths.items():
            assert await call(method, path) not in (404, 405), (method, path)
            other = "POST" if method == "GET" else "GET"
            assert await call(other, path) == 405, (other, path)
        await plane.repository.unload_all()
    asyncio.run(scenario())


def test_repeated_header_lines_are_read_as_one_field_or_refused(served):
    """Found by a bug hunt: the header lines went into a dict, the last line of each name winning. A second
    ``Content-Encoding: identity`` line hid a gzip body (refused as JSON that is not UTF-8), a second
    ``Transfer-Encoding: chunked`` line hid a gzip coding (taken as plain chunked), and of two different
    Inference-Header-Content-Length lines the last silently split the body."""
    import gzip

    _, base = served
    body = json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                                   "data": [1, 2, 3, 4]}]}).encode()

    def answer(*lines: str, payload: bytes = body) -> tuple[int, str]:
        head = "".join(f"{line}\r\n" for line in ("POST /v2/models/echo/infer HTTP/1.1", "Host: x",
                                                    "Connection: close", *lines))
        raw = _exchange(base, head.encode() + b"\r\n" + payload)
        status_line, _, rest = raw.partition(b"\r\n")
        return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2].decode("latin-1")

    zipped = gzip.compress(body)
    status, text = answer(f"Content-Length: {len(zipped)}", "Content-Encoding: gzip", "Content-Encoding: gzip",
                          payload=zipped)
    assert status == 400 and "Content-Encoding 'gzip, gzip' is not supported" in text
    status, text = answer(f"Content-Length: {len(zipped)}", "Content-Encoding: gzip", "Content-Encoding: identity",
                          payload=zipped)
    assert status == 200 and json.loads(text)["outputs"][0]["data"] == [1, 2, 3, 4], text
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(zipped), zipped)
    status, text = answer("Transfer-Encoding: gzip", "Transfer-Encoding: chunked", payload=chunked)
    assert status == 501 and "Transfer-Encoding 'gzip, chunked' is not supported" in text, text
    status, text = answer(f"Content-Length: {len(body)}", "Content-Type: application/octet-stream",
                          f"Inference-Header-Content-Length: {len(body)}", "Inference-Header-Content-Length: 10")
    assert status == 400 and text == json.dumps({"error": (
        f"model 'echo': the request has Inference-Header-Content-Length twice, with different values "
        f"('{len(body)}' and '10'); send it once")}, separators=(",", ":")), text
    # The same value twice is one field, and the server serves on.
    status, text = answer(f"Content-Length: {len(body)}", "Content-Type: application/json",
                          "Content-Type: application/json")
    assert status == 200 and json.loads(text)["outputs"][0]["data"] == [1, 2, 3, 4]
    # Accept-Encoding's lines are one list (the HTTP read hunt: the last line alone was read, and gzip, asked for
    # on the first, was not used).
    head = ("POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            f"Content-Length: {len(body)}\r\nAccept-Encoding: gzip\r\nAccept-Encoding: br\r\n\r\n")
    raw = _exchange(base, head.encode() + body)
    assert b"\r\ncontent-encoding: gzip\r\n" in raw.partition(b"\r\n\r\n")[0].lower(), raw[:300]


@pytest.mark.parametrize("elements, datatype, off_loop", [
    (16, "FP32", False), (1 << 16, "FP32", True), (1 << 20, "UINT8", True), (1 << 16, "BYTES", True)],
    ids=["small", "many elements", "4 MiB", "many BYTES elements"])
def test_a_large_answer_is_encoded_on_a_worker_thread(monkeypatch, elements, datatype, off_loop):
    """From the bug hunt of the HTTP surface: every answer was encoded on the event loop; a 64 MB JSON answer or
    4M empty BYTES elements held it, and every other client, for over a second (gRPC's are made off the loop)."""
    from nereid.dtypes import DType
    from nereid.protocol import http_service
    from nereid.protocol.http_codec import OutputChoice
    from nereid.tensors import InferResponse, NamedTensor

    on_loop: list[bool] = []
    real = http_service.encode_infer

    def recording(response, choice):
        on_loop.append(threading.current_thread() is threading.main_thread())
        return real(response, choice)
    monkeypatch.setattr(http_service, "encode_infer", recording)
    dtype = DType.from_kserve(datatype)
    data = (np.full(elements, b"", dtype=object) if dtype is DType.BYTES else np.zeros(elements, dtype.numpy))
    response = InferResponse("m", [NamedTensor("y", dtype, data)], "")

    async def scenario():
        answer = http_service.encoded_answer(response, OutputChoice((), frozenset(), binary_by_default=False))
        return await answer if asyncio.iscoroutine(answer) else answer
    parts, binary_header = asyncio.run(scenario())
    assert on_loop == [not off_loop] and binary_header is None
    assert len(json.loads(b"".join(parts))["outputs"][0]["data"]) == elements


def test_the_chunks_of_an_infer_body_are_let_go_as_they_are_gathered(tmp_path):
    """The review of the tests: the test below checked the view it got, not that the chunks were appended as they
    came. Kept until the end and joined there, a body costs twice its size at the end (the chunks and their join);
    appended as they arrive, about its size."""
    import tracemalloc

    from nereid.protocol.http_service import HttpSurface
    from toy_backends import toy_dataplane

    size, piece = 24 << 20, 1 << 20
    surface = HttpSurface(toy_dataplane(tmp_path), max_body_bytes=size)
    source = bytes(size)
    offsets = list(range(0, size, piece))

    async def receive() -> dict:  # each chunk made as it is read, and kept by nobody but the reader
        start = offsets.pop(0)
        return {"type": "http.request", "body": source[start:start + piece], "more_body": bool(offsets)}

    async def scenario() -> memoryview:
        return await surface._read_body({b"content-length": str(size).encode()}, receive, "toy", as_view=True)
    tracemalloc.start()
    try:
        gathered = asyncio.run(scenario())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(gathered) == size
    assert peak < 1.5 * size, f"{peak / size:.2f} times the body's size at the peak"


def test_an_infer_body_of_many_chunks_is_gathered_as_it_arrives_into_one_read_only_view(tmp_path):
    """Found by a bug hunt of isolation between models: the chunks of a body were joined once it had all
    arrived, on the event loop: for a 500 MB body that held every other client for half a second to three."""
    from nereid.protocol.http_service import HttpSurface
    from toy_backends import toy_dataplane

    plane = toy_dataplane(tmp_path)
    surface = HttpSurface(plane, max_body_bytes=1 << 20)
    header = (b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 4], '
              b'"parameters": {"binary_data_size": 16}}]}')
    body = header + np.arange(4, dtype=np.float32).tobytes()

    def receiving(chunk_size: int):
        pieces = [body[i:i + chunk_size] for i in range(0, len(body), chunk_size)]

        async def receive() -> dict:
            piece = pieces.pop(0)
            return {"type": "http.request", "body": piece, "more_body": bool(pieces)}
        return receive

    async def scenario() -> None:
        headers = {b"content-length": str(len(body)).encode()}
        gathered = await surface._read_body(headers, receiving(7), "toy", as_view=True)
        assert isinstance(gathered, memoryview) and gathered.readonly and bytes(gathered) == body
        assert await surface._read_body(headers, receiving(7), "toy") == body  # (other bodies: bytes, as before)
        assert await surface._read_body(headers, receiving(len(body)), "toy", as_view=True) == body  # one chunk
        await plane.repository.load("toy")
        scope = {"type": "http", "method": "POST", "path": "/v2/models/toy/infer",
                 "raw_path": b"/v2/models/toy/infer", "query_string": b"", "client": ("127.0.0.1", 1),
                 "headers": [(b"content-type", b"application/octet-stream"),
                             (b"inference-header-content-length", str(len(header)).encode()),
                             (b"content-length", str(len(body)).encode())]}
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)
        await surface(scope, receiving(5), send)
        assert sent[0]["status"] == 200, sent
        await plane.repository.unload_all()
    asyncio.run(scenario())


def test_an_answer_whose_encoding_runs_out_of_memory_is_a_503_counted_once_everywhere(repo, serve, monkeypatch):
    """Found by the HTTP hunt (under `ulimit -v`): the 503 was counted in ModelStatistics ("internal") but missing
    from nereid_protocol_requests_total, which counts what clients were answered."""
    from nereid.protocol import http_service

    def out_of_memory(response, choice):
        raise MemoryError("no room for the answer")

    monkeypatch.setattr(http_service, "encoded_answer", out_of_memory)
    repo.python("echo")
    server = serve(repo.write_config())
    base = f"127.0.0.1:{server.server.http_port}"
    body = json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]})
    status, message = error_of(call(base, "POST", "/v2/models/echo/infer", body.encode()))
    assert status == 503 and "ran out of memory answering" in message, message
    stats = server.server.repository.ready_model("echo").stats
    assert (stats.success.count, stats.fail.count, stats.failures_by_reason) == (0, 1, {"internal": 1})
    samples = urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics").read().decode()
    assert 'nereid_protocol_requests_total{model="echo",outcome="internal",protocol="http"} 1.0' in samples
    assert 'nereid_protocol_requests_total{model="echo",outcome="success"' not in samples


def test_a_decode_that_fails_by_a_bug_is_a_500_counted_everywhere_and_logged_at_a_bounded_rate(repo, serve,
                                                                                              monkeypatch, caplog):
    """Found by the HTTP clients hunt (an integer of 309 digits beside a NaN literal, since fixed, raised OverflowError
    in the decoder): such a 500 was counted in neither ModelStatistics nor nereid_protocol_requests_total, and each
    request logged an ERROR with its traceback, about 39 lines, as fast as a client could send them."""
    from nereid.protocol import http_service

    def broken_decode(model, body, length, declared):
        raise OverflowError("a bug of the decoder's")

    monkeypatch.setattr(http_service, "decode_infer", broken_decode)
    monkeypatch.setattr(http_service, "fault_log", http_service.RateLimitedLog(http_service.log, burst=3),
                        raising=False)
    repo.python("echo")
    server = serve(repo.write_config())
    base = f"127.0.0.1:{server.server.http_port}"
    body = json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]})
    for _ in range(8):
        status, message = error_of(call(base, "POST", "/v2/models/echo/infer", body.encode()))
        assert (status, message) == (500, "internal error: OverflowError: a bug of the decoder's")
    stats = server.server.repository.ready_model("echo").stats
    assert (stats.success.count, stats.fail.count, stats.failures_by_reason) == (0, 8, {"internal": 8})
    samples = urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics").read().decode()
    assert 'nereid_protocol_requests_total{model="echo",outcome="internal",protocol="http"} 8.0' in samples
    failed = [r for r in caplog.records if r.getMessage().startswith("HTTP POST /v2/models/echo/infer failed")]
    assert len(failed) == 3 and all(r.levelname == "ERROR" and r.exc_info for r in failed)


def test_a_compressed_repository_request_is_refused_by_name(served):
    """Found by the HTTP hunt: a gzip-encoded repository index (or load) body was read as JSON and refused as invalid
    JSON. Only infer bodies are decompressed, as Triton decompresses only those."""
    import gzip

    _, base = served
    body = gzip.compress(b'{"ready": true}')
    for path, who in (("/v2/repository/index", "the repository index request: "),
                      ("/v2/repository/models/echo/load", "model 'echo': the load request: ")):
        assert error_of(call(base, "POST", path, body, {"Content-Encoding": "gzip"})) == (
            400, f"{who}compressed request bodies are taken by infer requests only (Content-Encoding: gzip); send it "
                 "uncompressed")


def test_the_server_s_own_work_off_the_loop_never_waits_for_model_code_s_threads(served):
    """Found by the pipelines hunt: nereid decoded large requests (and encoded, compressed, classified, stamped
    folders) on asyncio's default executor, which is model code's too (asyncio.to_thread in a meta model): 8 meta
    requests blocking in it held every other model's large requests, and loads, until they ended."""
    server, base = served
    gate = threading.Event()

    async def occupy_the_default_executor() -> list[asyncio.Future]:
        loop = asyncio.get_running_loop()
        return [loop.run_in_executor(None, gate.wait, 120) for _ in range(64)]
    asyncio.run_coroutine_threadsafe(occupy_the_default_executor(), server.loop).result(10)
    try:
        big = "x" * 300_000  # (a body past DECODE_OFF_LOOP_BYTES: decoded, and its answer encoded, off the loop)
        body = json.dumps({"inputs": [{"name": "input", "shape": [2], "datatype": "BYTES", "data": [big, big]}]})
        status, answer, _ = call(base, "POST", "/v2/models/words/infer", body.encode())  # (a 30 s timeout)
        assert status == 200 and json.loads(answer)["outputs"][0]["data"] == [big, big]
    finally:
        gate.set()


def test_no_thread_for_the_server_s_own_work_is_a_503_not_a_bug(served, monkeypatch):
    """Found by the review hunt of 1483f15: at a pids limit, a large request whose decode could get no thread was
    a 500 "internal error" with a traceback logged as a bug of nereid's; the same condition of a model's own
    thread was already UNAVAILABLE. A compression that gets none sends the answer uncompressed."""
    import nereid.daemon_pool as daemon_pool

    server, base = served

    class NoThreads:
        def submit(self, *args, **kwargs):
            raise daemon_pool.ThreadStartFailed(RuntimeError("can't start new thread"))

    monkeypatch.setattr(daemon_pool, "work_pool", NoThreads)
    big = "x" * 300_000
    body = json.dumps({"inputs": [{"name": "input", "shape": [2], "datatype": "BYTES", "data": [big, big]}]})
    status, error = error_of(call(base, "POST", "/v2/models/words/infer", body.encode()))
    assert status == 503 and "can't start new thread: a process or thread limit" in error, (status, error)
    assert call(base, "GET", "/v2/health/ready")[0] == 200


def test_an_answer_encoded_when_no_thread_can_start_is_encoded_here_not_refused(served, monkeypatch):
    """Found by the review hunt of 3447a9f: at a pids limit a large answer, its model run already, was refused
    503 (UNAVAILABLE over gRPC) as its encode could get no thread: a client's retry ran the model again."""
    import nereid.daemon_pool as daemon_pool
    from nereid.protocol import http_service

    server, base = served

    class NoThreads:
        def submit(self, *args, **kwargs):
            raise daemon_pool.ThreadStartFailed(RuntimeError("can't start new thread"))

    monkeypatch.setattr(http_service, "ENCODE_OFF_LOOP_BYTES", 16)  # (this small answer is encoded off the loop)
    monkeypatch.setattr(daemon_pool, "work_pool", NoThreads)
    body = json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32", "data": [0.5] * 4}]})
    status, answer, _ = call(base, "POST", "/v2/models/echo/infer", body.encode())
    assert status == 200 and json.loads(answer)["outputs"][0]["data"] == [0.5] * 4, (status, answer)
