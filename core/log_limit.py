"""Log lines that can repeat without end, limited.

A client sending garbage as fast as it can must not fill the disk with one
warning per message: :class:`RateLimitedLog` writes at most ``burst`` lines per
``window_s``, and the next line written says how many were suppressed in
between. A scan that meets the same bad name every time says so once
(:class:`OnceLog`).
"""

from __future__ import annotations

import logging
import threading
import time


class _Budget:
    """At most ``burst`` events per ``window_s`` seconds; thread-safe."""

    def __init__(self, burst: int, window_s: float) -> None:
        self._burst = burst
        self._window_s = window_s
        self._window_start = time.monotonic()
        self._spent = 0
        self._refused = 0
        self._lock = threading.Lock()

    def take(self) -> int | None:
        """None when over the budget; otherwise how many events were refused since the last one taken."""
        with self._lock:
            now = time.monotonic()
            if now - self._window_start >= self._window_s:
                self._window_start, self._spent = now, 0
            if self._spent >= self._burst:
                self._refused += 1
                return None
            self._spent += 1
            refused, self._refused = self._refused, 0
            return refused


class RateLimitedLog:
    """``warning()`` that writes at most ``burst`` lines per ``window_s`` seconds."""

    def __init__(self, logger: logging.Logger, burst: int = 10, window_s: float = 10.0) -> None:
        self._logger = logger
        self._budget = _Budget(burst, window_s)

    def sharing(self, logger: logging.Logger) -> RateLimitedLog:
        """A log writing through ``logger`` within this one's limit: the lines of both count together."""
        shared = RateLimitedLog(logger)
        shared._budget = self._budget
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
            return False
        if suppressed:
            message += f" ({suppressed} similar message(s) suppressed before this one)"
        self._logger.log(level, message, *args, exc_info=exc_info)
        return True


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
