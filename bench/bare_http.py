"""Baselines: bare HTTP servers that echo KServe V2 binary infer requests, on two stacks.

    python bench/bare_http.py aiohttp|uvicorn HOST:PORT SHAPE MAX_BATCH_SIZE

Each answers just what perf_analyzer asks before it sends (server metadata,
model metadata, model config) and echoes ``/infer`` bodies in Triton's binary
tensor extension: the JSON header is parsed and a response header written, the
tensor bytes are passed through. No validation, no queue, no numpy: the limit
of the stack for the same requests.
"""

from __future__ import annotations

import asyncio
import json
import sys

HEADER_LENGTH = "Inference-Header-Content-Length"


def metadata(shape: list[int], max_batch_size: int) -> tuple[bytes, bytes, bytes]:
    batch = [-1] if max_batch_size else []
    tensor = {"datatype": "FP32", "shape": batch + shape}
    server = json.dumps({"name": "bare", "version": "0", "extensions": []}).encode()
    model = json.dumps({"name": "identity", "versions": ["1"], "platform": "bare",
                        "inputs": [{"name": "input", **tensor}], "outputs": [{"name": "output", **tensor}]}).encode()
    config = json.dumps({"name": "identity", "platform": "bare", "max_batch_size": max_batch_size,
                         "input": [{"name": "input", "data_type": "TYPE_FP32", "dims": shape}],
                         "output": [{"name": "output", "data_type": "TYPE_FP32", "dims": shape}]}).encode()
    return server, model, config


def echo(body: bytes, header_length: int) -> tuple[bytes, int]:
    """The response body and its JSON header's length for an echoed binary request."""
    request = json.loads(body[:header_length])
    outputs = []
    for tensor in request["inputs"]:
        outputs.append({"name": "output", "datatype": tensor["datatype"], "shape": tensor["shape"],
                        "parameters": {"binary_data_size": tensor["parameters"]["binary_data_size"]}})
    header = json.dumps({"model_name": "identity", "model_version": "1", "outputs": outputs}).encode()
    return header + body[header_length:], len(header)


def serve_aiohttp(host: str, port: int, shape: list[int], max_batch_size: int) -> None:
    from aiohttp import web

    server, model, config = metadata(shape, max_batch_size)

    async def infer(request: web.Request) -> web.Response:
        body = await request.read()
        response, length = echo(body, int(request.headers[HEADER_LENGTH]))
        return web.Response(body=response, headers={HEADER_LENGTH: str(length)},
                            content_type="application/octet-stream")

    def fixed(payload: bytes):
        async def handler(request: web.Request) -> web.Response:
            return web.Response(body=payload, content_type="application/json")
        return handler

    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/v2/models/{model}/infer", infer)
    app.router.add_get("/v2", fixed(server))
    app.router.add_get("/v2/models/{model}", fixed(model))
    app.router.add_get("/v2/models/{model}/config", fixed(config))
    web.run_app(app, host=host, port=port, print=None, access_log=None)


def serve_uvicorn(host: str, port: int, shape: list[int], max_batch_size: int) -> None:
    import uvicorn

    server, model, config = metadata(shape, max_batch_size)

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if scope["method"] == "POST" and path.endswith("/infer"):
            chunks = []
            more = True
            while more:
                message = await receive()
                chunks.append(message.get("body", b""))
                more = message.get("more_body", False)
            length = int(dict(scope["headers"])[HEADER_LENGTH.lower().encode()])
            body, header_length = echo(b"".join(chunks), length)
            headers = [(b"content-type", b"application/octet-stream"),
                       (HEADER_LENGTH.encode(), str(header_length).encode())]
        else:
            body = server if path == "/v2" else config if path.endswith("/config") else model
            headers = [(b"content-type", b"application/json")]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    import socket

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as nereid's listener (and aiohttp) do
    sock.bind((host, port))
    settings = uvicorn.Config(app, http="httptools", loop="asyncio", lifespan="off", log_level="warning",
                              access_log=False, proxy_headers=False, server_header=False, date_header=False)
    uvicorn.Server(settings).run(sockets=[sock])


if __name__ == "__main__":
    stack, address, shape_text, max_batch = sys.argv[1:5]
    bind_host, _, bind_port = address.rpartition(":")
    arguments = (bind_host, int(bind_port), [int(d) for d in shape_text.split(",")], int(max_batch))
    asyncio.set_event_loop(asyncio.new_event_loop())
    {"aiohttp": serve_aiohttp, "uvicorn": serve_uvicorn}[stack](*arguments)
