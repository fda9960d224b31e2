"""The ``/metrics`` HTTP endpoint: prometheus_client's WSGI app, on threads, bounded against idle clients.

prometheus_client's own server gives each connection a thread for as long as
it stays open: idle connections held threads for good (1,200 connections,
1,227 threads) and a slow trickle of header lines kept every one. Here each
connection gets one deadline for its whole request, at most
:data:`MAX_CONNECTIONS` are served at once (more are closed unserved), and
every address of the name served is listened on (see :mod:`nereid.listening`).
"""

from __future__ import annotations

import io
import logging
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from nereid.daemon_pool import start_daemon_thread
from nereid.listening import bind_listening_sockets, cannot_listen, host_and_port
from nereid.log_limit import RateLimitedLog

log = logging.getLogger(__name__)
# Connections answered 503 for want of a thread: one line each, within a limit (a scraper retries every few seconds).
_no_thread_log = RateLimitedLog(log)

# A scrape connection that has not sent its whole request this long after connecting is closed;
# at most this many are served at once.
IDLE_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 64
# How long a connection answered without a thread of its own (see _answer_without_a_thread) may take to send its
# request, which is read before the connection closes.
NO_THREAD_READ_S = 0.2


# The one path served; any other is a 404, as Triton's metrics port answers.
METRICS_PATH = "/metrics"


def _request_path(environ: dict[str, Any]) -> str:
    """The request's path; from a target in absolute form too (``GET http://host:port/metrics``, which a server
    must accept, RFC 9112 3.2.2, and a scrape through a forward proxy sends), which wsgiref leaves whole."""
    path = environ.get("PATH_INFO", "")
    if path.startswith(("http://", "https://")):
        path = urllib.parse.urlsplit(path).path or "/"
    return path


class MetricsEndpoint:
    """Serves one registry at ``/metrics`` (only there), on one or more addresses."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._servers: list[_BoundedThreadingServer] = []  # one per address it listens on

    def serve(self, addr: str, idle_timeout_s: float = IDLE_TIMEOUT_S, origin: str = "server.metrics_addr") -> int:
        """Start serving on ``host:port``; returns the bound port.

        A connection that sends no complete request within ``idle_timeout_s`` is closed. ``origin``: where the
        address came from, for the error when it cannot be served on.
        """
        try:
            # Every address of a name (localhost: both loopbacks), as the other listeners: a WSGI server each.
            sockets = bind_listening_sockets(*host_and_port(addr))
        except OSError as err:
            raise cannot_listen(addr, origin, err) from err
        app = _named(_SharedRenderings(make_wsgi_app(self._registry)))
        handler = type("Handler", (_QuietHandler,), {"timeout": idle_timeout_s})
        servers: list[_BoundedThreadingServer] = []
        slots = threading.BoundedSemaphore(MAX_CONNECTIONS)  # one bound for the endpoint, whatever its addresses
        for index, sock in enumerate(sockets):
            try:
                servers.append(_BoundedThreadingServer.on_socket(sock, app, handler, slots))
            except OSError as err:
                for unused in sockets[index:]:
                    unused.close()
                for server in servers:
                    server.server_close()  # (not shutdown(): it waits for a serve_forever that never ran)
                raise cannot_listen(addr, origin, err) from err
        for server in servers:
            # A short poll interval keeps shutdown quick (the default waits up to 0.5 s).
            start_daemon_thread(server.serve_forever, "nereid-metrics", poll_interval=0.05)
        self._servers.extend(servers)
        return servers[0].server_port

    def close(self) -> None:
        """Stop serving (at once: a scrape under way is cut off)."""
        servers, self._servers = self._servers, []
        for server in servers:
            server.shutdown()
            server.server_close()


@dataclass
class _Rendering:
    """One run of the metrics app, shared by the scrapes that asked for the same answer meanwhile."""

    done: threading.Event = field(default_factory=threading.Event)
    answer: tuple[str, list[tuple[str, str]], bytes] | None = None  # status, headers, body; None: it failed


# The methods the port answers (OPTIONS too, saying so), as its 405s and OPTIONS list them.
ALLOWED_METHODS = "GET, HEAD, OPTIONS"
SERVER_NAME = "nereid"  # its answers' Server header


class _SharedRenderings:
    """A WSGI app that runs ``app`` once for scrapes asking for the same answer at the same time.

    Each scrape reads every model's figures and renders them (at 500 models, 4 MB of text and about 1.4 s of
    CPU): scrapers that came together (two Prometheus replicas, a dashboard) each rendered their own, on the
    server's cores. A scrape that arrives while a rendering of the same answer (method, path, query, format,
    encoding) is under way waits for it, and gets figures at most that rendering's age.
    """

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self._app = app
        self._lock = threading.Lock()
        self._running: dict[tuple[str, ...], _Rendering] = {}

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        method = environ.get("REQUEST_METHOD")
        if method == "HEAD":
            return self._head(environ, start_response)
        if method != "GET":
            # prometheus_client's app answers with "Allow: OPTIONS,GET", though HEAD is served (the security hunt).
            status = "200 OK" if method == "OPTIONS" else "405 Method Not Allowed"
            start_response(status, [("Allow", ALLOWED_METHODS), ("Content-Type", "text/plain; charset=utf-8")])
            return [] if method == "OPTIONS" else [f"method not allowed: this port serves GET and HEAD of "
                                                   f"{METRICS_PATH}\n".encode()]
        if _request_path(environ) != METRICS_PATH:
            # prometheus_client's app answers every path with the metrics: a probe of /v2/health/ready or /healthz
            # on this port got 200 while the server was not ready (the operator hunt). A 404 says where to look.
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [f"not found: this port serves Prometheus metrics at {METRICS_PATH} only (health is on the "
                    "gRPC and HTTP listeners)\n".encode()]
        key = tuple(environ.get(name, "") for name in ("REQUEST_METHOD", "PATH_INFO", "QUERY_STRING", "HTTP_ACCEPT",
                                                        "HTTP_ACCEPT_ENCODING"))
        with self._lock:
            rendering = self._running.get(key)
            leads = rendering is None
            if rendering is None:
                rendering = self._running[key] = _Rendering()
        if leads:
            try:
                rendering.answer = self._render(environ)
            finally:
                with self._lock:
                    del self._running[key]
                rendering.done.set()
        else:
            rendering.done.wait()
        answer = rendering.answer if rendering.answer is not None else self._render(environ)  # (its own, then)
        status, headers, body = answer
        start_response(status, list(headers))  # (a copy each: wsgiref adds its Content-Length to the list it gets)
        return [body]

    def _head(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        """A HEAD answered as the GET of the same target would be, without its body (RFC 9110 9.3.2).

        prometheus_client's app answers HEAD 405 and wsgiref sends whatever body an app returns: a HEAD got
        bytes after its headers, which a client reading the next answer on the connection takes as that answer.
        """
        got: list[Any] = []
        body = b"".join(self({**environ, "REQUEST_METHOD": "GET"}, lambda status, headers, exc_info=None:
                             got.extend((status, headers))))
        status, headers = got
        headers = [(name, value) for name, value in headers if name.lower() != "content-length"]
        start_response(status, headers + [("Content-Length", str(len(body)))])
        return []

    def _render(self, environ: dict[str, Any]) -> tuple[str, list[tuple[str, str]], bytes]:
        """Run the app to its end: its status, headers and body."""
        started: list[Any] = []

        def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable:
            started[:] = [status, headers]
            return lambda data: None  # (the write() callable: prometheus_client's app returns its body instead)

        body = b"".join(self._app(environ, start_response))
        return started[0], started[1], body


def _named(app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
    """``app`` answering with nereid's Server header: wsgiref adds its own to an answer without one, naming the
    interpreter's version (``WSGIServer/0.2 CPython/3.11.7``; the security hunt)."""

    def named(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        return app(environ, lambda status, headers, exc_info=None:
                   start_response(status, [*headers, ("Server", SERVER_NAME)], exc_info))
    return named


class _QuietHandler(WSGIRequestHandler):
    """No access log on stderr for every scrape; a connection gets ``timeout`` seconds to send its request.

    Without a timeout each idle connection held its thread forever (1,200
    connections: 1,227 threads). The socket's own timeout is not enough: it
    starts again with every byte, so a header line every few seconds held a
    thread for good, and 64 such connections turned real scrapes away.
    """

    timeout = IDLE_TIMEOUT_S
    # A request line that cannot be read is answered with a status line (HTTP/0.9 has none: the answer was an HTML
    # page alone), in text that names the status without echoing what was sent (the security hunt).
    default_request_version = "HTTP/1.0"
    error_message_format = "%(code)d %(explain)s\n"
    error_content_type = "text/plain; charset=utf-8"

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # The standard phrase for the status: wsgiref's message quotes the request line it could not read.
        super().send_error(code, None, explain)

    def version_string(self) -> str:
        """The Server header of the answers wsgiref makes itself (errors): see :func:`_named`."""
        return SERVER_NAME

    def setup(self) -> None:
        super().setup()
        # wsgiref serves one request per connection: its deadline is counted from the connection's start.
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, time.monotonic() + self.timeout,
                                                       self.timeout))

    def log_message(self, format: str, *args: object) -> None:
        pass


class _DeadlineReader(io.RawIOBase):
    """A socket's reads, all of them together bounded by one deadline rather than each by a timeout."""

    def __init__(self, sock: socket.socket, deadline: float, write_timeout_s: float) -> None:
        super().__init__()
        self._sock = sock
        self._deadline = deadline
        self._write_timeout_s = write_timeout_s

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        """Receive into ``buffer`` within the time left; TimeoutError once the deadline has passed."""
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the metrics request did not arrive in time")
        self._sock.settimeout(left)
        try:
            return self._sock.recv_into(buffer)
        finally:
            # The answer's writes get the whole timeout again, not what was left of the reading's.
            self._sock.settimeout(self._write_timeout_s)


class _BoundedThreadingServer(ThreadingWSGIServer):
    """A thread per connection, but at most :data:`MAX_CONNECTIONS` at once; more are closed at once."""

    request_queue_size = 128  # listen backlog: a burst of connections is accepted, then judged

    _slots: threading.BoundedSemaphore

    @classmethod
    def on_socket(cls, sock: socket.socket, app: Any, handler: type[WSGIRequestHandler],
                  slots: threading.BoundedSemaphore) -> _BoundedThreadingServer:
        """A server listening on ``sock``, already bound (see nereid.listening), serving ``app``; ``slots``:
        the connections it may serve at once, shared with the endpoint's servers on its other addresses."""
        server = cls(sock.getsockname()[:2], handler, bind_and_activate=False)
        server._slots = slots
        server.socket.close()
        server.socket = sock
        # What the base classes' server_bind sets once they have bound.
        server.server_address = sock.getsockname()
        server.server_name, server.server_port = str(server.server_address[0]), server.server_address[1]
        server.setup_environ()
        server.server_activate()
        server.set_app(app)
        return server

    def process_request(self, request: socket.socket, client_address: object) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except RuntimeError as err:
            # Its thread cannot start ("can't start new thread": RLIMIT_NPROC, memory): the connection was closed
            # unanswered. Answered 503 here, on the listener's own thread.
            self._slots.release()
            _answer_without_a_thread(request, client_address, err)
            self.shutdown_request(request)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: socket.socket, client_address: object) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: socket.socket, client_address: object) -> None:
        # A client that timed out or vanished is not worth a traceback on stderr.
        log.debug("metrics connection from %s failed", client_address, exc_info=True)


def _answer_without_a_thread(request: socket.socket, client_address: Any, error: RuntimeError) -> None:
    """Answer 503 on a connection no thread could be started for, from the listener's thread, and log it.

    The answer (a few hundred bytes) goes into the new socket's empty send buffer without waiting. The request is
    then read, for at most :data:`NO_THREAD_READ_S`: closing a socket with bytes unread resets the connection,
    which can discard the answer before the client reads it. A silent client costs the listener that long.
    """
    reason = str(error) or type(error).__name__
    host, port = (client_address[0], client_address[1]) if isinstance(client_address, tuple) else ("unknown", "")
    _no_thread_log.warning("metrics: no thread could start to serve the connection from %s (%s); answered 503",
                           f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}", reason)
    body = f"503 the server cannot start a thread to serve this request ({reason}); try again later\n".encode()
    head = (f"HTTP/1.0 503 Service Unavailable\r\nServer: {SERVER_NAME}\r\nContent-Type: text/plain; charset=utf-8"
            f"\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    try:
        request.setblocking(False)
        request.send(head + body)
        request.shutdown(socket.SHUT_WR)
        deadline, tail, total = time.monotonic() + NO_THREAD_READ_S, b"", 0
        while b"\r\n\r\n" not in tail and total < 65536:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            request.settimeout(left)
            chunk = request.recv(65536)
            if not chunk:
                break
            tail, total = tail[-3:] + chunk, total + len(chunk)  # (only the end of the head is looked for)
    except OSError:  # the client gone, or silent past the bound: nothing more to do for it
        pass
