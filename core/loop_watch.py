"""A watch on the server's event loop: whatever blocks it is named in the log while it blocks.

Every model and every client waits while the event loop runs one callback. An
``async def infer`` that calls ``time.sleep`` or a blocking library stalls the
whole server, and nothing else would say so: the requests merely get slow.

:class:`LoopWatch` schedules a heartbeat on the loop and checks it from a
daemon thread. When the heartbeat is late by more than ``warn_after_s``, the
thread logs one WARNING naming the code the loop is running at that moment
(its own stack, read with ``sys._current_frames``), while it still runs; when
the loop runs again, the heartbeat logs how long it was held.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback
from pathlib import Path

log = logging.getLogger("nereid.loop")

DEFAULT_WARN_AFTER_S = 1.0
_ASYNCIO = str(Path(asyncio.__file__).parent)
_HANDLE_FILE = str(Path(asyncio.__file__).parent / "events.py")  # where Handle._run runs every callback
_SHOWN_FRAMES = 4  # of the callback's stack, innermost last: enough to name the caller of a blocking call


class LoopWatch:
    """Log the code holding ``loop`` once it has held it ``warn_after_s`` seconds; start on the loop's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, warn_after_s: float = DEFAULT_WARN_AFTER_S) -> None:
        self._loop = loop
        self._warn_after_s = warn_after_s
        # A beat every tenth of the limit: a stall is seen within 10% of it, at ten wake-ups a second.
        self._interval_s = warn_after_s / 10
        self._last_beat = time.monotonic()
        self._reported: float | None = None  # the beat whose lateness was reported (None: none is)
        self._loop_thread: int | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # the beat's bookkeeping, shared with the watching thread
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Begin beating on the loop and watching from a daemon thread. Called from the loop's own thread."""
        self._loop_thread = threading.get_ident()
        self._last_beat = time.monotonic()
        self._handle = self._loop.call_later(self._interval_s, self._beat)
        self._thread = threading.Thread(target=self._watch, name="nereid-loop-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop beating and watching (the thread ends within one interval)."""
        self._stopping.set()
        if self._handle is not None:
            self._handle.cancel()

    def _beat(self) -> None:
        with self._lock:
            now = time.monotonic()
            if self._reported == self._last_beat:
                log.warning("the event loop runs again after %.1f s held by one callback",
                            now - self._last_beat - self._interval_s)
            self._reported = None
            self._last_beat = now
        if not self._stopping.is_set():
            self._handle = self._loop.call_later(self._interval_s, self._beat)

    def _watch(self) -> None:
        while not self._stopping.wait(self._interval_s):
            # Under the beat's lock: a beat that ran meanwhile would make the stack read below another callback's.
            with self._lock:
                last = self._last_beat
                # The beat is due one interval after the last: lateness beyond that is the loop being held.
                held_s = time.monotonic() - last - self._interval_s
                if held_s < self._warn_after_s or self._reported == last:
                    continue
                running = self._callback_running()
                if running is None:
                    # Late, yet between callbacks (waiting for the GIL or a CPU): nothing the loop runs holds it.
                    continue
                self._reported = last
                log.warning("the event loop has been held for %.1f s by one callback, so every model and client "
                            "waits: an async def that blocks (time.sleep, blocking I/O, a long computation) "
                            "belongs on a worker thread (a plain def infer, or asyncio.to_thread). It is running: %s",
                            held_s, running)

    def _callback_running(self) -> str | None:
        """The innermost frames of the callback the loop runs, outermost first, as ``file:line in function``.

        None when the loop's thread runs no callback: it is waiting in its selector or between callbacks.
        """
        frame = sys._current_frames().get(self._loop_thread) if self._loop_thread is not None else None
        if frame is None:
            return None
        stack = traceback.extract_stack(frame)
        # A callback runs inside asyncio's Handle._run; what is outside it is the loop's own machinery.
        starts = [index for index, entry in enumerate(stack)
                  if entry.name == "_run" and entry.filename == _HANDLE_FILE]
        inside = [entry for entry in stack[starts[-1] + 1:] if not entry.filename.startswith(_ASYNCIO)] if starts else []
        if not inside:
            return None  # a callback of asyncio's own (a task's step between coroutines): waiting for the GIL
        return " > ".join(f"{entry.filename}:{entry.lineno} in {entry.name}" for entry in inside[-_SHOWN_FRAMES:])
