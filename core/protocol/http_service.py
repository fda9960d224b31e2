"""The KServe V2 REST protocol (and Triton's HTTP extensions) over the same data plane as gRPC.

A plain ASGI application, served by :mod:`nereid.protocol.http_listener`
(uvicorn with httptools, on the server's own event loop). Handlers only
convert: JSON and binary bodies in, data-plane calls, JSON out, and errors
mapped to HTTP statuses in one table, as Triton's endpoint answers them.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import time
from typing import Any, Awaitable, Callable, Mapping, TypeVar
from urllib.parse import quote, unquote

import orjson

from nereid.daemon_pool import ThreadStartFailed, on_work_thread, on_work_thread_or_here, work_pool
from nereid.collector_pause import collector_paused
from nereid.dataplane import DataPlane, cancellation_reason, past_grace_message
from nereid.dtypes import DType
from nereid.errors import (ConfigError, DeadlineExceeded, InvalidArgument, ModelFailure, NereidError, NotFound,
                           OutOfMemory, PermissionDenied, QueueFull, Unavailable, Unimplemented, cap_message)
from nereid.log_limit import RateLimitedLog
from nereid.model_info import MODEL_VERSION, ModelConfig
from nereid.protocol.http_codec import HEADER_LENGTH, OutputChoice, decode_infer, encode_infer, quoted
from nereid.protocol.http_compression import compressed, decompressed, request_coding, response_coding
from nereid.protocol.http_errors import HttpError, header_text
from nereid.protocol.wire import DECODE_OFF_LOOP_BYTES
from nereid.settings import DEFAULT_HTTP_MAX_JSON_BYTES
from nereid.stats import ModelStats
from nereid.tensors import InferResponse

log = logging.getLogger(__name__)
EncodedAnswer = tuple[list[bytes | memoryview], int | None]  # (body parts, binary header length)
# What any client can make happen at will (a disconnect mid-upload, a body the parser cannot read; and, through
# the listener's share of it, a head too large or too slow, a silent connection) is logged through this: at most
# 10 lines per 10 s in all, then a count of those suppressed, as gRPC's client errors are, so one client cannot
# fill the disk (1,000 requests wrote 1,000 lines).
client_log = RateLimitedLog(log)
# A request's failure that is a bug of nereid's, with its traceback: a client that found one could repeat it at will.
fault_log = RateLimitedLog(log)
T = TypeVar("T")

STATUS_OF_ERROR: dict[type[NereidError], int] = {
    InvalidArgument: 400,
    ConfigError: 400,
    PermissionDenied: 403,
    NotFound: 404,
    QueueFull: 503,
    Unavailable: 503,
    DeadlineExceeded: 504,
    ModelFailure: 500,
    Unimplemented: 501,
}
# The endpoints nereid serves, with their methods (HEAD is answered as GET): under /v2, and under a model (and its
# version) by the segment after it ("" for the model's metadata). HttpSurface._route and _model must serve each
# of them (a test checks); _allowed_method reads them, so that a known path asked with another method gets 405
# with Allow (see _not_found). Repository load and unload (/v2/repository/models/{m}/load, /unload) take POST.
SERVER_ENDPOINTS: dict[tuple[str, ...], str] = {(): "GET", ("health", "live"): "GET", ("health", "ready"): "GET",
                                                ("models", "stats"): "GET", ("repository", "index"): "POST"}
MODEL_ENDPOINTS: dict[str, str] = {"": "GET", "ready": "GET", "config": "GET", "stats": "GET", "infer": "POST"}
# Triton's endpoints of extensions nereid does not implement: a path's first parts after /v2, and the extension.
REFUSED_ENDPOINTS: dict[str, str] = {"systemsharedmemory": "system_shared_memory",
                                     "cudasharedmemory": "cuda_shared_memory", "trace": "trace",
                                     "logging": "logging"}

# Requests whose JSON part is at least this large are decoded one at a time (see HttpSurface._decode_large):
# JSON tensors take 6-31x their size in Python objects while decoded, so N of them at once took N times that
# (four 64 MiB bodies OOM-killed a server in 3 GiB). Binary tensors (views of the body) are not held back.
SERIAL_DECODE_JSON_BYTES = 1 << 20
# Responses up to this size are joined into one write (a copy costs less than a second write).
JOIN_BELOW_BYTES = 64 << 10
# Compressed request bodies from this size on are decompressed on a worker thread, one at a time (see
# HttpSurface._decompressed): a kilobyte of gzip can hold a megabyte, so below it the work is a millisecond at most.
DECOMPRESS_OFF_LOOP_BYTES = 1 << 10
# Answers to compress (Accept-Encoding) from this size on are compressed on a worker thread.
COMPRESS_OFF_LOOP_BYTES = 64 << 10
# Answers are encoded on a worker thread when their outputs take this many bytes, or hold this many elements in
# all: the encode works element by element for a JSON output (a list of numbers, then orjson's dump) and for
# BYTES (joined with their lengths), so a 64 MB JSON answer, or 4M empty BYTES elements, held the event loop, and
# every other client, for over a second (the bug hunt of the HTTP surface).
ENCODE_OFF_LOOP_BYTES = 4 << 20
ENCODE_OFF_LOOP_ELEMENTS = 1 << 16
# Answers of at least this many elements as JSON are encoded one at a time (see HttpSurface._encoded).
SERIAL_ENCODE_JSON_ELEMENTS = 1 << 20
# curl -d sends application/x-www-form-urlencoded unless told otherwise: accepted as JSON, as Triton does.
# So is application/octet-stream without Inference-Header-Content-Length (the whole body is the JSON
# header): tritonclient.http.aio labels every body so, even one whose tensors are all JSON.
BODY_TYPES = (b"application/json", b"", b"application/x-www-form-urlencoded", b"application/octet-stream")
# Every JSON answer says so, errors included: the KServe SDK reads an error's message only then.
JSON_HEADERS = [(b"content-type", b"application/json")]

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


def status_of(error: NereidError) -> int:
    """The HTTP status for a nereid error (500 for anything unmapped)."""
    for kind in type(error).__mro__:
        if kind in STATUS_OF_ERROR:
            return STATUS_OF_ERROR[kind]
    return 500


class Unparsable(HttpError):
    """The HTTP parser could not read the rest of a request's body (a malformed chunk: 400; the server out of
    memory while reading it: 503): the listener has answered it and closed its connection (see
    :meth:`nereid.protocol.http_listener._BoundedHeadProtocol.send_400_response`), so the handler only counts and
    logs it."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(status, message)


def _log_out_of_memory(scope: Scope, error: NereidError) -> None:
    """Say that the server ran out of memory reading or decoding an infer request, ``error``: its passing condition,
    for its operator to see, as over gRPC (the log hunt: over HTTP the 503s were told of nowhere). Those of a run
    (stacking a batch, reading a run's outputs) are logged where they happen."""
    if isinstance(error, OutOfMemory):
        client_log.log(logging.WARNING, "HTTP %s %s from %s: %s; answered 503", scope["method"],
                       cap_message(scope["path"], 256), peer(scope.get("client")), error)


def out_of_memory(model: str, doing: str, size: int | None) -> OutOfMemory:
    """The error for a MemoryError met while ``doing`` (reading, decoding) a request of ``size`` bytes."""
    of = f"a {size}-byte request" if size is not None else "a request"
    return OutOfMemory(f"{_who(model)}the server ran out of memory {doing} {of}; try again later, and send large "
                       "tensors as binary data (binary_data, with Inference-Header-Content-Length), which takes "
                       "a fraction of the memory JSON does")


class Disconnected(Exception):
    """The client went away (before its body arrived, or before its answer): there is no one to answer."""

    def __init__(self, message: str, *, before_start: bool = False, logged: bool = False) -> None:
        super().__init__(message)
        self.before_start = before_start  # gone before the data plane had the request: it counted nothing
        self.logged = logged  # the listener closed the connection (the client idle mid-body), and logged why


class HttpSurface:
    """The ASGI application: routes, body limits, and conversions to and from the data plane."""

    def __init__(self, dataplane: DataPlane, max_body_bytes: int,
                 count_request: Callable[[str, str], None] | None = None, max_json_bytes: int | None = None) -> None:
        """``max_json_bytes``: the largest JSON part of an infer request; None: the data plane's
        ``server.http_max_json_bytes``."""
        self.dataplane = dataplane
        self.max_body_bytes = max_body_bytes
        if max_json_bytes is None:
            server = getattr(getattr(dataplane, "settings", None), "server", None)
            max_json_bytes = getattr(server, "http_max_json_bytes", DEFAULT_HTTP_MAX_JSON_BYTES)
        self.max_json_bytes = max_json_bytes
        self._count = count_request
        # Held from a large JSON decode's start until its thread ends (see _decode_large).
        self._large_decodes = asyncio.Semaphore(1)
        self._large_encodes = asyncio.Semaphore(1)  # answers of many elements as JSON (see _encoded)
        self._decompressions = asyncio.Semaphore(1)  # compressed request bodies (see _decompressed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # lifespan and websocket scopes: nothing to do
        try:
            status, body, headers = await self._route(scope, receive)
        except Unparsable:  # answered, counted and logged already, below the app
            return
        except Disconnected as gone:
            if not gone.logged:
                client_log.log(logging.INFO, "HTTP %s %s from %s: the client disconnected %s", scope["method"],
                               cap_message(scope["path"], 256), peer(scope.get("client")), gone)
            return
        except HttpError as err:
            status, body, headers = err.status, error_body(str(err)), [*JSON_HEADERS, *err.headers]
        except NereidError as err:
            status = status_of(err)
            body, headers = error_body(self.dataplane.error_text(err)), JSON_HEADERS
        except MemoryError:
            # Not a bug, and not the client's fault: a passing condition of the server, answered without a
            # traceback (formatting one may fail again), as an infer request out of memory is (see _infer).
            client_log.log(logging.WARNING, "HTTP %s %s from %s: the server ran out of memory; answered 503",
                           scope["method"], cap_message(scope["path"], 256), peer(scope.get("client")))
            status, headers = 503, JSON_HEADERS
            body = error_body(f"the server ran out of memory answering {scope['method']} "
                               f"{cap_message(scope['path'], 256)}; try again later")
        except Exception as err:  # a bug, not the client's fault: say so rather than drop the connection
            fault_log.error("HTTP %s %s failed", scope["method"], cap_message(scope["path"], 256), exc_info=err)
            status, headers = 500, JSON_HEADERS
            body = error_body(self.dataplane.error_text(err))
        except asyncio.CancelledError:
            if not self.dataplane.shutting_down:
                raise
            # uvicorn cancels what still runs when shutdown_grace_s has passed: a request still sending its body
            # (an infer past the grace answers in _infer) got uvicorn's text/plain 500 and an ERROR traceback
            # each. It gets the answer a request still running then gets, and a line at most per the limit.
            asyncio.current_task().uncancel()
            # Its body all read, it was running (a repository load, say): it may have taken effect.
            received = getattr(getattr(receive, "__self__", None), "more_body", True) is False
            client_log.log(logging.INFO, "HTTP %s %s from %s: still %s when shutdown_grace_s passed; answered 503",
                           scope["method"], cap_message(scope["path"], 256), peer(scope.get("client")),
                           "running" if received else "being received")
            status, headers = 503, [*JSON_HEADERS, (b"connection", b"close")]
            body = error_body("the server is shutting down, and shutdown_grace_s passed while this request ran; "
                              "it may have taken effect, and its outcome is lost" if received else
                              "the server is shutting down, and shutdown_grace_s passed before this request was "
                              "received; send it again to another server")
        if _body_never_asked_for(receive):
            # Answered before its body was asked for (no 100 Continue went out): the client need not send it
            # (RFC 9110 10.1.1), and the parser would take its next request for that body, which then hung.
            # uvicorn closes the connection after an answer that says so.
            headers = [*headers, (b"connection", b"close")]
        await _respond(send, status, body, headers)

    async def _route(self, scope: Scope, receive: Receive) -> tuple[int, list[bytes | memoryview], list]:
        method, parts = scope["method"], _path_segments(scope)
        if not parts or parts[0] != "v2":
            raise HttpError(404, f"no such endpoint: {_shown_path(scope)} (the API is under /v2)")
        parts = parts[1:]
        if method == "HEAD":
            method = "GET"  # answered as GET; uvicorn sends the head without the body
        if parts == [] and method == "GET":
            name, version, extensions = self.dataplane.server_metadata()
            return _json({"name": name, "version": version, "extensions": list(extensions)})
        if parts[:1] == ["health"] and len(parts) == 2 and method == "GET":
            if parts[1] == "live":
                return _health("live", self.dataplane.live())
            if parts[1] == "ready":
                return _health("ready", self.dataplane.ready())
        if parts == ["models", "stats"] and method == "GET":
            return _json(_statistics(self.dataplane.statistics()))
        if parts[:1] == ["repository"] and method == "POST":
            return await self._repository(scope, receive, parts[1:])
        if parts[:1] == ["models"] and len(parts) >= 2:
            return await self._model(scope, receive, method, _path_value(parts[1]), parts[2:])
        if parts[:1] and parts[0] in REFUSED_ENDPOINTS:
            self.dataplane.refuse_extension(REFUSED_ENDPOINTS[parts[0]])
        raise _not_found(scope, parts)

    async def _model(self, scope: Scope, receive: Receive, method: str, model: str,
                     rest: list[str]) -> tuple[int, list[bytes | memoryview], list]:
        version, path_rest = "", rest
        if rest[:1] == ["versions"] and len(rest) >= 2:
            version, rest = _path_value(rest[1]), rest[2:]
            if not version:  # ".../versions//infer" is no request for the default version: a client's slip
                raise HttpError(404, f"model '{model}': the path names an empty version "
                                     f"({cap_message(scope['path'], 256)}); give one (1) or leave out /versions/")
            if not rest and version in MODEL_ENDPOINTS:  # ".../versions/infer": the version left out, not named
                raise HttpError(404, f"model '{model}': the path names no version before /{version} "
                                     f"({cap_message(scope['path'], 256)}); give one (.../versions/1/{version}) "
                                     f"or leave out /versions/")
            if not (version.isascii() and version.isdigit()):  # Triton's routes take a version of digits only
                message = (f"model '{model}': the path's version '{cap_message(version, 64)}' is no number (a "
                           "version is digits only: .../versions/1/...)")
                if rest == ["infer"] and method == "POST":  # counted as the same mistake over gRPC is (a bug hunt)
                    self._refused(model, InvalidArgument(message))
                raise HttpError(400, message)
        # ".../echo/" (rest [""]) names no endpoint: the metadata's path is the model's own, with no slash after it.
        action = (rest[0] or None) if len(rest) == 1 else "" if not rest else None
        # (Each endpoint below is in MODEL_ENDPOINTS too, where a wrong method's 405 finds what it takes.)
        if action == "" and method == "GET":
            metadata = self.dataplane.model_metadata(model, version)
            return _json({"name": metadata.name, "versions": list(metadata.versions), "platform": metadata.platform,
                          "inputs": [_tensor_json(t) for t in metadata.inputs],
                          "outputs": [_tensor_json(t) for t in metadata.outputs]})
        if action == "ready" and method == "GET":
            return _health("ready", self.dataplane.model_ready(model, version), name=model)
        if action == "config" and method == "GET":
            return _json(_config_json(self.dataplane.model_config(model, version)))
        if action == "stats" and method == "GET":
            if not model:  # (the dataplane would read it as every model's, as Triton's route never does)
                raise HttpError(404, f"no such endpoint: GET {_shown_path(scope)} (the path names no model; every "
                                     "model's statistics are at /v2/models/stats)")
            return _json(_statistics(self.dataplane.statistics(model, version)))
        if action == "infer" and method == "POST":
            return await self._infer(scope, receive, model, version)
        if rest == ["trace", "setting"]:  # Triton's per-model trace settings
            self.dataplane.refuse_extension("trace")
        if action in ("generate", "generate_stream"):  # Triton's generate extension (LLM-style requests)
            self.dataplane.refuse_extension("generate")
        # (The path as sent, its version included: .../versions/1/versions/1 stripped of one was a known endpoint,
        # and got a 405 telling the client to use the method it had used; a bug hunt.)
        raise _not_found(scope, ["models", model, *path_rest])

    async def _infer(self, scope: Scope, receive: Receive, model: str,
                     version: str) -> tuple[int, list[bytes | memoryview], list]:
        try:
            self.dataplane.admit(model)
            declared = self.dataplane.check_target(model, version).input_datatypes
        except NereidError as err:
            # Counted as what the client was told: the listener may have answered already, the HTTP parser unable
            # to read a body that came with the head (it was counted "unavailable", where the client got a 400).
            self._refused(model, _listener_refusal(receive, model) or err)
            raise
        try:
            headers = request_headers(scope, model)
            body, length = await self._infer_body(headers, receive, model)
        except HttpError as err:
            # Refused by this layer (a Content-Type, a size, a body the HTTP parser cannot read): still one
            # of the model's failures, as a body that does not decode is (the server out of memory: its own).
            refusal = {501: Unimplemented, 503: OutOfMemory}.get(err.status, InvalidArgument)(str(err))
            _log_out_of_memory(scope, refusal)
            self._refused(model, refusal)
            raise
        except NereidError as err:  # out of memory reading it
            _log_out_of_memory(scope, err)
            self._refused(model, err)
            raise
        except asyncio.CancelledError:
            self._count_cut_at_grace(model)
            raise
        try:
            json_size = len(body) if length is None else length
            if json_size >= SERIAL_DECODE_JSON_BYTES:
                request, choice = await self._decode_large(model, body, length, declared)
            elif len(body) >= DECODE_OFF_LOOP_BYTES:
                request, choice = await on_work_thread(decode_infer, model, body, length, declared)
            else:
                request, choice = decode_infer(model, body, length, declared)
        except NereidError as err:
            self._refused(model, err)
            raise
        except MemoryError as lost:
            # Its traceback's frames hold what the decode had built (and would, as the answer's context): let go.
            lost.__traceback__ = None
            error = out_of_memory(model, "decoding", len(body))
            _log_out_of_memory(scope, error)
            self._refused(model, error)
            raise error from None
        except Exception:  # a bug of the decoder's, answered 500 (see __call__): still one of the model's failures
            self.dataplane.count_failure(model, NereidError.reason)
            self._counted(model, NereidError.reason)
            raise
        except asyncio.CancelledError:
            self._count_cut_at_grace(model)
            raise
        del body
        try:
            # Encoded before the success is counted: an output JSON cannot carry (NaN) fails the request.
            parts, binary_header = await _unless_disconnected(
                self.dataplane.infer_encoded(request, lambda response: self._encoded(response, choice)), receive)
        except NereidError as err:
            self._counted(model, err.reason)
            raise
        except Disconnected as gone:
            reason = cancellation_reason(request.deadline_ns, time.monotonic_ns())
            if gone.before_start:  # counted as the data plane counts a request cancelled in it
                self.dataplane.count_failure(model, reason)
            self._counted(model, reason)
            raise
        except asyncio.CancelledError:
            if not self.dataplane.shutting_down:
                raise
            # uvicorn cancels a handler still running when shutdown_grace_s has passed; its client still
            # waits, and gets the answer a gRPC client gets then (uvicorn's own would be a text/plain 500).
            asyncio.current_task().uncancel()
            self._counted(model, "unavailable")
            raise Unavailable(past_grace_message(model)) from None
        except Exception:
            # The encoder's own failure (out of memory answering: 503; a bug: 500), which the data plane counted
            # as the model's: counted here too, as what the client is told (it was counted in ModelStatistics
            # and not among the protocol's requests; a bug hunt).
            self._counted(model, NereidError.reason)
            raise
        self._counted(model, "success")
        answer_headers = JSON_HEADERS if binary_header is None else [
            (b"content-type", b"application/octet-stream"), (HEADER_LENGTH.encode(), str(binary_header).encode())]
        coding = response_coding(headers)
        if coding is None:
            return 200, parts, answer_headers
        return 200, *await _compressed_answer(parts, answer_headers, coding)

    def _encoded(self, response: InferResponse, choice: OutputChoice) -> EncodedAnswer | Awaitable[EncodedAnswer]:
        """:func:`encoded_answer`; one answering :data:`SERIAL_ENCODE_JSON_ELEMENTS` elements or more as JSON is
        encoded on a worker thread one at a time, as a large JSON request is decoded: each costs its Python values
        a chunk at a time and its JSON text whole, and holds the GIL while it makes them (four at once took 3 GiB
        and held the event loop 3 s; the HTTP hunt). Released when its thread ends (see :meth:`_decode_large`)."""
        if sum(t.data.size for t in response.outputs if not choice.is_binary(t.name)) < SERIAL_ENCODE_JSON_ELEMENTS:
            return encoded_answer(response, choice)
        return self._one_at_a_time(self._large_encodes, encode_infer, response, choice)

    async def _one_at_a_time(self, turn: asyncio.Semaphore, function: Callable[..., T], *args: Any) -> T:
        """``function(*args)`` on a worker thread once ``turn`` is free, holding it until the thread ends (a
        handler cancelled, its client gone, leaves the work running: the next must not start beside it)."""
        await turn.acquire()
        try:
            future = asyncio.get_running_loop().run_in_executor(work_pool(), function, *args)
        except BaseException:
            turn.release()
            raise
        future.add_done_callback(functools.partial(_ended_turn, turn))
        return await asyncio.shield(future)

    async def _decode_large(self, model: str, body: bytes | memoryview, length: int | None,
                            declared: Mapping[str, DType] | None = None) -> tuple[Any, Any]:
        """:func:`decode_infer` of a large JSON part on a worker thread, one such decode at a time.

        The semaphore is released when the thread ends, not when this handler
        does: a handler cancelled (its client gone) leaves its decode running,
        and the next must not start beside it.
        """
        return await self._one_at_a_time(self._large_decodes, _decode_without_gc, model, body, length, declared)

    async def _infer_body(self, headers: dict[bytes, bytes], receive: Receive,
                          model: str) -> tuple[bytes | memoryview, int | None]:
        """An infer request's body and its JSON header's length (Inference-Header-Content-Length; None: all JSON),
        once its headers say it can be read; HttpError otherwise. A compressed body (gzip, deflate) comes
        decompressed, its limits (``server.max_message_bytes``, ``server.http_max_json_bytes``) applied to what
        it decompresses to."""
        coding = request_coding(headers, f"model '{model}': ")
        header_length = headers.get(HEADER_LENGTH.encode())
        content_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if content_type not in BODY_TYPES:
            raise HttpError(400, f"model '{model}': Content-Type {header_text(content_type)!r} is not "
                                 "accepted (application/json, or application/octet-stream)")
        length = None
        if header_length is not None:
            # Digits only, as Content-Length (int() also takes "+148", "1_0", " 12 " and "-5").
            if not header_length.isdigit():
                raise HttpError(400, f"model '{model}': Inference-Header-Content-Length must be a whole number of "
                                     f"bytes (digits only), got {header_text(header_length)!r}")
            if len(header_length) > 20:  # (it said "digits only" of a number made of digits: the HTTP hunt)
                raise HttpError(400, f"model '{model}': Inference-Header-Content-Length "
                                     f"{header_text(header_length)} has {len(header_length)} digits, more "
                                     "than any request body's length")
            length = int(header_length)
            if length == 0:
                raise HttpError(400, f"model '{model}': Inference-Header-Content-Length 0 (Triton's raw binary "
                                     "request: the whole body as the data of a single input) is not supported; "
                                     "send the JSON inference header first and give its length")
            declared = headers.get(b"content-length", b"")
            # (The JSON part cannot be longer than the body; a compressed one's, once decompressed, below.)
            if coding is None and declared.isdigit() and length > int(declared):
                raise HttpError(400, f"model '{model}': Inference-Header-Content-Length is {length}, but the body "
                                     f"has {int(declared)} bytes (Content-Length)")
            if length > self.max_json_bytes:  # refused before its body is read
                raise self._json_too_large(model, f"is {length} bytes")
        # Without the header, the whole body is JSON: bounded as it is read (before, when its length is declared).
        body = await self._read_body(headers, receive, model, all_json=length is None and coding is None,
                                     as_view=True)
        if coding is None:
            return body, length
        # (All of it JSON, it is decompressed no further than the JSON limit: a gzip body that holds the body
        # limit's worth of JSON is refused when it passes the smaller limit, not once it is all made.)
        limit = self.max_body_bytes if length is not None else min(self.max_body_bytes, self.max_json_bytes)
        try:
            body = await self._decompressed(body, coding, model, limit)
        except HttpError as err:
            if err.status == 413 and limit < self.max_body_bytes:
                raise self._json_too_large(model, f"passes the limit once decompressed ({coding}; all of the body "
                                                  "is JSON: it has no Inference-Header-Content-Length)") from None
            raise
        if length is not None and length > len(body):
            raise HttpError(400, f"model '{model}': Inference-Header-Content-Length is {length}, but the body "
                                 f"has {len(body)} bytes decompressed ({coding})")
        return body, length

    async def _decompressed(self, body: bytes | memoryview, coding: str, model: str, limit: int) -> bytes:
        """:func:`~nereid.protocol.http_compression.decompressed` of an infer body (to at most ``limit`` bytes), on
        a worker thread one at a time when it is large (a flood of small gzip bodies each holding the limit's
        worth must not all expand at once)."""
        who = f"model '{model}': "
        try:
            if len(body) < DECOMPRESS_OFF_LOOP_BYTES:
                return decompressed(body, coding, limit, who)
            return await self._one_at_a_time(self._decompressions, decompressed, body, coding, limit, who)
        except MemoryError as lost:  # (counted as the model's, as a decode out of memory is: it reached __call__)
            lost.__traceback__ = None
            raise out_of_memory(model, f"decompressing ({coding})", len(body)) from None

    def _json_too_large(self, model: str, size: str) -> HttpError:
        """413 for an infer request whose JSON part ``size`` ("is N bytes", "exceeds ...") passes the limit."""
        return HttpError(413, f"model '{model}': the JSON part of the request {size}; the limit for JSON is "
                              f"{self.max_json_bytes} bytes (server.http_max_json_bytes), since JSON tensors take "
                              "many times their size in memory while decoded: send large tensors as binary data "
                              "(binary_data=True in tritonclient; Triton's binary tensor extension, with "
                              "Inference-Header-Content-Length)")

    async def _repository(self, scope: Scope, receive: Receive,
                          rest: list[str]) -> tuple[int, list[bytes | memoryview], list]:
        if rest == ["index"]:
            headers = request_headers(scope, "")
            _refuse_compressed(headers, "the repository index request: ")
            body = await self._read_body(headers, receive, "")
            options = _json_object(body, "the repository index request") if body.strip() else {}
            ready = options.get("ready", False)
            if not isinstance(ready, bool):  # as Triton refuses it: a 1 or "yes" taken for false listed everything
                raise HttpError(400, f"the repository index request: 'ready' must be true or false, got "
                                     f"{quoted(ready)}")
            # "reason" only when there is one, as Triton writes the index (a client may test for the key).
            return _json([{"name": e.name, "version": e.version, "state": e.state,
                           **({"reason": e.reason} if e.reason else {})}
                          for e in await self.dataplane.repository_index(ready)])
        if len(rest) == 3 and rest[0] == "models" and rest[2] in ("load", "unload"):
            model, action = _path_value(rest[1]), rest[2]
            headers = request_headers(scope, model)
            if b"origin" in headers:
                # A web page's request (browsers name its origin): a POST needing no CORS preflight would load or
                # unload models for any page the server's user opens, through a loopback port that allows it.
                raise HttpError(403, f"model '{model}': a repository {action} from a web page (Origin: "
                                     f"{header_text(headers[b'origin'])!r}) is refused; send it from a "
                                     "client that is not a browser")
            _refuse_compressed(headers, f"model '{model}': the {action} request: ")
            body = await self._read_body(headers, receive, model)
            parameters = _parameters(body, f"model '{model}': the {action} request")
            endpoint = f"POST /v2/repository/models/.../{action}"  # (the protocol's own name for the call it refuses)
            if action == "load":
                await self.dataplane.load(model, parameters.keys(), endpoint, peer(scope.get("client")))
            else:
                unload_dependents = parameters.get("unload_dependents", False)
                if not isinstance(unload_dependents, bool):
                    raise HttpError(400, f"model '{model}': parameter 'unload_dependents' must be true or false, "
                                         f"got {quoted(unload_dependents)}")
                await self.dataplane.unload(model, unload_dependents, endpoint, peer(scope.get("client")))
            return 200, [], []  # Triton's empty answer: no body, so no JSON Content-Type either
        raise HttpError(404, f"no such endpoint: POST {_shown_path(scope)}")

    async def _read_body(self, headers: dict[bytes, bytes], receive: Receive, model: str,
                         all_json: bool = False, as_view: bool = False) -> bytes | memoryview:
        """The whole body, refused with 413 past the limit (before reading it, when its length is declared); with
        ``all_json`` (an infer body that is all JSON), past server.http_max_json_bytes too.

        ``as_view``: a body of several chunks comes as a read-only view of one buffer they are appended to as
        they arrive (an infer body, which the codec reads through views): joined at the end instead, a 500 MB
        body held the event loop, and every other client, for half a second to three.
        """
        declared = headers.get(b"content-length")
        coding = headers.get(b"transfer-encoding")
        codings = None if coding is None else b"".join(coding.split()).lower()  # (any whitespace: "gzip,\tchunked")
        if codings is not None and codings != b"chunked":
            shown = header_text(coding)
            if not codings.endswith(b",chunked"):
                # No chunked last, the body's end cannot be found (RFC 9112, 6.3): a malformed request, as the
                # HTTP parser answers it, not an extension nereid lacks (it was counted as "unimplemented").
                raise HttpError(400, f"{_who(model)}Transfer-Encoding {shown!r} does not end with chunked, so the "
                                     "body's length cannot be known; send it with Content-Length, or chunked")
            raise HttpError(501, f"{_who(model)}Transfer-Encoding {shown!r} is not supported (only chunked); send "
                                 "the body uncompressed")
        if b"upgrade" in headers and (coding is not None or declared not in (None, b"0")) \
                and b"upgrade" in headers.get(b"connection", b"").lower():
            # The HTTP parser takes what follows the head of such a request for the new protocol: its body is
            # not read (and the connection is closed after this answer, see http_listener._BoundedHeadProtocol).
            raise HttpError(400, f"{_who(model)}the request asks to switch to "
                                 f"{header_text(headers[b'upgrade'], 32)!r} (Upgrade), which this server "
                                 "does not speak, so its body was not read; send it as plain HTTP/1.1 "
                                 "(curl: --http1.1)")
        limit = self.max_body_bytes
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise HttpError(413, f"{_who(model)}the request body is {int(declared)} bytes; the limit is {limit} "
                                 "(server.max_message_bytes)")
        if all_json and declared is not None and declared.isdigit() and int(declared) > self.max_json_bytes:
            raise self._json_too_large(model, f"is {int(declared)} bytes (all of the body: it has no "
                                              "Inference-Header-Content-Length)")
        chunks: list[bytes] = []
        gathered: bytearray | None = None  # (as_view, from the second chunk on)
        size = 0
        try:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    # The listener ends a body the parser cannot read as a lost connection, marking the request.
                    unparsable = _listener_mark(receive)
                    if unparsable is not None:
                        raise Unparsable(f"{_who(model)}{unparsable[0]}", unparsable[1])
                    cycle = getattr(receive, "__self__", None)
                    raise Disconnected("before sending its whole body",
                                       logged=getattr(cycle, "nereid_closed_idle", False))
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise HttpError(413, f"{_who(model)}the request body exceeds the limit of {limit} bytes "
                                         "(server.max_message_bytes)")
                if all_json and size > self.max_json_bytes:
                    raise self._json_too_large(model, "passes the limit (all of the body is JSON: it has no "
                                                      "Inference-Header-Content-Length)")
                if gathered is not None:
                    gathered += chunk  # (a copy of this chunk only: a large buffer grows in place)
                elif as_view and chunks:
                    gathered = bytearray(chunks.pop())
                    gathered += chunk
                else:
                    chunks.append(chunk)
                if not message.get("more_body", False):
                    break
            if declared is not None and declared.isdigit() and size != int(declared):
                raise HttpError(400, f"{_who(model)}the body is {size} bytes, but Content-Length says {int(declared)}")
            if gathered is not None:
                return memoryview(gathered).toreadonly()  # (read-only: a raw tensor is a view of it)
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        except MemoryError as lost:
            chunks.clear()  # what was read is let go before the answer is made
            gathered = None
            lost.__traceback__ = None
            raise out_of_memory(model, "reading", int(declared) if declared is not None and declared.isdigit()
                                else size) from None

    def _counted(self, model: str, outcome: str) -> None:
        if self._count is not None:
            self._count(model, outcome)

    def _count_cut_at_grace(self, model: str) -> None:
        """Count an infer request that uvicorn cancelled at the shutdown grace while its body was read or decoded
        (answered 503 in :meth:`__call__`), as one ended then in the data plane is counted: it was counted nowhere
        (the counting hunt). A cancellation of another kind is not counted here."""
        if self.dataplane.shutting_down:
            self._refused(model, Unavailable(past_grace_message(model)))

    def _refused(self, model: str, error: NereidError) -> None:
        """Count a request refused before the data plane (unreadable, ...) like one the data plane refused."""
        self.dataplane.refused(model, error)
        self._counted(model, error.reason)


def _decode_without_gc(model: str, body: bytes | memoryview, length: int | None,
                       declared: Mapping[str, DType] | None = None) -> tuple[Any, Any]:
    """:func:`decode_infer` with the cyclic garbage collector paused (called one at a time, see _decode_large).

    A decoded body holds no reference cycles, but its millions of lists, floats
    and strings each count toward the collector's thresholds: a 16 MiB body of
    nested ``[1]`` lists ran orjson's parse (which holds the GIL) 1.9 s with the
    collector, 0.3 s without, and its whole decode 3.6 s instead of 2.3 s. The
    collector is process-wide: it is turned back on only if it was on, and the
    other threads' cycles wait for it no longer than one decode (see :mod:`nereid.collector_pause`).
    """
    with collector_paused():
        return decode_infer(model, body, length, declared)


async def _unless_disconnected(call: Awaitable[Any], receive: Receive) -> Any:
    """Await ``call``; if the client's connection is lost meanwhile, cancel it and raise Disconnected.

    Over gRPC a client that goes away cancels its handler, which drops its
    request from the model's queue. uvicorn cancels nothing: the handler's task
    is left on its request cycle (``receive``'s owner) for the listener's
    protocol to cancel when the connection is lost (see
    :class:`nereid.protocol.http_listener._BoundedHeadProtocol`), which costs a request nothing until then.
    """
    cycle = getattr(receive, "__self__", None)  # uvicorn's cycle; absent when the app is called directly
    if cycle is None:
        return await call
    if getattr(cycle, "disconnected", False):
        # Lost after its body was read and before this handler could be cancelled: it never starts.
        if inspect.iscoroutine(call):
            call.close()
        raise Disconnected("before its answer: the request was not run", before_start=True)
    cycle.nereid_handler = asyncio.current_task()
    try:
        return await call
    except asyncio.CancelledError:
        if getattr(cycle, "disconnected", False):
            cycle.nereid_handler.uncancel()
            raise Disconnected("before its answer: a queued request was dropped, a running one's answer "
                               "is discarded") from None
        raise
    finally:
        cycle.nereid_handler = None


def _body_never_asked_for(receive: Receive) -> bool:
    """Whether the request asked ``Expect: 100-continue`` and its body, not all arrived, was never asked for.

    uvicorn answers 100 Continue at a request's first ``receive`` (or never, once
    its answer has started), and clears ``waiting_for_100_continue`` then;
    ``more_body`` is False once the whole message was parsed (a client may send
    the body without waiting, or have none to send).
    """
    cycle = getattr(receive, "__self__", None)  # uvicorn's cycle; absent when the app is called directly
    return bool(getattr(cycle, "waiting_for_100_continue", False) and getattr(cycle, "more_body", False))


def peer(client: tuple[str, int] | None) -> str:
    """A client's address as log lines name it: ``127.0.0.1:40312``, ``[::1]:40312`` (``unknown`` without one)."""
    if not client:
        return "unknown"
    host, port = client[0], client[1]
    if host.startswith("::ffff:") and "." in host:  # an IPv4 client of a dual-stack [::] listener, as gRPC names it
        host = host.removeprefix("::ffff:")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# Header fields whose repeated lines make one comma-separated list (RFC 9110, 5.3), read as one.
_LIST_FIELDS = frozenset((b"content-encoding", b"transfer-encoding", b"connection", b"upgrade",
                          b"accept-encoding"))  # (Accept-Encoding's lines: the last alone was read; the HTTP read hunt)
# Header fields that hold one value: repeated with another value, which one counts is not known (a proxy in front
# may read the first where the last won here: an Inference-Header-Content-Length splitting the body elsewhere).
_SINGLE_FIELDS = {b"content-type": "Content-Type", b"content-length": "Content-Length", b"origin": "Origin",
                  HEADER_LENGTH.encode(): "Inference-Header-Content-Length"}


def request_headers(scope: Scope, model: str) -> dict[bytes, bytes]:
    """The request's header fields by (lower-case) name, repeated lines of a list field combined; HttpError 400
    for a one-value field repeated with different values. (A dict of the lines kept the last of each: a second
    ``Content-Encoding: identity`` line hid a gzip body, a second ``Transfer-Encoding`` line a gzip coding.)"""
    headers: dict[bytes, bytes] = {}
    for name, value in scope["headers"]:
        seen = headers.get(name)
        if seen is not None and name in _LIST_FIELDS:
            value = seen + b", " + value
        elif seen is not None and seen != value and name in _SINGLE_FIELDS:
            raise HttpError(400, f"{_who(model)}the request has {_SINGLE_FIELDS[name]} twice, with different "
                                 f"values ({header_text(seen)!r} and {header_text(value)!r}); "
                                 "send it once")
        headers[name] = value
    return headers


def _refuse_compressed(headers: dict[bytes, bytes], who: str) -> None:
    """HttpError 400 for a compressed repository request body: only infer bodies are decompressed, as Triton
    decompresses only those (a gzip body was read as JSON and refused as invalid JSON; the HTTP hunt)."""
    codings = headers.get(b"content-encoding", b"identity").lower().split(b",")  # (any case; a list)
    if any(coding.strip() not in (b"identity", b"") for coding in codings):
        raise HttpError(400, f"{who}compressed request bodies are taken by infer requests only "
                             f"(Content-Encoding: {header_text(headers[b'content-encoding'])}); "
                             "send it uncompressed")


async def _compressed_answer(parts: list[bytes | memoryview], headers: list,
                             coding: str) -> tuple[list[bytes | memoryview], list]:
    """An infer answer's body and headers, compressed with ``coding`` (on a worker thread when large); as they
    are, uncompressed, if that fails (out of memory), as Triton falls back."""
    try:
        if sum(len(part) for part in parts) < COMPRESS_OFF_LOOP_BYTES:
            body = compressed(parts, coding)
        else:
            body = await on_work_thread(compressed, parts, coding)
    except (MemoryError, ThreadStartFailed):  # (no thread to compress on: the answer goes as it is)
        return parts, headers
    return [body], [*headers, (b"content-encoding", coding.encode())]


def _ended_turn(turn: asyncio.Semaphore, future: asyncio.Future) -> None:
    turn.release()
    if not future.cancelled():
        future.exception()  # retrieved here: a cancelled handler no longer awaits it, and asyncio would log it


def encoded_answer(response: InferResponse, choice: OutputChoice) -> EncodedAnswer | Awaitable[EncodedAnswer]:
    """:func:`encode_infer` of ``response``: at once when small, on a worker thread (an awaitable) when its outputs
    take :data:`ENCODE_OFF_LOOP_BYTES` or hold :data:`ENCODE_OFF_LOOP_ELEMENTS` elements."""
    size = elements = 0
    for tensor in response.outputs:
        size += tensor.data.nbytes
        elements += tensor.data.size
    if size >= ENCODE_OFF_LOOP_BYTES or elements >= ENCODE_OFF_LOOP_ELEMENTS:
        return on_work_thread_or_here(encode_infer, response, choice)  # (the model has run: never refused now)
    return encode_infer(response, choice)


def _listener_mark(receive: Receive) -> tuple[str, int] | None:
    """How the listener has answered this request already, a body the HTTP parser could not read (see
    http_listener's _refuse_unparsable): (why, the status it answered); None while the request is the handler's."""
    cycle = getattr(receive, "__self__", None)
    unparsable = getattr(cycle, "nereid_unparsable", None)
    return None if unparsable is None else (unparsable, getattr(cycle, "nereid_unparsable_status", 400))


def _listener_refusal(receive: Receive, model: str) -> NereidError | None:
    """What the listener has already answered this request with, as the failure it counts as (InvalidArgument for
    its 400, OutOfMemory for a 503); None while the request is the handler's."""
    mark = _listener_mark(receive)
    if mark is None:
        return None
    kind = OutOfMemory if mark[1] == 503 else InvalidArgument
    return kind(f"{_who(model)}{mark[0]}")


def _who(model: str) -> str:
    return f"model '{model}': " if model else ""


def _path_segments(scope: Scope) -> list[str]:
    """The request path's segments as sent, still percent-encoded (a model's name or a version is decoded where
    it is read: :func:`_path_value`): split at every "/" after the leading one, empty segments kept.

    Triton matches its routes on the raw path, whole: ``//v2/repository/...``, a slash at the end, or an
    endpoint's word spelled encoded (``/v2/%72epository/...``) match none, and neither does an encoded
    slash (``%2F``), which is a character of its segment, never a separator (RFC 3986 2.2). Each of these
    once reached the endpoint, past a proxy's rule on ``/v2/repository/`` that matches the raw prefix:
    stripped of its slashes, or decoded first (``/v2/repository%2Fmodels%2Fm%2Funload`` unloaded ``m``).
    """
    raw = scope.get("raw_path")
    # (An ASGI server that gives no raw path: only the decoded one is known, encoded again here.)
    path = quote(scope["path"], safe="/") if raw is None else raw.split(b"?", 1)[0].decode("latin-1")
    return path[1:].split("/") if path.startswith("/") else [path]


def _path_value(segment: str) -> str:
    """A value the path holds (a model's name, a version) from its segment: percent-decoded, so a name may hold
    any character (``my%20model``); an endpoint's own words are matched as sent (see :func:`_path_segments`)."""
    return unquote(segment)


def _shown_path(scope: Scope) -> str:
    """The request's path as the client sent it, for messages: decoded, ``/v2/repository%2Fmodels%2Fm%2Funload``
    read as an endpoint that exists (an encoded slash is no separator, see :func:`_path_segments`)."""
    raw = scope.get("raw_path")
    path = scope["path"] if raw is None else raw.split(b"?", 1)[0].decode("latin-1")
    return cap_message(path, 256)


def _json(document: Any, status: int = 200) -> tuple[int, list[bytes | memoryview], list]:
    return status, [orjson.dumps(document)], JSON_HEADERS


def _json_object(body: bytes, what: str) -> dict:
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError as err:
        raise HttpError(400, f"{what} is not valid JSON ({err})") from None
    if not isinstance(document, dict):
        raise HttpError(400, f"{what} must be a JSON object")
    return document


def _parameters(body: bytes, what: str) -> dict:
    """The ``parameters`` object of a repository request's optional JSON body (empty without one)."""
    if not body.strip():
        return {}
    parameters = _json_object(body, what).get("parameters", {})
    if not isinstance(parameters, dict):
        raise HttpError(400, f"{what}: 'parameters' must be a JSON object")
    return parameters


def _not_found(scope: Scope, parts: list[str]) -> HttpError:
    """404 for an unknown endpoint; 405 with Allow for a known one asked with the wrong method, as Triton
    answers it (worked out only here, off the path of requests that route)."""
    method, path = scope["method"], _shown_path(scope)
    allowed = _allowed_method(parts)
    if allowed is None or (method == "HEAD" and allowed == "GET"):
        return HttpError(404, f"no such endpoint: {method} {path}")
    return HttpError(405, f"{method} is not allowed on {path} (use {allowed})",
                     [(b"allow", b"GET, HEAD" if allowed == "GET" else allowed.encode())])


def _allowed_method(parts: list[str]) -> str | None:
    """The method a known endpoint takes (the path under /v2, split at "/"), or None for an unknown path."""
    method = SERVER_ENDPOINTS.get(tuple(parts))
    if method is not None:
        return method
    if len(parts) == 4 and parts[:2] == ["repository", "models"] and parts[3] in ("load", "unload"):
        return "POST"
    if len(parts) >= 2 and parts[0] == "models":
        rest = parts[2:]
        if rest[:1] == ["versions"] and len(rest) >= 2:
            rest = rest[2:]
        if not rest:
            return MODEL_ENDPOINTS[""]
        if len(rest) == 1 and rest[0]:
            return MODEL_ENDPOINTS.get(rest[0])
    return None


def _health(field: str, ok: bool, **context: str) -> tuple[int, list[bytes | memoryview], list]:
    """A health answer: Triton's status (200, or 400 when not live / not ready) and KServe's JSON body.

    Triton's clients read only the status; the KServe SDK's REST client reads
    ``live`` / ``ready`` from the body (KServe's own server sends it).
    """
    return _json({**context, field: ok}, 200 if ok else 400)


def error_body(message: str) -> list[bytes]:
    try:
        return [orjson.dumps({"error": cap_message(message)})]
    except orjson.JSONEncodeError:  # a lone surrogate (from a name the client sent): escape it instead
        return [json.dumps({"error": cap_message(message)}).encode()]


def _tensor_json(tensor) -> dict:
    return {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}


def _config_json(config: ModelConfig) -> dict:
    """Triton's JSON form of the model configuration (proto field names, integers as numbers)."""
    def tensor(t) -> dict:
        return {"name": t.name, "data_type": t.config_type, "dims": list(t.shape)}

    document: dict[str, Any] = {
        "name": config.name, "platform": config.platform, "backend": config.backend,
        "max_batch_size": config.max_batch_size,
        "input": [tensor(t) for t in config.inputs], "output": [tensor(t) for t in config.outputs],
        "instance_group": [{"name": f"{config.name}_0", "count": config.instance_group.count,
                            "kind": config.instance_group.kind, "gpus": list(config.instance_group.gpus)}],
    }
    if config.dynamic_batching is not None:
        document["dynamic_batching"] = {
            "max_queue_delay_microseconds": config.dynamic_batching.max_queue_delay_us,
            "preferred_batch_size": list(config.dynamic_batching.preferred_batch_sizes)}
    return document


def _duration(duration) -> dict:
    return {"count": duration.count, "ns": duration.ns}


def _statistics(models: list[tuple[str, ModelStats]]) -> dict:
    """Triton's ``/stats`` document."""
    stats_json = []
    for name, stats in models:
        stats_json.append({
            "name": name, "version": MODEL_VERSION, "last_inference": stats.last_inference_ms,
            "inference_count": stats.inference_count, "execution_count": stats.execution_count,
            "inference_stats": {
                **{field: _duration(getattr(stats, field)) for field in
                   ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")},
                # Triton always reports its response cache; nereid has none, so never a hit or a miss. Present so
                # that a client reading them (a dashboard written against Triton) finds them.
                "cache_hit": {"count": 0, "ns": 0}, "cache_miss": {"count": 0, "ns": 0}},
            "batch_stats": [{"batch_size": size,
                             **{field: _duration(getattr(stats.batches[size], field))
                                for field in ("compute_input", "compute_infer", "compute_output")}}
                            for size in sorted(stats.batches)],
            # Triton's per-device memory of the model (2.41's document always has the list, empty when unknown);
            # nereid measures none, as its gRPC ModelStatistics leaves the repeated field empty.
            "memory_usage": [],
        })
    return {"model_stats": stats_json}


async def _respond(send: Send, status: int, body: list[bytes | memoryview], headers: list) -> None:
    length = sum(len(part) for part in body)
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(length).encode())]})
    if length <= JOIN_BELOW_BYTES:  # one write for a small response; large parts go out as they are, uncopied
        body = [b"".join(body)]
    for index, part in enumerate(body):
        await send({"type": "http.response.body", "body": part, "more_body": index < len(body) - 1})
