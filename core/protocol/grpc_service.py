"""``inference.GRPCInferenceService``: the KServe V2 RPCs and nereid's Triton extensions.

Handlers only translate: messages in, data-plane calls, messages out, and
protocol-neutral errors mapped to gRPC status codes in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import functools
import logging
import weakref
from urllib.parse import unquote
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc

from nereid.daemon_pool import ThreadStartFailed, on_work_thread, on_work_thread_or_here, work_pool
from nereid._proto import grpc_service_pb2 as pb
from nereid._proto import model_config_pb2 as mc
from nereid.dataplane import DataPlane, cancellation_reason, past_grace_message
from nereid.errors import (ConfigError, DeadlineExceeded, InvalidArgument, ModelFailure, NereidError, NotFound,
                           OutOfMemory, PermissionDenied, PublicText, Unavailable, Unimplemented, cap_message,
                           shown_name)
from nereid.log_limit import RateLimitedLog
from nereid.memory import TRIM_AFTER_BYTES, release_free_heap
from nereid.model_info import MODEL_VERSION, ModelConfig
from nereid.protocol.grpc_codec import (decode_infer_request, mark_final, parse_infer_request,
                                        serialize_infer_response)
from nereid.protocol.wire import DECODE_OFF_LOOP_BYTES
from nereid.stats import ModelStats
from nereid.task_sets import until_all_done
from nereid.tensors import InferResponse

log = logging.getLogger(__name__)

SERVICE_NAME = "inference.GRPCInferenceService"

STATUS_OF_ERROR: dict[type[NereidError], grpc.StatusCode] = {
    NotFound: grpc.StatusCode.NOT_FOUND,
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    ConfigError: grpc.StatusCode.INVALID_ARGUMENT,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    ModelFailure: grpc.StatusCode.INTERNAL,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    Unimplemented: grpc.StatusCode.UNIMPLEMENTED,
}


def peer(grpc_peer: str) -> str:
    """A client's address as gRPC names it (``ipv4:127.0.0.1:40312``, ``ipv6:[::1]:40312``, percent-encoded in
    some releases) as log lines name it, the way HTTP's lines do: ``127.0.0.1:40312``, ``[::1]:40312``. Other
    kinds (``unix:/run/nereid.sock``) are kept as they are."""
    kind, _, address = grpc_peer.partition(":")
    return unquote(address) if kind in ("ipv4", "ipv6") else grpc_peer


def status_of(error: NereidError) -> grpc.StatusCode:
    """The gRPC status code for a nereid error (INTERNAL for anything unmapped)."""
    for kind in type(error).__mro__:
        if kind in STATUS_OF_ERROR:
            return STATUS_OF_ERROR[kind]
    return grpc.StatusCode.INTERNAL


Handler = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]

# Requests of one ModelStreamInfer call that may be read but not yet answered on the wire.
STREAM_IN_FLIGHT = 256
# And their bytes, as received: past them reading pauses until earlier answers are sent (one request alone always
# reads). A count alone let one stream hold 256 requests of max_message_bytes each, and their answers, behind one
# slow request: 32 GiB with the defaults (the gRPC read hunt).
STREAM_BYTES_IN_FLIGHT = 256 << 20

# What a ModelStreamInfer stream ended at shutdown says (as its UNAVAILABLE status): only requests it had sent
# before then were read, and each of those has had its answer.
STREAM_CLOSED_AT_SHUTDOWN = ("the server is shutting down: this stream takes no new request and was closed once "
                             "every request read from it had its answer; send what was not answered elsewhere")

# A call cancelled again this close to gRPC's expected cut, or after it, was cut off by the stop (its deadline and
# the loop's turn that cancels the calls are not exactly the moment end_at_grace expects).
CUT_TOLERANCE_S = 0.1


class _Wake:
    """What :meth:`InferenceServicer.close_streams` puts in each open stream's answer queue: a sign to look at
    whether the stream is to end, for a stream waiting for answers that may never come (an idle one)."""


_WAKE = _Wake()

# What a status message may take once gRPC has percent-encoded it into the grpc-message trailer: each byte
# outside printable ASCII, and "%", takes three. Clients refuse a response whose metadata passes 8 KiB at
# random and 16 KiB always (RESOURCE_EXHAUSTED "Stream removed", the real status lost), so a message of
# 4,096 non-ASCII characters (a model name in Cyrillic, a model's own error) must be cut shorter.
STATUS_MESSAGE_BYTES = 6144


def status_message(text: str, limit: int = STATUS_MESSAGE_BYTES) -> str:
    """``text`` capped as :func:`cap_message` caps it, and cut shorter in its middle (on characters) when its
    percent-encoded form would pass ``limit`` bytes, saying how much was cut: its end, where a chain of meta
    models' sub-calls names the first cause, stays (a bug hunt: a long non-ASCII message lost it)."""
    capped = cap_message(text)
    if _encoded_size(capped) <= limit:
        return capped
    room = limit - 64  # 64: the note, which is ASCII
    tail_room = room // 4  # the start's share as cap_message gives it, in bytes rather than characters
    head, size = 0, 0
    while head < len(text) and size + (step := _encoded_size(text[head])) <= room - tail_room:
        head, size = head + 1, size + step
    tail, size = len(text), 0
    while tail > head and size + (step := _encoded_size(text[tail - 1])) <= tail_room:
        tail, size = tail - 1, size + step
    return f"{text[:head]} ... [{tail - head} characters cut] ... {text[tail:]}"


def _encoded_size(text: str) -> int:
    """Bytes ``text`` takes percent-encoded as gRPC encodes a status message."""
    raw = text.encode("utf-8", "surrogatepass")
    printable = sum(1 for byte in raw if 0x20 <= byte <= 0x7E and byte != 0x25)
    return printable + 3 * (len(raw) - printable)


# Answers whose outputs take at least this much are serialized on a worker thread (the one copy of their data
# costs about a millisecond per 1 MiB here; the hand-off about 50 µs).
SERIALIZE_OFF_LOOP_BYTES = 4 << 20
# The most one gRPC message may take: grpcio sends nothing larger. Answers are not capped by
# server.max_message_bytes (that bounds what clients send).
MAX_SEND_MESSAGE_BYTES = (1 << 31) - 1


# A unary call this close to its gRPC deadline, or past it, is left to gRPC's core to end (see _maps_errors).
DEADLINE_ENDS_THE_CALL_S = 0.001

# nereid_protocol_refused_total's reason for a request gRPC delivered but protobuf cannot parse.
REFUSED_UNPARSABLE = "unparsable"
REFUSED_OUT_OF_MEMORY = "out_of_memory"  # (HTTP's word for it too)


class Unreadable:
    """What a handler receives in place of a request whose bytes are not a valid message, or that the server ran
    out of memory parsing (``out_of_memory``: the server's passing condition, not the client's fault)."""

    __slots__ = ("message_type", "size", "problem", "out_of_memory")

    def __init__(self, message_type: str, size: int, problem: str, out_of_memory: bool = False) -> None:
        self.message_type = message_type
        self.size = size
        self.problem = problem
        self.out_of_memory = out_of_memory

    def describe(self) -> str:
        """The client-facing reason (one line, capped)."""
        if self.out_of_memory:
            return (f"the server ran out of memory reading a {self.size}-byte {self.message_type}; try again later, "
                    "or send its tensors in smaller requests")
        return cap_message(f"cannot parse the {self.size}-byte request as {self.message_type}: {self.problem}", 512)

    @property
    def status(self) -> grpc.StatusCode:
        """UNAVAILABLE for a server out of memory (as HTTP's 503 for it), else INVALID_ARGUMENT."""
        return grpc.StatusCode.UNAVAILABLE if self.out_of_memory else grpc.StatusCode.INVALID_ARGUMENT


class Received:
    """A parsed inference request, its raw input contents (views of the wire bytes) and its size."""

    __slots__ = ("message", "raws", "size")

    def __init__(self, message: pb.ModelInferRequest, raws: list[bytes | memoryview], size: int) -> None:
        self.message = message
        self.raws = raws
        self.size = size


def _parse(message_type: type, data: bytes) -> Any:
    try:
        return message_type.FromString(data)
    except Exception as err:  # DecodeError, or any other failure of the parser on hostile bytes
        return _unreadable(message_type, data, err)


def _parse_infer(data: bytes) -> Received | Unreadable:
    try:
        message, raws = parse_infer_request(data)
    except Exception as err:
        return _unreadable(pb.ModelInferRequest, data, err)
    return Received(message, raws, len(data))


def _unreadable(message_type: type, data: bytes, err: Exception) -> Unreadable:
    if isinstance(err, MemoryError):
        # Not "cannot parse" (INVALID_ARGUMENT, counted unparsable): the message may be fine, the server was not.
        err.__traceback__ = None  # (its frames hold what the parse had built)
        return Unreadable(message_type.DESCRIPTOR.name, len(data), "", out_of_memory=True)
    # protobuf names the type by nereid's own copy of the protocol's package ('nereid.v2.ModelInferRequest'),
    # which no client's .proto has: named as on the wire (the bug hunt of the gRPC surface).
    problem = (str(err) or type(err).__name__).replace(f"'{message_type.DESCRIPTOR.file.package}.", "'inference.")
    return Unreadable(message_type.DESCRIPTOR.name, len(data), problem)


def request_parser(message_type: type) -> Callable[[bytes], Any]:
    """A gRPC request deserializer that never raises: bad bytes become an :class:`Unreadable`.

    grpc's own handling of a deserializer failure is UNKNOWN with a logged
    traceback, and on a stream it silently ends the call, dropping the answers
    of requests already accepted. Inference requests keep their raw contents as
    views of the received bytes (see :func:`parse_infer_request`).
    """
    if message_type is pb.ModelInferRequest:
        return _parse_infer
    return functools.partial(_parse, message_type)


async def _serialized(response: InferResponse, streamed: bool) -> bytes:
    """``response``'s wire bytes, with one copy of the outputs (see serialize_infer_response): made off the event
    loop when large (a 1 GB answer held it for a second), and refused as the model's fault past what one gRPC
    message carries (grpcio's own refusal named no model, after the request was counted a success)."""
    size = sum(tensor.data.nbytes for tensor in response.outputs)
    try:
        if size >= SERIALIZE_OFF_LOOP_BYTES:
            # (on the loop when no thread can start: the model has run, and its answer must not be refused now)
            wire = await on_work_thread_or_here(functools.partial(serialize_infer_response, streamed=streamed),
                                                response)
        else:
            wire = serialize_infer_response(response, streamed=streamed)
    except MemoryError:
        # The server's passing condition, UNAVAILABLE as HTTP's 503 for it, where it was INTERNAL "internal error"
        # with a traceback and no count of the protocol's (the statistics hunt).
        raise OutOfMemory(PublicText(f"model '{response.model_name}': the server ran out of memory serializing its "
                                     f"{size}-byte answer; try again later")) from None
    if len(wire) > MAX_SEND_MESSAGE_BYTES:
        raise ModelFailure(f"model '{response.model_name}': its answer takes {len(wire)} bytes, more than one gRPC "
                           f"message carries ({MAX_SEND_MESSAGE_BYTES}); ask for fewer outputs, or call it over HTTP")
    return wire


def decode_out_of_memory(model: str, size: int) -> OutOfMemory:
    """The error for a MemoryError met decoding a ``size``-byte inference request to ``model`` (UNAVAILABLE,
    counted ``internal``, as HTTP's 503 for it is)."""
    return OutOfMemory(PublicText(f"model '{model}': the server ran out of memory decoding a {size}-byte request; "
                                  "try again later, or send its tensors in smaller requests"))


def _maps_errors(handler: Handler) -> Handler:
    @functools.wraps(handler)
    async def wrapper(self: "InferenceServicer", request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Unreadable):
            code, message = request.status, self._refuse_unreadable(handler.__name__, request, context)
        else:
            try:
                return await handler(self, request, context)
            except NereidError as err:
                code, message = status_of(err), self.dataplane.error_text(err)
            except Exception as err:  # a bug, not the client's fault: say so instead of grpc's bare UNKNOWN
                self.fault_log.error("%s failed", handler.__name__, exc_info=err)
                code, message = grpc.StatusCode.INTERNAL, self.dataplane.error_text(err, handler.__name__)
        # Abort outside the except blocks: an exception raised inside one chains to the caught error,
        # whose traceback holds the frames holding the request, and that reference cycle kept rejected
        # gigabyte requests alive until the garbage collector happened to run.
        del request
        remaining_s = context.time_remaining()
        if remaining_s is not None and remaining_s <= DEADLINE_ENDS_THE_CALL_S:
            # Its deadline ends the call in gRPC's core (DEADLINE_EXCEEDED, which the client's own timer gives it
            # at that instant too): a status sent now races that end, and grpcio leaks the batch of a status that
            # fails on an ended call (grpc/grpc#43360). A queue expiring requests at their gRPC deadline, as the
            # scheduler does, leaked 74 bytes of native memory a request (a leak hunt: 7 GB a day at 1,000
            # expiring a second). The handler ends without a status, as one that gRPC cancels does.
            raise asyncio.CancelledError
        await context.abort(code, status_message(message))
    return wrapper


class InferenceServicer:
    """The RPC implementations over one :class:`DataPlane`: each converts messages and nothing more."""

    def __init__(self, dataplane: DataPlane, count_request: Callable[[str, str], None] | None = None,
                 count_refused: Callable[[str], None] | None = None) -> None:
        """``count_request(model, outcome)`` counts each inference request answered; ``count_refused(reason)``
        each request refused before any model saw it (one that cannot be parsed: :data:`REFUSED_UNPARSABLE`)."""
        self.dataplane = dataplane
        self._count = count_request
        self._count_refused = count_refused
        # What a client can trigger at will (unreadable messages) is logged at a bounded rate, per server.
        self.client_log = RateLimitedLog(log)
        # A request's failure that is a bug of nereid's, with its traceback: a client could repeat one at will too.
        self.fault_log = RateLimitedLog(log)
        # The answer queues of the open ModelStreamInfer calls, and whether they are to end (close_streams).
        self._streams: set[asyncio.Queue] = set()
        self._closing_streams = False
        # The inference requests running (a ModelInfer call's task, a stream request's answer task), and those
        # end_at_grace cancelled: only those are answered as ended at the grace (any other cancellation is a
        # client gone or gRPC's own).
        self._running: set[asyncio.Task] = set()
        # RepositoryModelLoad / Unload calls running: ended at the grace too, answered as HTTP's are.
        self._repository_calls: set[asyncio.Task] = set()
        self._ended_at_grace: weakref.WeakSet[asyncio.Task] = weakref.WeakSet()
        # Of those, how many were answered only once gRPC's stop had cut their call off, and which.
        self._cut_off_at_grace = 0
        self._cut_off: weakref.WeakSet[asyncio.Task] = weakref.WeakSet()
        # Stream answers ready and not yet sent, in every stream: an answer waits behind an earlier request's of its
        # stream (answers go out in the stream's order), which at a stop may be one whose model did not end.
        self._stream_answers_unsent = 0
        # When gRPC's stop is to cut the calls still open (end_at_grace): a call cancelled again before then was
        # its client's doing, not the cut's.
        self._cut_expected_at = float("inf")

    def _refuse_unreadable(self, rpc: str, request: Unreadable, context: grpc.aio.ServicerContext) -> str:
        """Count and log (naming its client) a request that cannot be parsed; the client's answer."""
        message = request.describe()
        if self._count_refused is not None:
            self._count_refused(REFUSED_OUT_OF_MEMORY if request.out_of_memory else REFUSED_UNPARSABLE)
        self.client_log.warning("%s from %s: %s%s", rpc, peer(context.peer()), message,
                                "; answered UNAVAILABLE" if request.out_of_memory else "")
        return message

    def close_streams(self) -> None:
        """At shutdown: end each ModelStreamInfer stream once every request read from it is answered (an idle one
        at once), rather than leave it open for gRPC's graceful stop to wait on until the grace runs out.

        The data plane is shutting down already, so a request read from here on is answered UNAVAILABLE in its
        stream before the stream ends.
        """
        self._closing_streams = True
        for answers in self._streams:
            answers.put_nowait(_WAKE)

    def end_at_grace(self, cut_in_s: float) -> int:
        """At shutdown, once the grace has passed: end every inference request still running, each answered
        UNAVAILABLE (:func:`past_grace_message`): a ModelInfer call with that status, a stream's request in its
        stream, which then ends as :meth:`close_streams` says. Returns how many were ended.

        gRPC's own stop would cancel them at its deadline instead: a stream's requests then got no answer at all.
        """
        running = list(self._running)
        self._cut_expected_at = time.monotonic() + cut_in_s
        loop = asyncio.get_running_loop()
        for task in [*running, *self._repository_calls]:
            # Cancelled from the next turn of the loop: a task created in this one has then taken its first
            # step, into the code that answers (a task cancelled before it starts runs none of its code).
            loop.call_soon(self._end, task)
        return len(running)

    def never_answered_after_grace(self) -> int:
        """How many answers gRPC's stop cut off, read once it has returned: requests :meth:`end_at_grace` ended whose
        model's code did not end when cancelled (a coroutine that swallows CancelledError), still running or ended
        only once gRPC's stop had cut their call off; and stream answers ready but not sent, waiting behind such a
        request of their stream (the hunts of fa51e5c and 20eccc6: counted nowhere, whether answered at the grace
        or before it)."""
        return self._cut_off_at_grace + self._stream_answers_unsent + sum(
            1 for task in self._ended_at_grace if not task.done() and task not in self._cut_off)

    @property
    def running_requests(self) -> int:
        """How many inference requests (ModelInfer calls, stream requests) are running: what the grace waits for."""
        return len(self._running)

    def _end(self, task: asyncio.Task) -> None:
        if not task.done():
            self._ended_at_grace.add(task)
            task.cancel()

    def _past_grace(self) -> bool:
        """Whether the current task's cancellation is :meth:`end_at_grace`'s."""
        return asyncio.current_task() in self._ended_at_grace

    def _answered_at_grace(self) -> bool:
        """Whether the current task's cancellation is :meth:`end_at_grace`'s; if so it is undone, so that the
        request is answered (UNAVAILABLE) rather than cancelled."""
        if not self._past_grace():
            return False
        task = asyncio.current_task()
        if task.cancelling() > 1 and time.monotonic() >= self._cut_expected_at - CUT_TOLERANCE_S:
            # Cancelled again since end_at_grace's, by gRPC's stop cutting the call off (a meta model's
            # orchestration having swallowed the first): the answer reaches no one. Counted here, as it happens:
            # whether the task is still running when gRPC's stop returns depends on which of the two the loop runs
            # first. (Cancelled again before the cut, its client left: not the stop's doing; the hunt of 20eccc6.)
            self._cut_off_at_grace += 1
            self._cut_off.add(task)  # (counted once, if it still runs, answering)
        task.uncancel()
        return True

    @_maps_errors
    async def ServerLive(self, request: pb.ServerLiveRequest, context) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=self.dataplane.live())

    @_maps_errors
    async def ServerReady(self, request: pb.ServerReadyRequest, context) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.dataplane.ready())

    @_maps_errors
    async def ModelReady(self, request: pb.ModelReadyRequest, context) -> pb.ModelReadyResponse:
        return pb.ModelReadyResponse(ready=self.dataplane.model_ready(request.name, request.version))

    @_maps_errors
    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context) -> pb.ServerMetadataResponse:
        name, version, extensions = self.dataplane.server_metadata()
        return pb.ServerMetadataResponse(name=name, version=version, extensions=extensions)

    @_maps_errors
    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context) -> pb.ModelMetadataResponse:
        metadata = self.dataplane.model_metadata(request.name, request.version)
        response = pb.ModelMetadataResponse(name=metadata.name, versions=metadata.versions,
                                            platform=metadata.platform)
        for collection, tensors in ((response.inputs, metadata.inputs), (response.outputs, metadata.outputs)):
            for tensor in tensors:
                collection.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        return response

    @_maps_errors
    async def ModelConfig(self, request: pb.ModelConfigRequest, context) -> pb.ModelConfigResponse:
        return pb.ModelConfigResponse(config=config_message(self.dataplane.model_config(request.name,
                                                                                        request.version)))

    @_maps_errors
    async def ModelInfer(self, request: Received, context) -> bytes:
        model = request.message.model_name
        task = asyncio.current_task()
        self._running.add(task)
        try:
            return await self._infer(request, context)
        except asyncio.CancelledError:
            if not self._answered_at_grace():
                raise
            raise Unavailable(past_grace_message(model)) from None  # (answered by _maps_errors)
        finally:
            self._running.discard(task)

    async def _infer(self, received: Received, context, streamed: bool = False,
                     counted: Callable[[str, str], None] | None = None,
                     wait_for_room: bool = False) -> bytes:
        """Run one request; its answer serialized (``streamed``: as a ModelStreamInferResponse). Its outcome is
        counted among the protocol's requests, or given to ``counted`` (a stream's: counted once sent).
        ``wait_for_room``: the request waits for room in a full queue rather than be refused (see
        DataPlane.infer_encoded)."""
        count = counted or self._counted
        request = received.message
        if received.size >= TRIM_AFTER_BYTES:
            # gRPC's copies of this message are freed by now: give their pages back, off the loop.
            with contextlib.suppress(ThreadStartFailed):  # (no thread now: the next large request trims)
                asyncio.get_running_loop().run_in_executor(work_pool(), release_free_heap)
        model_name = request.model_name
        # The gRPC deadline, read with the instant it was read: a large request's decode must not move it.
        sampled_ns, remaining_s = time.monotonic_ns(), context.time_remaining()
        try:
            self.dataplane.admit(model_name)
            declared = self.dataplane.check_target(model_name, request.model_version).input_datatypes
            if received.size >= DECODE_OFF_LOOP_BYTES:
                decoded = await on_work_thread(decode_infer_request, request, remaining_s, received.raws,
                                               sampled_ns, declared)
            else:
                decoded = decode_infer_request(request, remaining_s, received.raws, sampled_ns, declared)
        except NereidError as err:  # refused before the data plane: counted like its own refusals
            self.dataplane.refused(model_name, err)
            count(model_name, err.reason)
            raise
        except MemoryError as lost:
            # The server's passing condition, not a bug nor the client's fault: UNAVAILABLE naming the model, as HTTP
            # answers it (503), without a traceback (formatting one may fail again). Its frames hold what the decode
            # had built, and would stay reachable from the answer's context: let go.
            lost.__traceback__ = None
            error = decode_out_of_memory(model_name, received.size)
            self.client_log.warning("%s from %s: %s; answered UNAVAILABLE", "ModelStreamInfer" if streamed
                                    else "ModelInfer", peer(context.peer()), error)
            self.dataplane.refused(model_name, error)
            count(model_name, error.reason)
            raise error from None
        except asyncio.CancelledError:  # gone while a large request was decoded off the loop: it never started
            reason = self._ended_reason(sampled_ns + int(remaining_s * 1e9) if remaining_s is not None else 0)
            self.dataplane.count_failure(model_name, reason)
            count(model_name, reason)
            raise
        del request, received  # the decoded tensors are all that is needed from here on
        try:
            # Serialized before the request counts as a success: an answer gRPC cannot carry is its failure.
            wire = await self.dataplane.infer_encoded(decoded, functools.partial(_serialized, streamed=streamed),
                                                      wait_for_room=wait_for_room)
        except NereidError as err:
            count(decoded.model_name, err.reason)
            raise
        except asyncio.CancelledError:  # the client cancelled, gRPC ended the call at its deadline, or the grace
            count(decoded.model_name, self._ended_reason(decoded.deadline_ns))
            raise
        except Exception:  # (a bug of the server's, answered INTERNAL: counted all the same, as HTTP counts it)
            count(decoded.model_name, NereidError.reason)
            raise
        count(decoded.model_name, "success")
        return wire

    def _ended_reason(self, deadline_ns: int) -> str:
        """What a request whose task was cancelled counts as: ``unavailable`` when the server ended it at the
        grace, else as :func:`cancellation_reason` tells a client gone from one ended at its deadline."""
        return "unavailable" if self._past_grace() else cancellation_reason(deadline_ns, time.monotonic_ns())

    def _counted(self, model: str, outcome: str) -> None:
        if self._count is not None:
            self._count(model, outcome)

    async def ModelStreamInfer(self, requests: AsyncIterator[Received | Unreadable],
                               context) -> AsyncIterator[pb.ModelStreamInferResponse | bytes]:
        """Requests run concurrently; their answers (or errors) are sent in the order the requests were read,
        as Triton sends a non-decoupled model's: tritonclient's stream callback gets no request, so a client
        may pair answers with requests by position.

        Every request read gets exactly one answer, even when a later message is
        unreadable or the client's side of the stream fails: the stream ends
        only once all of them are answered. After :meth:`close_streams` it ends
        (UNAVAILABLE) as soon as none is left unanswered; :meth:`end_at_grace`
        answers those still running then.
        """
        # Each finished answer with its request's place in the stream (from 0, in reading order).
        answers: asyncio.Queue[tuple[int, pb.ModelStreamInferResponse | bytes] | _Wake | None] = asyncio.Queue()
        pending: set[asyncio.Task] = set()
        # Requests read and not yet answered on the wire: counted from the moment each is read (before its task
        # exists), so that a stream closed at shutdown never drops one.
        unanswered = 0
        # Requests read but not yet answered on the wire. At the cap, reading pauses until the client
        # takes answers, so a client that sends without reading cannot pile up answers in memory.
        in_flight = asyncio.Semaphore(STREAM_IN_FLIGHT)
        held_bytes = 0  # the received sizes of the requests read and not yet answered on the wire
        sizes: dict[int, int] = {}  # by place
        bytes_freed = asyncio.Event()
        # A request that meets its model's full queue waits for room there, as Triton's unbounded queue would take it
        # (a burst of perf_analyzer --streaming past queue_capacity was refused). Reading goes on meanwhile, up to
        # the caps above: a request's `timeout` counts from when it is read, and one left unread behind a request
        # waiting for room ran long after its timeout had passed (the deadline hunt).

        # The outcomes of requests answered, kept until the answer is sent: one the stream ended before it was
        # sent counts as cancelled (it counted as a success the moment it was ready, and was never answered; the
        # scheduler hunt). Once the stream is over, an outcome (a request cancelled with it) counts at once.
        outcomes: dict[int, tuple[str, str]] = {}
        stream_over = False
        # The places of answers given and not yet sent (counted in _stream_answers_unsent until sent, or until the
        # stream ends otherwise than by the stop's cut).
        given: set[int] = set()

        async def give(place: int, message: pb.ModelStreamInferResponse | bytes) -> None:
            if not stream_over and asyncio.current_task() not in self._cut_off:  # (the cut off: counted already)
                given.add(place)
                self._stream_answers_unsent += 1
            await answers.put((place, message))

        def recorder(place: int) -> Callable[[str, str], None]:
            def record(model: str, outcome: str) -> None:
                if stream_over:
                    self._counted(model, outcome)
                else:
                    outcomes[place] = (model, outcome)
            return record

        async def answer(place: int, received: Received | Unreadable) -> None:
            if isinstance(received, Unreadable):
                message = self._refuse_unreadable("ModelStreamInfer", received, context)
                await give(place, pb.ModelStreamInferResponse(
                    error_message=message, infer_response=mark_final(pb.ModelInferResponse())))
                return
            model, request_id = received.message.model_name, received.message.id
            try:
                wire = await self._infer(received, context, streamed=True, counted=recorder(place),
                                         wait_for_room=True)
            except NereidError as err:
                message = self.dataplane.error_text(err)
            except asyncio.CancelledError:
                if not self._answered_at_grace():
                    raise
                message = past_grace_message(model)  # answered in the stream, which then ends
            except Exception as err:
                # Every request gets exactly one answer, even when the failure is a bug.
                self.fault_log.error("ModelStreamInfer: request '%s' failed", cap_message(request_id, 256),
                                     exc_info=err)
                message = self.dataplane.error_text(err)
            else:
                await give(place, wire)
                return
            # The error answers this request only; the stream stays open.
            # Triton's error answer: the request's id, model and version, and the final-response flag.
            stub = mark_final(pb.ModelInferResponse(model_name=model, model_version=received.message.model_version,
                                                    id=request_id))
            await give(place, pb.ModelStreamInferResponse(error_message=cap_message(message), infer_response=stub))

        async def read() -> None:
            nonlocal unanswered, held_bytes
            read_count = 0
            try:
                async for received in requests:
                    unanswered += 1
                    await in_flight.acquire()
                    size = received.size if isinstance(received, Received) else 0
                    while held_bytes and held_bytes + size > STREAM_BYTES_IN_FLIGHT:
                        bytes_freed.clear()
                        await bytes_freed.wait()
                    held_bytes += size
                    sizes[read_count] = size
                    task = asyncio.create_task(answer(read_count, received))
                    read_count += 1
                    pending.add(task)
                    task.add_done_callback(pending.discard)
                    self._running.add(task)
                    task.add_done_callback(self._running.discard)
            except Exception as err:  # the client's side broke off: still answer what was accepted
                self.client_log.warning("ModelStreamInfer from %s: reading the stream failed (%s); answering the %d "
                                        "accepted request(s)", peer(context.peer()),
                                        cap_message(f"{type(err).__name__}: {err}", 256), len(pending))
            try:
                await until_all_done(pending)
            finally:
                # However reading ends, the response side must end too rather than wait forever.
                answers.put_nowait(None)

        self._streams.add(answers)
        reader = asyncio.create_task(read())
        finished: dict[int, pb.ModelStreamInferResponse | bytes] = {}  # answers waiting for an earlier one
        next_place = 0
        try:
            while not (self._closing_streams and unanswered == 0):
                item = await answers.get()
                if item is None:  # the client's side ended and every request is answered
                    return
                if item is _WAKE:
                    continue
                finished[item[0]] = item[1]
                # A slow request holds the answers after it; the in-flight cap then pauses reading, so they
                # stay bounded in memory.
                while next_place in finished:
                    yield finished.pop(next_place)
                    if next_place in given:
                        given.discard(next_place)
                        self._stream_answers_unsent -= 1
                    if (sent := outcomes.pop(next_place, None)) is not None:
                        self._counted(*sent)
                    held_bytes -= sizes.pop(next_place, 0)
                    bytes_freed.set()
                    next_place += 1
                    unanswered -= 1
                    in_flight.release()
            # Ended here rather than by the client: a request it sends from now on is not read (the status says so).
            # The reader ends first: its read would otherwise fail on the abort, and log the stream as broken.
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            await context.abort(grpc.StatusCode.UNAVAILABLE, STREAM_CLOSED_AT_SHUTDOWN)
        finally:
            stream_over = True
            unsent = "unavailable" if self._past_grace() else "cancelled"
            for model, outcome in outcomes.values():  # ready, never sent: the stream ended first
                # A success the client never got is no success; a failure is the failure it was, as its model's
                # statistics count it (a deadline passing in a hook as the stream's own ended was counted
                # deadline_exceeded there and cancelled here; the fault hunt).
                self._counted(model, unsent if outcome == "success" else outcome)
            outcomes.clear()
            if not self.dataplane.grace_passed:  # (ended by its client, or an error: no answer of it is the stop's)
                self._stream_answers_unsent -= len(given)
                given.clear()
            self._streams.discard(answers)
            reader.cancel()
            for task in list(pending):
                task.cancel()

    @_maps_errors
    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context) -> pb.ModelStatisticsResponse:
        response = pb.ModelStatisticsResponse()
        for name, stats in self.dataplane.statistics(request.name, request.version):
            _fill_statistics(response.model_stats.add(name=name, version=MODEL_VERSION), stats)
        return response

    @_maps_errors
    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context) -> pb.RepositoryIndexResponse:
        _one_repository(request.repository_name)
        response = pb.RepositoryIndexResponse()
        for entry in await self.dataplane.repository_index(request.ready):
            response.models.add(name=entry.name, version=entry.version, state=entry.state, reason=entry.reason)
        return response

    @_maps_errors
    async def RepositoryModelLoad(self, request: pb.RepositoryModelLoadRequest,
                                  context) -> pb.RepositoryModelLoadResponse:
        _one_repository(request.repository_name)
        await self._repository_call(request.model_name, self.dataplane.load(
            request.model_name, request.parameters.keys(), client=peer(context.peer())))
        return pb.RepositoryModelLoadResponse()

    @_maps_errors
    async def RepositoryModelUnload(self, request: pb.RepositoryModelUnloadRequest,
                                    context) -> pb.RepositoryModelUnloadResponse:
        _one_repository(request.repository_name)
        await self._repository_call(request.model_name,
                                    self.dataplane.unload(request.model_name, _unload_dependents(request),
                                                          client=peer(context.peer())))
        return pb.RepositoryModelUnloadResponse()

    async def _repository_call(self, model: str, work: Awaitable[None]) -> None:
        """Await ``work``, a load or unload, as a call :meth:`end_at_grace` answers: one still running when the stop's
        grace has passed (an unload() that hangs) is answered UNAVAILABLE saying its outcome is lost, as over HTTP,
        where gRPC's own stop cut it off a second later with "Cancelling all calls" (the review hunt). The work
        itself runs on (an accepted load or unload runs to its end)."""
        task = asyncio.current_task()
        assert task is not None
        self._repository_calls.add(task)
        try:
            await work
        except asyncio.CancelledError:
            if not self._answered_at_grace():
                raise
            raise Unavailable(PublicText(f"model '{model}': the server is shutting down, and "
                                         "shutdown_grace_s passed while this request ran; it may have taken effect, "
                                         "and its outcome is lost")) from None
        finally:
            self._repository_calls.discard(task)


    def refusal(self, extension: str) -> Handler:
        """The handler of a Triton RPC of an unimplemented ``extension`` (its request bytes unread)."""
        @_maps_errors
        async def refuse(servicer: InferenceServicer, request: bytes, context: grpc.aio.ServicerContext) -> None:
            servicer.dataplane.refuse_extension(extension)
        return functools.partial(refuse, self)


def _one_repository(repository_name: str) -> None:
    """Refuse a repository RPC naming a repository, as Triton does: it would act on this server's only one."""
    if repository_name:
        raise Unimplemented(PublicText(f"'repository_name' specification is not supported (got "
                                       f"{shown_name(repository_name)}): this server serves one repository; "
                                       "leave repository_name empty"))


def _unload_dependents(request: pb.RepositoryModelUnloadRequest) -> bool:
    """The ``unload_dependents`` parameter (tritonclient always sends it); False when absent."""
    if "unload_dependents" not in request.parameters:  # (indexing a map would add the key)
        return False
    value = request.parameters["unload_dependents"]
    if value.WhichOneof("parameter_choice") != "bool_param":
        raise InvalidArgument(PublicText(f"model '{request.model_name}': parameter 'unload_dependents' must be a "
                                         f"bool_param, got {value.WhichOneof('parameter_choice')}"))
    return value.bool_param


# (RPC name, request type, response type, streaming)
_RPCS: tuple[tuple[str, type, type, bool], ...] = (
    ("ServerLive", pb.ServerLiveRequest, pb.ServerLiveResponse, False),
    ("ServerReady", pb.ServerReadyRequest, pb.ServerReadyResponse, False),
    ("ModelReady", pb.ModelReadyRequest, pb.ModelReadyResponse, False),
    ("ServerMetadata", pb.ServerMetadataRequest, pb.ServerMetadataResponse, False),
    ("ModelMetadata", pb.ModelMetadataRequest, pb.ModelMetadataResponse, False),
    ("ModelInfer", pb.ModelInferRequest, pb.ModelInferResponse, False),
    ("ModelStreamInfer", pb.ModelInferRequest, pb.ModelStreamInferResponse, True),
    ("ModelConfig", pb.ModelConfigRequest, pb.ModelConfigResponse, False),
    ("ModelStatistics", pb.ModelStatisticsRequest, pb.ModelStatisticsResponse, False),
    ("RepositoryIndex", pb.RepositoryIndexRequest, pb.RepositoryIndexResponse, False),
    ("RepositoryModelLoad", pb.RepositoryModelLoadRequest, pb.RepositoryModelLoadResponse, False),
    ("RepositoryModelUnload", pb.RepositoryModelUnloadRequest, pb.RepositoryModelUnloadResponse, False),
)


# Triton's RPCs for the extensions nereid does not implement, and their extension.
_REFUSED_RPCS: dict[str, str] = {
    **{f"SystemSharedMemory{verb}": "system_shared_memory" for verb in ("Status", "Register", "Unregister")},
    **{f"CudaSharedMemory{verb}": "cuda_shared_memory" for verb in ("Status", "Register", "Unregister")},
    "TraceSetting": "trace",
    "LogSettings": "logging",
}


def generic_handler(servicer: InferenceServicer) -> grpc.GenericRpcHandler:
    """Register the servicer's methods under the wire service name ``inference.GRPCInferenceService``.

    Triton's RPCs of extensions nereid does not implement answer UNIMPLEMENTED
    naming the extension (rather than grpc's bare "Method not found!").
    """
    handlers = {}
    for name, request_type, response_type, streaming in _RPCS:
        make = grpc.stream_stream_rpc_method_handler if streaming else grpc.unary_unary_rpc_method_handler
        handlers[name] = make(getattr(servicer, name), request_deserializer=request_parser(request_type),
                              response_serializer=_serialize)
    for name, extension in _REFUSED_RPCS.items():
        handlers[name] = grpc.unary_unary_rpc_method_handler(servicer.refusal(extension))
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


def _serialize(response: Any) -> bytes:
    """A response message's wire bytes; inference responses arrive already serialized."""
    return response if isinstance(response, bytes) else response.SerializeToString()


def config_message(config: ModelConfig) -> mc.ModelConfig:
    """The ModelConfig message of a model's neutral configuration."""
    message = mc.ModelConfig(name=config.name, platform=config.platform, backend=config.backend,
                             max_batch_size=config.max_batch_size)
    for collection, tensors in ((message.input, config.inputs), (message.output, config.outputs)):
        for tensor in tensors:
            collection.add(name=tensor.name, data_type=mc.DataType.Value(tensor.config_type), dims=tensor.shape)
    if config.dynamic_batching is not None:
        batching = message.dynamic_batching
        batching.SetInParent()
        batching.max_queue_delay_microseconds = config.dynamic_batching.max_queue_delay_us
        batching.preferred_batch_size.extend(config.dynamic_batching.preferred_batch_sizes)
    group = config.instance_group
    # Named as Triton names a group the configuration leaves unnamed: the model's name and the group's index.
    message.instance_group.add(name=f"{config.name}_0", count=group.count,
                               kind=mc.ModelInstanceGroup.Kind.Value(group.kind), gpus=group.gpus)
    return message


def _fill_statistics(stats_msg: pb.ModelStatistics, stats: ModelStats) -> None:
    stats_msg.last_inference = stats.last_inference_ms
    stats_msg.inference_count = stats.inference_count
    stats_msg.execution_count = stats.execution_count
    infer = stats_msg.inference_stats
    for field in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output"):
        duration = getattr(stats, field)
        target = getattr(infer, field)
        target.count, target.ns = duration.count, duration.ns
    for size in sorted(stats.batches):
        per_size = stats.batches[size]
        batch = stats_msg.batch_stats.add(batch_size=size)
        for field in ("compute_input", "compute_infer", "compute_output"):
            duration = getattr(per_size, field)
            target = getattr(batch, field)
            target.count, target.ns = duration.count, duration.ns
