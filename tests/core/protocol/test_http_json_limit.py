"""Memory on the HTTP JSON path: the JSON part's own limit (413 before reading or decoding), large JSON decodes
one at a time, and the server running out of memory answered 503, not blamed on the client.

Defects (a memory review): a 64 MiB JSON body took 14-32x its size in Python objects while decoded (4 at once
OOM-killed a server in 3 GiB), with nothing bounding how many decoded at once; and a MemoryError (orjson's
"Not enough memory to allocate buffer for parsing" too) was answered 400 "not valid JSON", counted
invalid_argument, or a bare 500.
"""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import threading
import time
from typing import Any

import orjson
import pytest

from nereid.errors import InvalidArgument
from support import textproto_single

JSON_LIMIT = 4096


@pytest.fixture
def served(repo, serve):
    """A server with an FP32 echo of [2048] rows whose JSON limit is JSON_LIMIT bytes; (server, host:port)."""
    repo.python("echo", textproto=textproto_single(input_shape="[2048]"))
    server = serve(repo.write_config(server_extra=f"  http_max_json_bytes: {JSON_LIMIT}\n"))
    return server, f"127.0.0.1:{server.server.http_port}"


def _answer(base: str, data: bytes, wait_s: float = 5.0) -> tuple[int, dict, float]:
    """Send ``data`` on a raw connection (and nothing more); (status, JSON body, seconds until answered)."""
    host, port = base.rsplit(":", 1)
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=wait_s) as conn:
        conn.sendall(data)
        received = b""
        while b"\r\n\r\n" not in received or len(received.split(b"\r\n\r\n", 1)[1]) < _length(received):
            chunk = conn.recv(65536)
            if not chunk:
                break
            received += chunk
    head, body = received.split(b"\r\n\r\n", 1)
    return int(head.split()[1]), json.loads(body), time.monotonic() - start


def _length(received: bytes) -> int:
    for line in received.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def _stats(server) -> tuple[int, dict]:
    stats = server.server.repository.ready_model("echo").stats
    return stats.fail.count, dict(stats.failures_by_reason)


def _infer_head(length: int, *extra: bytes) -> bytes:
    return b"\r\n".join([b"POST /v2/models/echo/infer HTTP/1.1", b"Host: x", b"Content-Type: application/json",
                         b"Content-Length: %d" % length, *extra, b"", b""])


def test_a_json_part_over_the_limit_is_413_before_its_body_is_read(served):
    """With and without Inference-Header-Content-Length: answered from the head alone (no body is ever sent
    here), naming the model, the sizes, the setting and binary data; counted as the model's failure."""
    server, base = served
    status, body, _ = _answer(base, _infer_head(JSON_LIMIT + 1))
    assert status == 413
    assert body["error"].startswith(f"model 'echo': the JSON part of the request is {JSON_LIMIT + 1} bytes (all of "
                                    "the body: it has no Inference-Header-Content-Length); the limit for JSON is "
                                    f"{JSON_LIMIT} bytes (server.http_max_json_bytes)"), body
    assert "binary_data" in body["error"] and "Inference-Header-Content-Length)" in body["error"]
    status, body, _ = _answer(base, _infer_head(10 * JSON_LIMIT, b"Inference-Header-Content-Length: %d"
                                                % (JSON_LIMIT + 10)))
    assert status == 413 and body["error"].startswith(
        f"model 'echo': the JSON part of the request is {JSON_LIMIT + 10} bytes; the limit for JSON is {JSON_LIMIT} "
        "bytes (server.http_max_json_bytes)"), body
    assert _stats(server) == (2, {"invalid_argument": 2})


def test_a_chunked_json_body_is_refused_once_it_passes_the_limit(served):
    server, base = served
    head = _infer_head(0).replace(b"Content-Length: 0", b"Transfer-Encoding: chunked")
    status, body, _ = _answer(base, head + b"%x\r\n%s\r\n" % (JSON_LIMIT + 1, b" " * (JSON_LIMIT + 1)))
    assert status == 413 and body["error"].startswith(
        "model 'echo': the JSON part of the request passes the limit (all of the body is JSON: it has no "
        f"Inference-Header-Content-Length); the limit for JSON is {JSON_LIMIT} bytes"), body
    assert _stats(server) == (1, {"invalid_argument": 1})


def test_binary_tensors_are_not_bounded_by_the_json_limit(served):
    """Binary data is the way to send big tensors: only the JSON header counts toward the limit."""
    _, base = served
    header = orjson.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 2048],
                                       "parameters": {"binary_data_size": 8192}}],  # 2x the JSON limit
                           "outputs": [{"name": "output", "parameters": {"binary_data": True}}]})
    payload = header + bytes(8192)
    host, port = base.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as conn:
        conn.sendall(_infer_head(len(payload), b"Inference-Header-Content-Length: %d" % len(header)) + payload)
        assert conn.recv(64).startswith(b"HTTP/1.1 200 ")


def _surface_call(server, surface, body: bytes) -> tuple[int, dict]:
    """One infer request to ``surface`` called directly (as uvicorn calls it); (status, JSON body)."""
    sent: list = []

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v2/models/echo/infer",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    server.call(surface(scope, receive, send))
    return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


def _large_body(size: int) -> bytes:
    """An infer body of about ``size`` bytes whose element count does not fit the shape (refused once decoded)."""
    count = size // 4
    return orjson.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 4],
                                     "data": [0.5] * count}]})


def test_large_json_decodes_run_one_at_a_time_with_the_collector_paused(repo, serve, monkeypatch):
    """Two large JSON bodies at once were decoded at once (memory: twice one decode's). The real decode is
    wrapped only to see when each runs."""
    from nereid.protocol import http_service
    from nereid.protocol.http_service import SERIAL_DECODE_JSON_BYTES, HttpSurface

    repo.python("echo")
    server = serve(repo.write_config())
    running, seen = [], []
    real = http_service.decode_infer

    def watched(model: str, body: bytes, length: int | None, declared: Any = None) -> Any:
        running.append(1)
        seen.append((len(running), gc.isenabled()))
        time.sleep(0.2)  # long enough that a second decode, were it let in, would overlap
        try:
            return real(model, body, length, declared)
        finally:
            running.pop()

    monkeypatch.setattr(http_service, "decode_infer", watched)
    surface = HttpSurface(server.server.dataplane, 64 << 20, max_json_bytes=16 << 20)
    body = _large_body(SERIAL_DECODE_JSON_BYTES)
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(_surface_call(server, surface, body)))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert [status for status, _ in results] == [400, 400]  # decoded, and refused for its element count
    assert seen == [(1, False), (1, False)]  # one at a time, each without the cyclic collector
    assert gc.isenabled()  # and back on after


def test_a_cancelled_handler_keeps_the_next_large_decode_waiting_until_its_decode_ends(repo, serve, monkeypatch):
    """A handler cancelled mid-decode (its client gone) leaves the decode's thread running: the next large
    decode must still wait for it."""
    from nereid.protocol import http_service
    from nereid.protocol.http_service import HttpSurface

    repo.python("echo")
    server = serve(repo.write_config())
    running, overlaps = [], []
    release = threading.Event()

    def slow(model: str, body: bytes, length: int | None, declared: Any = None) -> Any:
        running.append(1)
        overlaps.append(len(running))
        release.wait(5)
        running.pop()
        raise InvalidArgument("refused")

    monkeypatch.setattr(http_service, "decode_infer", slow)
    surface = HttpSurface(server.server.dataplane, 64 << 20, max_json_bytes=16 << 20)

    async def scenario() -> None:
        first = asyncio.ensure_future(surface._decode_large("echo", b"{}", None))
        await asyncio.sleep(0.05)
        first.cancel()
        second = asyncio.ensure_future(surface._decode_large("echo", b"{}", None))
        await asyncio.sleep(0.1)
        assert overlaps == [1] and not second.done()  # still waiting for the first thread
        release.set()
        with pytest.raises(InvalidArgument):
            await second

    server.call(scenario())
    assert overlaps == [1, 1]


@pytest.mark.parametrize("failure", ["memory_error", "orjson_allocation"])
def test_out_of_memory_decoding_is_503_counted_as_the_servers_failure(repo, serve, monkeypatch, failure, caplog):
    """Defect: orjson's allocation failure was 400 "the request body is not valid JSON", counted
    invalid_argument; a MemoryError in the decode a bare 500 "internal error: MemoryError: ". And (the log hunt)
    it was logged nowhere, where gRPC's is a WARNING, as the README says."""
    from nereid.protocol import http_codec, http_service
    from nereid.protocol.http_service import HttpSurface

    repo.python("echo")
    server = serve(repo.write_config())
    if failure == "memory_error":
        def fail(model: str, body: bytes, length: int | None, declared: Any = None) -> Any:
            raise MemoryError()
        monkeypatch.setattr(http_service, "decode_infer", fail)
    else:  # orjson's own report, as it raises it when its parse buffer cannot be allocated
        def loads(data: Any) -> Any:
            raise orjson.JSONDecodeError("Not enough memory to allocate buffer for parsing", "", 0)
        monkeypatch.setattr(http_codec.orjson, "loads", loads)
    outcomes: list = []
    surface = HttpSurface(server.server.dataplane, 64 << 20, lambda model, outcome: outcomes.append(outcome))
    body = b'{"inputs": []}'
    status, answer = _surface_call(server, surface, body)
    assert (status, answer) == (503, {"error": f"model 'echo': the server ran out of memory decoding a {len(body)}-"
                                               "byte request; try again later, and send large tensors as binary "
                                               "data (binary_data, with Inference-Header-Content-Length), which "
                                               "takes a fraction of the memory JSON does"})
    assert outcomes == ["internal"] and _stats(server) == (1, {"internal": 1})
    assert [(r.levelname, r.getMessage()) for r in caplog.records if "ran out of memory" in r.getMessage()] == [
        ("WARNING", f"HTTP POST /v2/models/echo/infer from unknown: model 'echo': the server ran out of memory "
                    f"decoding a {len(body)}-byte request; try again later, and send large tensors as binary data "
                    "(binary_data, with Inference-Header-Content-Length), which takes a fraction of the memory JSON "
                    "does; answered 503")]


def test_out_of_memory_reading_a_body_is_503(repo, serve):
    """Defect: a MemoryError while the body was gathered (b"".join of its chunks) was a bare 500."""
    from nereid.protocol.http_service import HttpSurface

    repo.python("echo")
    server = serve(repo.write_config())
    sent: list = []

    async def receive() -> dict:
        raise MemoryError()

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v2/models/echo/infer",
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"1234")]}
    server.call(HttpSurface(server.server.dataplane, 64 << 20)(scope, receive, send))
    assert sent[0]["status"] == 503
    assert json.loads(sent[1]["body"])["error"].startswith(
        "model 'echo': the server ran out of memory reading a 1234-byte request; try again later")
    assert _stats(server) == (1, {"internal": 1})


def test_out_of_memory_in_the_parsers_body_callback_is_503_not_a_parse_error(served, monkeypatch):
    """Defect: a MemoryError in uvicorn's body callback was answered 400 "the request cannot be parsed as
    HTTP/1.1 (MemoryError)" and counted invalid_argument."""
    from nereid.protocol.http_listener import _BoundedHeadProtocol

    server, base = served

    def on_body(self, body: bytes) -> None:
        raise MemoryError()

    monkeypatch.setattr(_BoundedHeadProtocol, "on_body", on_body, raising=False)
    status, body, _ = _answer(base, _infer_head(20) + b'{"inputs": []}      ')
    assert (status, body) == (503, {"error": "the server ran out of memory reading the request; try again later, "
                                             "and send large tensors as binary data"})
    deadline = time.monotonic() + 2
    while not _stats(server)[0] and time.monotonic() < deadline:  # its handler hears once the connection closed
        time.sleep(0.01)
    assert _stats(server) == (1, {"internal": 1})
