"""The HTTP listener: uvicorn (httptools) serving the REST application on the server's own event loop.

uvicorn was measured against aiohttp before it was chosen (bench/README.md).
What is here hardens it for clients on an open network: a bound on a request's
head, and on how long its head and body may take, a cap on open connections,
a kept-alive connection's idle time counted as clients' pools expect, answers
(JSON, as the application's) to what the parser cannot read, and uvicorn's own
log lines turned into nereid's. The application (:mod:`nereid.protocol.http_service`)
only converts.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import email.utils
import logging
import re
import resource
import select
import socket
import ssl
import sys
import time
from typing import Any, Callable, Iterator

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from nereid.errors import cap_message
from nereid.listening import bind_listening_sockets, cannot_listen, host_and_port
from nereid.log_limit import RateLimitedLog
from nereid.protocol.http_errors import header_text
from nereid.protocol.http_service import HttpSurface, client_log, error_body, peer

log = logging.getLogger(__name__)
# What any client can make happen at will (a head too large or too slow, a request asking to switch protocols, a
# silent connection) is logged through this, within the application's limit (the lines of both count together).
_client_log = client_log.sharing(log)
# Connections refused past the connection cap: an operator must hear of it, but a flood of connections would
# otherwise write one WARNING each.
_capacity_log = RateLimitedLog(log, burst=5, window_s=60.0)

# A request's head (request line and headers) larger than this is refused with 431, as nginx and Triton
# bound theirs: httptools buffers a header value whole until it ends, so an endless header grew memory
# without limit (max_message_bytes bounds bodies only).
MAX_HEAD_BYTES = 64 << 10
# At most this many HTTP connections are open at once (fewer when the open-file limit is low, see
# connection_cap): a client that opened connections without end took every file descriptor of the process
# (20,400 of them), and then nothing else could open a connection, a model file or a child's pipe.
MAX_CONNECTIONS = 4096
# How long a kept-alive connection may stay idle between requests before it is closed (uvicorn's own default is
# 5 s). A client's pool that reuses a connection just as the server closes it gets a reset on a request it sent
# (not retried: an infer is a POST), so the server should be the last to close: this outlasts common pools' and
# load balancers' idle times (Go's 90 s, .NET's and AWS ALB's 60 s), and stays bounded, since every idle
# connection counts toward MAX_CONNECTIONS.
KEEP_ALIVE_TIMEOUT_S = 120.0
# While a connection is not read (uvicorn stops reading one whose next, pipelined request waits for the answer
# being made), its client's close is looked for this often: unread, it would never cancel the queued request.
PAUSED_PEER_CHECK_S = 0.25
# How long a connection the server stopped reading (a body it will not read, the rest of a head too large) stays
# open after its last answer, its arrivals discarded, until the client closes. Closed with bytes unread, the
# connection is reset, and a reset makes the client's system drop the answer it had not read yet: curl --http2
# sending 100 KB saw "connection reset" instead of the 400 saying what to do. As nginx's lingering close.
LINGER_S = 5.0
LINGER_MOST_S = 60.0  # ... and at most this long while its last answers are still being sent
# What poll() reports for a peer that closed its side (POLLRDHUP: Linux, even with unread data before it).
_PEER_CLOSED = getattr(select, "POLLRDHUP", 0) | select.POLLHUP | select.POLLERR
# nereid_protocol_refused_total's reasons (protocol="http"): what the listener refuses or closes before the
# application sees a request.
REFUSED_UNPARSABLE = "unparsable"  # a 400: the HTTP parser cannot read it (a bad Host header too)
REFUSED_HEAD_TOO_LARGE = "head_too_large"  # a 431
REFUSED_HEAD_TIMEOUT = "head_timeout"  # a 408: its head trickled in too slowly
REFUSED_IDLE = "idle"  # a connection closed silent while it owed (the rest of) a request
REFUSED_CONNECTIONS = "too_many_connections"  # a 503 past the connection cap
REFUSED_OUT_OF_MEMORY = "out_of_memory"  # a 503: the server ran out of memory reading it


def connection_cap(most: int = MAX_CONNECTIONS) -> int:
    """How many HTTP connections may be open at once: ``most``, or half the soft open-file limit when that is
    lower, so the other half is left to gRPC, model files and children's pipes."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return most
    return max(1, min(most, soft // 2))


class HttpListener:
    """uvicorn (httptools) serving an :class:`HttpSurface` on the running event loop.

    The socket is bound here, so that an address in use is reported with the
    settings key, and uvicorn installs no signal handlers: the nereid server
    decides when to stop.
    """

    def __init__(self, app: HttpSurface, tls: ssl.SSLContext | None = None, grace_s: float | None = None,
                 count_refused: Callable[[str], None] | None = None) -> None:
        """``count_refused``: called with a reason (``REFUSED_*``) for each request or connection the listener
        refuses or closes before the application sees it (the server counts them in ``/metrics``)."""
        self.app = app
        self.tls = tls
        self.grace_s = grace_s
        self.count_refused = count_refused
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task | None = None
        self._records = _UvicornRecords()  # on uvicorn's logger while this listener runs

    async def start(self, addr: str, origin: str = "server.http_addr") -> int:
        """Listen on ``host:port`` (``[::1]:8000``); returns the bound port. ``origin``: where the address came
        from, for the error when it cannot be listened on."""
        try:
            sockets = bind_listening_sockets(*host_and_port(addr))
        except OSError as err:
            raise cannot_listen(addr, origin, err) from None
        # No log_config and no log_level: uvicorn would otherwise give its loggers handlers of its own, in its
        # own format, that do not propagate, and a level of their own that ignores --log-level. Its records
        # go to the root logger's handler, at the root logger's level, through _UvicornRecords.
        # access_log=False: no line per request (uvicorn then also cuts its access logger off).
        # date_header=False: every answer's Date is made when the answer is (see _HeadersAtAnswer), not read
        # from uvicorn's, which is the Date of its request's arrival and stops moving once a stop has begun.
        # A protocol class of this listener's own: uvicorn makes its instances, and only a class reaches them.
        protocol = type("_ListenerProtocol", (_BoundedHeadProtocol,),
                        {"count_refused": staticmethod(self.count_refused)})  # (a plain function is no method)
        config = uvicorn.Config(self.app, http=protocol, lifespan="off", log_config=None,
                                log_level=None, access_log=False, server_header=False, date_header=False,
                                ws="none", proxy_headers=False, timeout_graceful_shutdown=self.grace_s,
                                timeout_keep_alive=KEEP_ALIVE_TIMEOUT_S)
        config.load()
        if self.tls is not None:
            config.ssl = self.tls
        logging.getLogger(UVICORN_LOGGER).addFilter(self._records)
        self._server = server = _EmbeddedServer(config)
        self._task = asyncio.create_task(server.serve(sockets=sockets))
        started = asyncio.create_task(server.started_event.wait())
        await asyncio.wait({self._task, started}, return_when=asyncio.FIRST_COMPLETED)
        if not server.started_event.is_set():
            started.cancel()
            task, self._server, self._task = self._task, None, None
            logging.getLogger(UVICORN_LOGGER).removeFilter(self._records)
            for sock in sockets:
                sock.close()
            await task  # raises what stopped it
            raise OSError(f"the HTTP listener on {addr} ({origin}) did not start")
        return sockets[0].getsockname()[1]

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop accepting, let requests in progress finish (bounded by ``grace_s``, by default the listener's
        grace), close."""
        if self._server is not None and self._task is not None:
            if grace_s is not None:  # (uvicorn reads it as its shutdown begins)
                self._server.config.timeout_graceful_shutdown = grace_s
            self._server.should_exit = True
            try:
                await self._task
            finally:
                self._server = self._task = None
                logging.getLogger(UVICORN_LOGGER).removeFilter(self._records)


# uvicorn writes every line of its own (not only errors) through this logger.
UVICORN_LOGGER = "uvicorn.error"
# uvicorn's WARNING for each request httptools cannot parse: a client can send those as fast as it likes.
INVALID_REQUEST_LINE = "Invalid HTTP request received."
# uvicorn's ERROR when a stop's grace runs out with requests still running.
GRACE_EXCEEDED_LINE = "Cancel %s running task(s), timeout graceful shutdown exceeded"


class _UvicornRecords(logging.Filter):
    """uvicorn's log records, as nereid's own: its INFO lines become DEBUG lines, and its line for each
    request that cannot be parsed is dropped (nereid logs its own, within the client log's limit).

    Its INFO lines ("Started server process [...]", "Shutting down", "Waiting for
    connections to close") tell of the listener's life, which nereid's own lines
    already say; they are written only when DEBUG is on.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == INVALID_REQUEST_LINE:
            return False  # _BoundedHeadProtocol.send_400_response logs the refusal, naming its client and reason
        if record.msg == GRACE_EXCEEDED_LINE:
            # The documented end of a stop whose grace ran out, not an ERROR to page whoever alerts on the log; but
            # the count of HTTP requests it cuts is said, as gRPC's is (demoted to DEBUG, HTTP requests answered
            # 503 at the grace were told of nowhere; the log hunt).
            log.warning("%s HTTP request(s) still in flight after the grace (shutdown_grace_s): answering them 503",
                        *record.args)
            return False
        if logging.DEBUG < record.levelno < logging.WARNING:
            if not logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
                return False
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


def _refusal(status_line: bytes, message: str) -> bytes:
    """A whole answer written below the app, for a connection closed after it: JSON, as the app's errors are."""
    body = error_body(message)[0]
    return (b"HTTP/1.1 %s\r\ndate: %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (status_line, http_date(), len(body), body))


_date_now: list = [-1, b""]  # (the second, its Date value): made once a second


def http_date() -> bytes:
    """RFC 9110's ``Date`` for now (IMF-fixdate, to the second), for every answer, the app's and the listener's."""
    now = int(time.time())
    if now != _date_now[0]:
        _date_now[:] = [now, email.utils.formatdate(now, usegmt=True).encode()]
    return _date_now[1]


# RFC 3986's uri-host [":" port]: letters, digits, unreserved and sub-delims, "%" escapes, an IP literal's brackets.
_HOST_VALUE = re.compile(rb"[A-Za-z0-9\-._~%!$&'()*+,;=:\[\]]*")


def _host_problem(hosts: list[bytes]) -> str | None:
    """Why an HTTP/1.1 request's Host headers are refused (RFC 9112 3.2: exactly one, a valid value); None if fine.

    A proxy and this server disagreeing on which Host counts is how requests get routed past a proxy's rules.
    """
    if len(hosts) != 1:
        return (f"an HTTP/1.1 request has exactly one Host header (RFC 9112 3.2); this one has "
                f"{len(hosts) or 'none'}")
    if not _HOST_VALUE.fullmatch(hosts[0]):
        return f"its Host header is no host[:port] ({header_text(hosts[0])!r})"
    return None


def _served_target(url: bytes) -> bytes:
    """``url``, a request's target, as it is served: in absolute form, refused (ValueError, a 400) with a scheme
    other than http or https (``ftp://x/v2/...`` was served as its path, 200), and given the path ``/`` where it
    has none (what a forward proxy sends for ``http://host`` or ``http://host?x=1``, RFC 9112 3.2.2: uvicorn read
    no path there and failed with AttributeError ('NoneType' object has no attribute 'decode'), which the 400
    quoted)."""
    if url[:1] == b"/" or url == b"*":
        return url
    try:
        parsed = httptools.parse_url(url)
    except httptools.HttpParserInvalidURLError:
        return url  # (refused by uvicorn's own read, as before)
    if parsed.schema is not None and parsed.schema.lower() not in (b"http", b"https"):
        raise ValueError(f"its target's scheme is {header_text(parsed.schema)!r}; an absolute-form target is "
                         "http:// or https://")
    if parsed.path is not None:
        return url
    return b"/" + (b"?" + parsed.query if parsed.query else b"")


def _parser_reason(error: BaseException | None) -> str:
    """What the HTTP parser found wrong with a request, from the error it raised (capped: it may quote the request).

    An error raised in one of uvicorn's parser callbacks (such as its ASCII decode
    of the path) reaches data_received as the parser's "User callback error",
    with the callback's own error as its context.
    """
    if isinstance(error, httptools.HttpParserCallbackError) and error.__context__ is not None:
        error = error.__context__
    if error is None:
        return "unknown reason"
    return cap_message(str(error) or type(error).__name__, 200)


class _EmbeddedServer(uvicorn.Server):
    """uvicorn's server without its signal handling, telling when it has started.

    Over TLS, its shutdown does not wait for clients' close_notify: closing a TLS connection sends the
    server's close_notify, then asyncio waits for the client's (up to 30 s, ``ssl_shutdown_timeout``,
    which uvicorn does not set), and uvicorn waits for every connection to be gone. An idle keep-alive
    client that never answers (a pooled connection of requests or tritonclient) held the stop for the
    whole grace and ended it with uvicorn's ERROR "timeout graceful shutdown exceeded"; over plaintext
    the same stop returns at once. So during shutdown, a TLS connection whose close was asked for (idle,
    or its last answer handed over) and whose TLS layer holds nothing more to send for
    :data:`CLOSE_NOTIFY_WAIT_S` has its TCP connection closed as plaintext's is: what it still buffers
    is sent first. Requests in flight still finish, within the grace.
    """

    CLOSE_NOTIFY_WAIT_S = 0.1

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.started_event = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # SIGTERM and SIGINT belong to the nereid server, which stops this listener itself

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        self.started_event.set()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        closer = asyncio.create_task(self._close_without_close_notify()) if self.config.ssl else None
        try:
            await super().shutdown(sockets=sockets)
        finally:
            if closer is not None:
                closer.cancel()

    async def _close_without_close_notify(self) -> None:
        waiting: set[int] = set()  # connections seen closed, and flushed, at the last look
        while True:
            await asyncio.sleep(self.CLOSE_NOTIFY_WAIT_S)
            seen = set()
            for connection in list(self.server_state.connections):
                transport = getattr(connection, "transport", None)
                if transport is None or not transport.is_closing() or transport.get_write_buffer_size():
                    continue
                seen.add(id(connection))
                # asyncio's TLS transport over its TCP transport (none under another event loop: there,
                # the wait for close_notify stays, bounded by the grace).
                tcp = getattr(getattr(transport, "_ssl_protocol", None), "_transport", None)
                if id(connection) in waiting and tcp is not None and not tcp.is_closing():
                    tcp.close()  # sends what it buffers, then closes
            waiting = seen


class _HeadersAtAnswer(list):
    """A request's default headers, made when its answer starts: its ``Date``.

    uvicorn gives each request the default headers of the moment its head
    arrived (refreshed every second, and no more once a stop has begun), and
    adds them to the answer's own then (``default_headers + headers``): an
    answer that took 5 s was dated 5 s early, where RFC 9110 dates a message
    when it is made. This list is empty; adding to it dates the answer now.
    """

    def __add__(self, headers: list) -> list:  # type: ignore[override]
        return [(b"date", http_date()), *headers]


# Writes smaller than this made in one turn of the event loop go out together (see _CoalescedWrites).
COALESCE_BELOW_BYTES = 64 << 10


class _CoalescedWrites:
    """A connection's transport whose small writes made in one turn of the event loop go out as one, at the end
    of that turn: an answer's head and body (uvicorn writes each as the ASGI app sends it) in one send() and one
    TCP segment (one TLS record), not two that the client reads apart. A write of COALESCE_BELOW_BYTES or more
    goes out at once, after what is held. Closing, ending the sending side or asking what is left to send counts
    what is held first. Everything else is the transport's own."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: list[bytes | memoryview] = []
        self._held_bytes = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:  # (asked several times an answer: spared __getattr__'s miss)
        return self._transport.is_closing()

    def write(self, data: bytes | memoryview) -> None:
        if self._held:
            if self._held_bytes + len(data) < COALESCE_BELOW_BYTES:
                self._held.append(data)
                self._held_bytes += len(data)
                return
            self._flush()
        if len(data) >= COALESCE_BELOW_BYTES or not data:
            self._transport.write(data)
            return
        self._held.append(data)
        self._held_bytes = len(data)
        self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        if not self._held:
            return
        held = self._held
        self._held, self._held_bytes = [], 0
        self._transport.write(held[0] if len(held) == 1 else b"".join(held))

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        self._held, self._held_bytes = [], 0
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        return self._held_bytes + self._transport.get_write_buffer_size()


class _LingeringClose:
    """A connection's transport whose ``close()`` ends the server's side only (after the answers written), goes on
    reading (the protocol discards what arrives) until the client closes, and closes for good after
    :data:`LINGER_S` at most. Everything else is the transport's own. Over TLS (no half-close), ``close()`` closes."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._lingering = False
        self._timer: asyncio.TimerHandle | None = None
        self._until = 0.0  # when the linger ends, whatever is still to be sent (its bound)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self._lingering or self._transport.is_closing()

    def close(self) -> None:
        transport = self._transport
        if self._lingering or transport.is_closing() or not transport.can_write_eof():
            transport.close()
            return
        self._lingering = True
        # At the loop's next turn, as a transport's own close takes effect: what the caller does next (counting,
        # logging the refusal) is done before the client can see the end.
        self._loop.call_soon(self._half_close)

    def _half_close(self) -> None:
        transport = self._transport
        if transport.is_closing():
            return
        try:
            transport.write_eof()  # (sent once what is buffered is out)
        except OSError:  # the client reset the connection since close(): nothing is left to end (asyncio logged
            transport.abort()  # an ERROR traceback per reset, without limit, for a client to cause at will)
            return
        transport.resume_reading()  # (reading may be paused: a pipelined request waited; nothing is queued now)
        self._until = self._loop.time() + LINGER_MOST_S
        self._timer = self._loop.call_later(LINGER_S, self._end)

    def _end(self) -> None:
        """Close, unless the answers are still being sent (a large one to a slow reader): timed from their end, as
        nginx times its lingering close, within LINGER_MOST_S in all."""
        transport = self._transport
        if transport.get_write_buffer_size() and self._loop.time() < self._until:
            self._timer = self._loop.call_later(LINGER_S, self._end)
            return
        transport.close()

    def cancel(self) -> None:
        """The connection is lost: the timer has nothing left to close (and would hold the transport)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class _BoundedHeadProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, bounding connections, request heads, and cancelling requests whose client left.

    A request whose head passes :data:`MAX_HEAD_BYTES` is answered 431. A
    request whose head has not all arrived :attr:`request_head_timeout_s` after
    its first byte (after the connection's start, for its first request) is
    answered 408 and its connection closed, however slowly the head trickles in.
    A connection that sends nothing for :attr:`request_idle_timeout_s` while a
    request of it is incomplete (or before its first) is closed, so silent or
    slow connections cannot pile up; between requests, once every one is
    answered, an idle connection is kept alive for uvicorn's
    ``timeout_keep_alive`` (:data:`KEEP_ALIVE_TIMEOUT_S`) from its last answer
    instead. Bytes that start no request (the empty lines the parser skips
    before a request) are not heard from: they keep no connection open. A
    connection past :attr:`max_connections` open at once is answered 503 at
    once and closed. A request whose connection
    is lost before its answer has its handler cancelled (see
    :func:`_unless_disconnected`): a client that only shuts down its sending side
    looks the same (TCP tells the two apart only when an answer is written), so
    it is taken as gone too. A request asking to switch protocols
    (``Upgrade: h2c``) is answered, then its connection closed unread.

    Head bytes are counted as they arrive, not in the parser's callbacks: httptools
    reports a header only once its value has ended, and buffers it until then.
    A read that holds the end of one message and the start of the next counts
    toward neither head (the parser does not say where the next one began), so
    a head can pass the bound by at most one read.
    """

    # As nginx's client_header_timeout: the longest a request's line and headers may take to arrive in all. A
    # timeout between reads alone let a client that sends a byte every 30 s hold a connection for ever.
    request_head_timeout_s = 60.0
    # As nginx's client_body_timeout: the longest a client may stay silent in the middle of a request (its body
    # is bounded by this only: a large upload may take long) or before its first one.
    request_idle_timeout_s = 60.0
    # The most connections open at once; None: connection_cap(), read as each connection opens. uvicorn's own
    # limit_concurrency is no such cap: it refuses a request only once its head is complete (a connection that
    # never completes one is never refused), and refuses every request while that many connections are open.
    max_connections: int | None = None
    # Called with each refusal's reason (see HttpListener); set on the class each listener makes.
    count_refused: Callable[[str], None] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_left: int | None = MAX_HEAD_BYTES  # what the current head may still take; None in a body
        # When the client last sent part of a request (or the connection started). Bytes outside a request that
        # start none are not counted: llhttp skips CRLFs before a request's head without a callback, and a
        # client sending "\r\n" every minute held its connection for ever.
        self._last_heard = 0.0
        self._answered_at = 0.0  # when this connection's last answer was all written
        # When the current head's time started (its first byte, or the connection's start for the first
        # request); None once it is complete, until the next one's first byte.
        self._head_since: float | None = None
        self._head_begun = False  # whether any byte of the current head has arrived
        self._idle_check: asyncio.TimerHandle | None = None
        self._unread = False  # nothing more is read: refused over capacity, or asked to switch protocols
        # The requests of this connection not answered yet, in the order they came: the one being answered and any
        # pipelined behind it (uvicorn's ``cycle`` is only the newest, so a lost connection would reach only that
        # one). A deque: thousands of pipelined heads can arrive in one read, and each head touches only its ends.
        self._unanswered: collections.deque[Any] = collections.deque()
        self._close_after_head = False  # a stop came while a head was arriving: answer that request, then close

    def shutdown(self) -> None:
        """A graceful stop: as uvicorn's (an idle connection is closed, one answering closes once answered), but a
        connection a request's head is arriving on is let finish it and is answered, then closed. Closed at once,
        its client could not know whether its request ran (a POST may not be sent again): now it is told, 503
        "the server is shutting down; the request was not run", as a pipelined request is (from the HTTP hunt).
        The head timeout and the stop's grace bound the wait."""
        if self._head_begun and (self.cycle is None or self.cycle.response_complete):
            self._close_after_head = True
            return
        super().shutdown()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_CoalescedWrites(transport, asyncio.get_running_loop()))  # type: ignore[arg-type]
        self._last_heard = self._head_since = self.loop.time()
        most = self.max_connections if self.max_connections is not None else connection_cap()
        if len(self.connections) > most:  # (this connection is counted already)
            self._refuse_connection(most)
            return
        self._idle_check = self.loop.call_later(min(self.request_idle_timeout_s, self.request_head_timeout_s),
                                                self._check_idle)

    def _refused(self, reason: str) -> None:
        """Count one refusal (see :attr:`count_refused`)."""
        if self.count_refused is not None:
            self.count_refused(reason)

    def _refuse_connection(self, most: int) -> None:
        """Answer 503 and close, unread: more connections are open than :attr:`max_connections`."""
        self._unread = True
        self._refused(REFUSED_CONNECTIONS)
        # Counted no more from now: in a flood, the refused ones waiting for their close would crowd out others.
        self.connections.discard(self)
        _capacity_log.warning("HTTP connection from %s refused with 503: %d connections are open, the most served "
                              "at once (%d, or half the open-file limit when that is lower)", peer(self.client), most,
                              MAX_CONNECTIONS)
        self.transport.write(_refusal(b"503 Service Unavailable", f"the server has {most} HTTP connections open, "
                                                                   "the most it serves at once; try again later"))
        self.transport.close()

    def _check_idle(self) -> None:
        """Close the connection if its client has been silent too long while it owes the rest of a request, or
        has taken too long over a request's head."""
        self._idle_check = None
        if self.transport.is_closing():
            return
        idle_s, head_s = self.request_idle_timeout_s, self.request_head_timeout_s
        now = self.loop.time()
        cycle = self.cycle
        if self.flow.read_paused or self._unread:
            # The server does not read (a pipelined request behind the answer being made, a body past uvicorn's
            # high-water mark; nothing more at all, the answers due written before the close): the client's
            # silence is the server's, and its close is looked for instead.
            if self._peer_closed():
                # Nothing to flush to a client that left; and over TLS a close() would wait for a flush that
                # never starts (its EOF was read below the paused reading), leaving the connection open for good.
                self.transport.abort()  # connection_lost follows: its unanswered requests are cancelled there
                return
            self._last_heard = now
            wait = min(idle_s, head_s, PAUSED_PEER_CHECK_S)
        elif cycle is not None and not cycle.more_body and not cycle.response_complete:
            wait = min(idle_s, head_s)  # answering: the client waits for the server, not the other way round
        else:
            head_age = None if self._head_since is None else now - self._head_since
            if head_age is not None and head_age >= head_s and self._head_begun:
                self._refuse_slow_head()
                return
            # Kept alive between requests (every one answered, no next head begun, not in a body): uvicorn's
            # keep-alive timer closes it, a client's pool reuses it; this backs that timer up (any byte read,
            # a skipped CRLF too, cancels it), timing from the last answer as it does: an answer that took
            # longer than the keep-alive timeout must not have its connection closed as soon as it is out.
            between = (cycle is not None and cycle.response_complete and not self.pipeline and not self._head_begun
                       and self._head_left is not None)
            silent = now - (max(self._last_heard, self._answered_at) if between else self._last_heard)
            limit_s = max(idle_s, self.timeout_keep_alive) if between else idle_s
            if silent >= limit_s or (head_age is not None and head_age >= head_s):
                if not between:
                    self._refused(REFUSED_IDLE)
                    _client_log.log(logging.INFO, "HTTP connection from %s closed: it sent no complete request "
                                                  "for %.0f s", peer(self.client), silent)
                    if cycle is not None and cycle.more_body:
                        # (Its handler reads the close as the end of the body: the server closed it, not the
                        # client, and the line above said so.)
                        cycle.nereid_closed_idle = True
                self.transport.close()
                return
            # Heard from lately: look again when it could next have been silent, or at its head, too long (at
            # least every idle_s: a head begun meanwhile is timed by the shorter limits).
            wait = min(limit_s - silent, idle_s) if head_age is None else min(limit_s - silent, head_s - head_age)
        self._idle_check = self.loop.call_later(max(wait, 0.01), self._check_idle)

    def _check_idle_in(self, delay_s: float) -> None:
        """Run :meth:`_check_idle` within ``delay_s`` (sooner than it is due, if it is due later)."""
        if self._idle_check is not None:
            if self._idle_check.when() <= self.loop.time() + delay_s:
                return
            self._idle_check.cancel()
        self._idle_check = self.loop.call_later(delay_s, self._check_idle)

    def _peer_closed(self) -> bool:
        """Whether the client has closed its side of the connection, looked at without reading it."""
        sock = self.transport.get_extra_info("socket")
        if sock is None:
            return False
        poller = select.poll()
        poller.register(sock.fileno(), _PEER_CLOSED)
        return any(events & _PEER_CLOSED for _, events in poller.poll(0))

    def _refuse_slow_head(self) -> None:
        """Answer 408 and close (only close when an earlier pipelined answer is still being written)."""
        limit_s = self.request_head_timeout_s
        self._refused(REFUSED_HEAD_TIMEOUT)
        _client_log.log(logging.INFO, "HTTP request from %s refused with 408: its request line and headers did not "
                                      "all arrive within %g s", peer(self.client), limit_s)
        self._answer_and_close(b"408 Request Timeout",
                               f"the request line and headers did not all arrive within {limit_s:g} s")

    def _answer_and_close(self, status: bytes, message: str) -> None:
        """Answer ``status`` with the JSON error ``message`` and close; when an earlier pipelined request's answer
        is still due (this one would be read as that one's), close once the earlier answers are out instead."""
        if self._close_after_earlier_answers():
            return
        self._read_no_more()
        self.transport.write(_refusal(status, message))
        self.transport.close()

    def _read_no_more(self) -> None:
        """Nothing more of this connection is read; its close lets the client finish sending first (see
        :class:`_LingeringClose`), whether the server or uvicorn, after an answer, closes it."""
        self._unread = True
        if not isinstance(self.transport, _LingeringClose):
            self.transport = _LingeringClose(self.transport, self.loop)
        for cycle in (*self._unanswered, self.cycle):
            if cycle is not None:
                cycle.transport = self.transport

    def _close_after_earlier_answers(self, dropped: Any = None) -> bool:
        """When requests read before this point are still to be answered: read no more, and close the connection
        once the last of them is answered (True). ``dropped``: a request queued behind them whose body cannot be
        read, which never runs. False, changing nothing, when no answer is due.

        Closing at once cancelled them: a valid request followed in the same write by one the parser cannot read
        (a POST whose Content-Length counted characters, not bytes) was never answered.
        """
        if dropped is not None:
            for queued in [item for item in self.pipeline if item[0] is dropped]:
                self.pipeline.remove(queued)
        due = collections.deque(cycle for cycle in self._unanswered
                                if cycle is not dropped and not cycle.response_complete)
        if not due:
            return False
        self._unanswered = due
        self._read_no_more()
        due[-1].keep_alive = False  # uvicorn closes the connection once this answer is out (marked Connection: close)
        return True

    def _unsupported_upgrade_warning(self) -> None:
        # llhttp stops at the head of a request asking to switch protocols, and takes what follows for the new
        # protocol: read on, its body (or the next request) would be taken for a request of its own, which a
        # proxy forwarding Upgrade turns into answers for the wrong clients. The request is answered (the app
        # refuses one with a body, unread), then the connection is closed without reading any more.
        self._read_no_more()
        if self.cycle is not None:
            self.cycle.keep_alive = False
        _client_log.log(logging.INFO, "HTTP request from %s asks to switch protocols, which this server does not "
                                      "do: it is answered and its connection closed", peer(self.client))

    def data_received(self, data: bytes) -> None:
        if self._unread:
            return
        if self._head_begun or self._head_left is None:  # within a request's head or body: heard from
            self._last_heard = self.loop.time()
        # Otherwise only a request's first byte is, in on_message_begin: what comes before it may be CRLFs alone.
        while self._head_left is not None and len(data) > self._head_left:
            # Headers and body often come in one read: feed the head's allowance first (the parser
            # takes a stream cut anywhere), and refuse only when the head did not end within it.
            allowed = self._head_left
            self._head_left = 0  # the callbacks below replace it when the head ends
            super().data_received(data[:allowed])
            if self.transport.is_closing():
                return
            if self._head_left == 0:
                self._refuse_head()
                return
            data = data[allowed:]
        if self._head_left is not None:
            self._head_left -= len(data)
        super().data_received(data)

    def on_message_begin(self) -> None:
        # The parser calls this at a head's first byte: a later request's head is timed from there (the
        # keep-alive timeout bounds the wait before it), the first request's from the connection's start.
        super().on_message_begin()
        self._head_begun = True
        self._last_heard = self.loop.time()
        if self._head_since is None:
            self._head_since = self.loop.time()

    def on_headers_complete(self) -> None:
        if self.parser.get_http_version() == "1.0":
            # RFC 9110 10.1.1: a 100 is never sent to an HTTP/1.0 client, which could take it for the answer.
            self.expect_100_continue = False
        else:
            # (without the optional whitespace around a field's value, RFC 9110 5.5: the parser keeps a trailing one)
            problem = _host_problem([value.strip(b" \t") for name, value in self.headers if name == b"host"])
            if problem is not None:  # (raised before this head counts as ended: answered 400, and closed)
                raise ValueError(problem)
        self.url = _served_target(self.url)  # (a ValueError raised here is answered 400, as the Host's above)
        super().on_headers_complete()  # (uvicorn refuses a URL it cannot read here: still in the head)
        self._head_left = self._head_since = None
        self._head_begun = False
        if self.cycle is not None:
            self.cycle.default_headers = _HeadersAtAnswer()
            if self._close_after_head:
                self.cycle.keep_alive = False
        if self.flow.read_paused:  # a pipelined request, behind one still being answered: reading stops here
            self._check_idle_in(PAUSED_PEER_CHECK_S)
        if self.cycle is not None and (not self._unanswered or self._unanswered[-1] is not self.cycle):
            # Answers go out in the order the requests came, so the answered ones are at the front. (Each head
            # scanned and rebuilt the whole list: thousands pipelined in one read took seconds of the loop, the
            # time growing with their number squared, and held every client of both protocols; a bug hunt.)
            while self._unanswered and self._unanswered[0].response_complete:
                self._unanswered.popleft()
            self._unanswered.append(self.cycle)

    def on_message_complete(self) -> None:
        self._head_left = MAX_HEAD_BYTES
        super().on_message_complete()
        if self.flow.read_paused:
            # A body past uvicorn's high-water mark paused the reading, and its handler's last receive() resumes
            # it only before it waits: the body complete, it stays paused while the request runs, and a client
            # that leaves goes unseen (its queued request ran, a success; the HTTP read hunt). Its close is looked
            # for instead, as for a pipelined request's.
            self._check_idle_in(PAUSED_PEER_CHECK_S)

    def on_response_complete(self) -> None:
        # The keep-alive time between requests runs from here (see _check_idle), as uvicorn's own timer does.
        self._answered_at = self.loop.time()
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._idle_check is not None:
            self._idle_check.cancel()
            self._idle_check = None
        if isinstance(self.transport, _LingeringClose):
            self.transport.cancel()
        super().connection_lost(exc)
        # uvicorn cancels its keep-alive timer only for a connection closed cleanly: one lost (reset, a broken
        # pipe) stayed referenced by the timer, with its transport and, over TLS, every unsent byte of its
        # answer, for the whole KEEP_ALIVE_TIMEOUT_S.
        self._unset_keepalive_if_required()
        # A request still waiting for its answer has no one to answer: cancel its handler, as gRPC
        # does, so a queued request never runs (see _unless_disconnected). That is the one being answered
        # too when pipelined requests followed it (uvicorn marks only the newest; those never start).
        for cycle in self._unanswered:
            if cycle.response_complete:
                continue
            cycle.disconnected = True
            cycle.message_event.set()
            handler = getattr(cycle, "nereid_handler", None)
            if handler is not None and not handler.done():
                handler.cancel()
        self._unanswered.clear()

    def _refuse_head(self) -> None:
        """Answer 431 and close; only close when an earlier pipelined answer is still being written."""
        self._refused(REFUSED_HEAD_TOO_LARGE)
        _client_log.log(logging.INFO, "HTTP request from %s refused with 431: its request line and headers pass %d "
                                      "bytes", peer(self.client), MAX_HEAD_BYTES)
        self._answer_and_close(b"431 Request Header Fields Too Large",
                               f"the request line and headers exceed {MAX_HEAD_BYTES} bytes")

    def send_400_response(self, msg: str) -> None:
        """Answer a request the HTTP parser cannot read with a JSON 400 naming the parser's reason, and close.

        uvicorn calls this from data_received's ``except HttpParserError`` (after
        its WARNING, which :class:`_UvicornRecords` drops: this logs the refusal with
        its client and reason instead), with only its fixed text: the parser's error
        is the one being handled. When an earlier request is still to be
        answered, the 400 would be read as its answer: the earlier ones are
        answered, then the connection is closed. The parser stopped
        in the body of a request answered already (a 404 sent before its body
        was read): that answer was its one, and the connection is only closed,
        once that answer is out. A request whose own body it stopped in, and
        that it answers 400, is marked so, for its handler (still waiting for
        that body) to take it as what it is, not as a client gone: an infer
        handler counts it against its model. Every refusal is counted and
        logged here, whatever its handler does (one that never reads its body
        never hears of it).
        """
        error = sys.exc_info()[1]
        reason = _parser_reason(error)
        # The server, not the request, failed: a MemoryError in uvicorn's body callback (appending a read to the
        # body) reaches here as a parser error too.
        no_memory = isinstance(error, MemoryError) or isinstance(getattr(error, "__context__", None), MemoryError)
        cycle = self.cycle
        # Between a head's end and its message's end (_head_left is None only then): in cycle's body.
        in_body = cycle is not None and self._head_left is None
        if in_body and cycle.response_started:
            self._read_no_more()  # the parser cannot go on
            cycle.keep_alive = False  # uvicorn closes the connection after the answer it is still sending
            if cycle.response_complete:
                self.transport.close()
            return
        self._refused(REFUSED_OUT_OF_MEMORY if no_memory else REFUSED_UNPARSABLE)  # (counted before it is answered)
        if self._close_after_earlier_answers(dropped=cycle if in_body else None):
            # The 400 would be read as an earlier request's answer: those are answered, then the connection closes.
            answer = "left unanswered (the connection closes once the requests before it are answered)"
        else:
            # The parser stopped in a head after every earlier answer, or in this request's own (chunked) body
            # before its answer began.
            self._read_no_more()
            answer = self._refuse_unparsable(cycle, in_body, reason, no_memory)
            self.transport.close()
        what = "body" if in_body else "request"
        request = f"{cycle.scope['method']} {cap_message(cycle.scope['path'], 256)}" if in_body else "request"
        _client_log.log(logging.INFO, "HTTP %s from %s %s: %s", request, peer(self.client), answer,
                        f"the server ran out of memory reading its {what}" if no_memory
                        else f"its {what} cannot be parsed as HTTP/1.1 ({reason})")

    def _refuse_unparsable(self, cycle: Any, in_body: bool, reason: str, no_memory: bool) -> str:
        """Write the 400 (503 when out of memory) for what the parser cannot read; how it was answered, for the
        log. A request whose own body it is, is marked so for its handler."""
        answer = "closed unanswered"
        if cycle is None or cycle.response_complete or (cycle.more_body and not cycle.response_started):
            if no_memory:
                self.transport.write(_refusal(b"503 Service Unavailable", "the server ran out of memory reading the "
                                              "request; try again later, and send large tensors as binary data"))
                if in_body:
                    cycle.nereid_unparsable = ("the server ran out of memory reading the request body; answered 503 "
                                               "and its connection closed")
                    cycle.nereid_unparsable_status = 503
                answer = "refused with 503"
            else:
                self.transport.write(_refusal(b"400 Bad Request",
                                              f"the request cannot be parsed as HTTP/1.1: {reason}"))
                if in_body:
                    cycle.nereid_unparsable = (f"the request body cannot be parsed as HTTP/1.1 ({reason}); answered "
                                               "400 and its connection closed")
                answer = "refused with 400"
        if in_body and not cycle.response_complete:
            # This was its answer: its handler, waiting for the body, hears now that none comes (as at a lost
            # connection, which this one, closing after the client has finished sending, is not yet), and what
            # it writes from now on is dropped.
            cycle.disconnected = True
            cycle.message_event.set()
        return answer
