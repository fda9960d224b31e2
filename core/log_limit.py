"""Log lines that can repeat without end, limited.

A client sending garbage as fast as it can must not fill the disk with one
warning per message: :class:`RateLimitedLog` writes at most ``burst`` lines per
``window_s``, and says how many it suppressed: in a line of its own when the
window ends (on an event loop), or in the next line written. A scan that meets
the same bad name every time says so once (:class:`OnceLog`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from dataclasses import dataclass

# A report timer that finds this much of a window left ran after a line began a new window (and told the count).
_NEW_WINDOW_S = 0.001


class _Budget:
    """At most ``burst`` events per ``window_s`` seconds; thread-safe."""

    def __init__(self, burst: int, window_s: float) -> None:
        self.burst = burst
        self.window_s = window_s
        self._window_start = time.monotonic()
        self._spent = 0
        self._refused = 0
        self._lock = threading.Lock()

    def take(self) -> int | None:
        """None when over the budget; otherwise how many events were refused since the last one taken."""
        with self._lock:
            now = time.monotonic()
            if now - self._window_start >= self.window_s:
                self._window_start, self._spent = now, 0
            if self._spent >= self.burst:
                self._refused += 1
                return None
            self._spent += 1
            refused, self._refused = self._refused, 0
            return refused

    def seconds_left(self) -> float:
        """How long the current window lasts still."""
        with self._lock:
            return max(0.0, self._window_start + self.window_s - time.monotonic())

    def refused(self) -> int:
        """How many events were refused and not yet handed over (by :meth:`take` or :meth:`take_refused`)."""
        with self._lock:
            return self._refused

    def take_refused(self) -> int:
        """:meth:`refused`, handed over: the count starts again from 0."""
        with self._lock:
            refused, self._refused = self._refused, 0
            return refused


@dataclass
class _CountReport:
    """The line saying how many lines a budget refused, due at its window's end; shared by the logs sharing
    the budget. Touched on event loops only."""

    handle: asyncio.TimerHandle | None = None  # pending on ``loop``
    loop: asyncio.AbstractEventLoop | None = None
    last: tuple[logging.Logger, int, str, tuple] | None = None  # the last line refused: logger, level, message, args


class RateLimitedLog:
    """``warning()`` that writes at most ``burst`` lines per ``window_s`` seconds."""

    def __init__(self, logger: logging.Logger, burst: int = 10, window_s: float = 10.0) -> None:
        self._logger = logger
        self._budget = _Budget(burst, window_s)
        # A flood that stops would otherwise never say how large it was.
        self._report = _CountReport()
        _LOGS.add(self)

    def sharing(self, logger: logging.Logger) -> RateLimitedLog:
        """A log writing through ``logger`` within this one's limit: the lines of both count together."""
        shared = RateLimitedLog(logger)
        shared._budget, shared._report = self._budget, self._report
        return shared

    def warning(self, message: str, *args: object) -> bool:
        """Log ``message % args`` at WARNING unless over the limit; True when it was written."""
        return self.log(logging.WARNING, message, *args)

    def error(self, message: str, *args: object, exc_info: BaseException | None = None) -> bool:
        """Log ``message % args`` at ERROR (with ``exc_info``'s traceback) unless over the limit."""
        return self.log(logging.ERROR, message, *args, exc_info=exc_info)

    def log(self, level: int, message: str, *args: object, exc_info: BaseException | None = None) -> bool:
        """Log ``message % args`` at ``level`` unless over the limit; True when it was written."""
        suppressed = self._budget.take()
        if suppressed is None:
            self._report_at_window_end(level, message, args)
            return False
        if suppressed:
            message += f" ({suppressed} similar message(s) suppressed before this one)"
        self._logger.log(level, message, *args, exc_info=exc_info)
        return True

    def _report_at_window_end(self, level: int, message: str, args: tuple) -> None:
        """Say how many lines were suppressed once the window ends, unless a line written then says it first.

        Only on an event loop (where every client line is written): off one
        (a thread, a script) the next line written says it, as it always did,
        and so it does when the loop closes before the window ends.
        """
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        report = self._report
        # Kept as text: an argument may be an exception whose traceback holds a request's tensors, which the
        # report must not keep alive until the next line.
        report.last = (self._logger, level, message,
                       tuple(arg if isinstance(arg, (str, int, float)) else str(arg) for arg in args))
        if report.handle is not None and report.loop is loop:
            return  # due on this loop already
        self._schedule(loop, self._budget.seconds_left())

    def _schedule(self, loop: asyncio.AbstractEventLoop, delay_s: float) -> None:
        self._report.loop = loop
        self._report.handle = loop.call_later(delay_s, self._say_suppressed, loop)

    def _say_suppressed(self, loop: asyncio.AbstractEventLoop) -> None:
        report = self._report
        if report.loop is loop:
            report.handle = None
        left = self._budget.seconds_left()
        if left > _NEW_WINDOW_S:
            # A line written since (late as this timer ran, on a busy loop) began a new window and told the count:
            # what that window refuses is told at its end.
            if self._budget.refused():
                self._schedule(loop, left)
            return
        self._say_count(self._budget.take_refused())

    def say_suppressed_now(self) -> None:
        """Say now how many lines were suppressed and not yet told, rather than at the window's end."""
        report = self._report
        if report.handle is not None:
            report.handle.cancel()
            report.handle = None
        self._say_count(self._budget.take_refused())

    def _say_count(self, suppressed: int) -> None:
        report = self._report
        if not suppressed or report.last is None:
            return
        logger, level, message, args = report.last
        try:
            last = message % args if args else message
        except (TypeError, ValueError):  # (a caller's malformed format: said as it is)
            last = f"{message} {args!r}"
        logger.log(level, "%d similar message(s) suppressed in the last %g s (at most %d written per window); "
                   "the last: %s", suppressed, self._budget.window_s, self._budget.burst, last)


# Every RateLimitedLog made, for say_suppressed_counts_now (held weakly: a log goes with its owner).
_LOGS: weakref.WeakSet[RateLimitedLog] = weakref.WeakSet()


def say_suppressed_counts_now() -> None:
    """Have every rate-limited log say now what it suppressed and has not told yet: called as the server stops,
    whose loop closes before the windows' timers run (a flood just before a stop was never told; the operator
    hunt). On the event loop the timers were set on."""
    for log in list(_LOGS):
        log.say_suppressed_now()


class OnceLog:
    """``warning()`` that writes each key's line the first time only (a scan would otherwise repeat it).

    Bounded: past ``capacity`` keys (names made and removed in a loop) it
    forgets them all and starts afresh.
    """

    def __init__(self, logger: logging.Logger, capacity: int = 10_000) -> None:
        self._logger = logger
        self._capacity = capacity
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def warning(self, key: str, message: str, *args: object) -> bool:
        """Log ``message % args`` at WARNING unless ``key``'s was logged before; True when it was written."""
        with self._lock:
            if key in self._seen:
                return False
            if len(self._seen) >= self._capacity:
                self._seen.clear()
            self._seen.add(key)
        self._logger.warning(message, *args)
        return True


class RateLimitFilter(logging.Filter):
    """A logging filter that lets through at most ``burst`` records per ``window_s`` seconds among those whose
    message starts with one of ``prefixes``; other records pass untouched.

    For a library's own lines that can repeat without end: asyncio logs
    "socket.accept() out of system resource", with a traceback, once per
    pending connection while the process is out of file descriptors, about
    12,000 lines a second. The next line let through says how many were
    dropped.
    """

    def __init__(self, prefixes: tuple[str, ...], burst: int = 5, window_s: float = 60.0) -> None:
        super().__init__()
        self._prefixes = prefixes
        self._budget = _Budget(burst, window_s)

    def filter(self, record: logging.LogRecord) -> bool:
        if not isinstance(record.msg, str) or not record.msg.startswith(self._prefixes):
            return True
        dropped = self._budget.take()
        if dropped is None:
            return False
        if dropped:
            record.msg = f"{record.msg}\n({dropped} more such line(s) were dropped before this one)"
        return True


class EndedCallFilter(logging.Filter):
    """grpcio's ERROR, with a traceback, for an answer it could not send because the call had already ended.

    A request's deadline can pass in gRPC's core at the moment nereid answers
    DEADLINE_EXCEEDED (or a client cancels as the answer goes out): the client
    has its status either way, and nothing is wrong with the server. Such a
    record becomes one DEBUG line, written only when DEBUG is on.
    """

    PREFIX = "ExecuteBatchError raised in core by servicer method"

    def filter(self, record: logging.LogRecord) -> bool:
        if not isinstance(record.msg, str) or not record.msg.startswith(self.PREFIX):
            return True
        if not logging.getLogger("nereid").isEnabledFor(logging.DEBUG):
            return False
        method = record.getMessage().removeprefix(self.PREFIX).strip()
        record.msg, record.args = "gRPC could not send the answer of %s: the call had already ended", (method,)
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        record.exc_info = record.exc_text = None
        return True
