"""A watch on the server's event loop: whatever blocks it is named in the log while it blocks.

Every model and every client waits while the event loop runs one callback. An
``async def infer`` that calls ``time.sleep`` or a blocking library stalls the
whole server, and nothing else would say so: the requests merely get slow.

:class:`LoopWatch` schedules a heartbeat on the loop and checks it from a
daemon thread. When the heartbeat is late by more than ``warn_after_s``, the
thread logs one WARNING naming the code the loop is running at that moment
(its own stack, read with ``sys._current_frames``), while it still runs; when
the loop runs again, the heartbeat logs how long it was held. When the thread
itself wakes late by as long (a thread held the GIL in a long C call: no Python
code of the process ran, the loop's and the watch's alike), it says so once it
runs, naming the threads then in a model's code.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import importlib.util
import logging
import os
import site
import sys
import sysconfig
import threading
import time
import types
import weakref
from collections.abc import Iterable
from pathlib import Path

from nereid.collector_pause import collector_paused
from nereid.daemon_pool import start_daemon_thread

log = logging.getLogger("nereid.loop")

DEFAULT_WARN_AFTER_S = 1.0
_ASYNCIO = str(Path(asyncio.__file__).parent)
_HANDLE_FILE = str(Path(asyncio.__file__).parent / "events.py")  # where Handle._run runs every callback
STOP_JOIN_S = 5.0  # the watching thread wakes at once; only a log handler that blocks could hold it
_SHOWN_FRAMES = 4  # of the callback's stack, innermost last: enough to name the caller of a blocking call
_SHOWN_THREADS = 8  # in a stall's report: a server runs many threads, few of them in model code


class _CollectorClock:
    """The seconds Python's garbage collector has run in this process, counted while any watch runs.

    A full collection of a large heap runs inside whichever callback
    allocated last: 0.3-0.7 s for 700,000 objects in a loaded test run (a
    server with jax loaded holds about 120,000: 30 ms here), more for a model
    that keeps millions of Python objects. That callback did not block the
    loop, so the watch takes the collector's time off a hold before it blames
    one.
    """

    def __init__(self) -> None:
        # (seconds of finished collections, when the running one started or None), replaced whole: the watching
        # thread can look while a collection's callback runs (it waits for the GIL through the collection and
        # gets it as the callback begins), and must see either the state before that step or after it.
        self._state: tuple[float, float | None] = (0.0, None)
        self._watches = 0
        self._lock = threading.Lock()

    def _on_collection(self, phase: str, info: dict) -> None:
        # Called with the GIL held, around each collection, which never overlap: no lock needed.
        finished_s, started = self._state
        if phase == "start":
            self._state = (finished_s, time.monotonic())
        elif started is not None:
            self._state = (finished_s + time.monotonic() - started, None)

    def seconds(self, now: float) -> float:
        """The collector's seconds so far, the running collection's until ``now`` (a ``time.monotonic()`` reading
        taken just before) included: a look that lands as a collection ends would otherwise blame it on the
        callback."""
        finished_s, started = self._state
        return finished_s if started is None else finished_s + max(0.0, now - started)

    def attach(self) -> None:
        with self._lock:
            self._watches += 1
            if self._watches == 1:
                # A collection whose start was seen before the last detach never ends here: forget it.
                self._state = (self._state[0], None)
                gc.callbacks.append(self._on_collection)

    def detach(self) -> None:
        with self._lock:
            self._watches -= 1
            if self._watches == 0 and self._on_collection in gc.callbacks:
                gc.callbacks.remove(self._on_collection)


_COLLECTOR = _CollectorClock()


class LoopWatch:
    """Log the code holding ``loop`` once it has held it ``warn_after_s`` seconds; start on the loop's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, warn_after_s: float = DEFAULT_WARN_AFTER_S,
                 plugin_code: Iterable[str] = ()) -> None:
        """``plugin_code``: where installed backend plugins' code lives (see :func:`nereid.plugins.plugin_code`):
        under site-packages, which holds library code, but a hold in it is a model author's to fix (a plugin's
        ``async def infer`` that blocks)."""
        self._loop = loop
        self._plugin_folders = tuple(plugin_code)
        self._warn_after_s = warn_after_s
        # A beat (and a look) every tenth of the limit: a hold is seen within 10% of it, at ten wake-ups a second.
        self._interval_s = warn_after_s / 10
        self._last_beat = time.monotonic()
        # The callback the loop was seen running while the beat was late (weakly), and since when (None: none is).
        self._holder: weakref.ref[asyncio.Handle] | None = None
        self._held_since = 0.0
        self._collected_before = 0.0  # the collector's total when the holder was first seen
        self._reported = False  # the holder's hold was logged: its end is logged too
        self._attached = False  # counted in _COLLECTOR's watches
        self._loop_thread: int | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # the beat's bookkeeping, shared with the watching thread
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Begin beating on the loop and watching from a daemon thread. Called from the loop's own thread."""
        self._loop_thread = threading.get_ident()
        _COLLECTOR.attach()
        self._attached = True
        self._last_beat = time.monotonic()
        self._handle = self._loop.call_later(self._interval_s, self._beat)
        self._thread = start_daemon_thread(self._watch, "nereid-loop-watch")

    def stop(self) -> None:
        """Stop beating and watching; returns once the thread has ended (at once: it waits on the stop).

        Joined, not left to end by itself: ``nereid serve`` takes a ``nereid-``
        thread still alive at its exit for abandoned work, and ends the process
        at once.
        """
        self._stopping.set()
        self._detach_collector()
        if self._handle is not None:
            self._handle.cancel()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(STOP_JOIN_S)

    def _detach_collector(self) -> None:
        with self._lock:  # (stop() and a watch whose loop closed may both get here)
            if self._attached:
                self._attached = False
                _COLLECTOR.detach()

    def _beat(self) -> None:
        with self._lock:
            now = time.monotonic()
            if self._reported:
                log.warning("the event loop runs again after %.1f s held by one callback", now - self._held_since)
            self._holder, self._reported = None, False
            self._last_beat = now
        if not self._stopping.is_set():
            self._handle = self._loop.call_later(self._interval_s, self._beat)

    def _watch(self) -> None:
        slept_at = time.monotonic()
        collected_at = _COLLECTOR.seconds(slept_at)
        while not self._stopping.wait(self._interval_s):
            if self._loop.is_closed():
                self._detach_collector()
                return  # a loop closed without stop(): nothing of it runs any more
            # Woken late: this thread, too, could not run. A look cannot see that stall while it lasts (it needs
            # the GIL as much as the loop does), so it is said once it is over. The collector's time is not
            # counted, as for a callback's hold.
            now = time.monotonic()
            collected = _COLLECTOR.seconds(now)
            stalled_s = now - slept_at - self._interval_s - (collected - collected_at)
            if stalled_s >= self._warn_after_s:
                _report_stall(stalled_s, self._plugin_folders)
            self._look()  # (a method of its own: nothing it read of the loop's thread outlives the look)
            slept_at = time.monotonic()
            collected_at = _COLLECTOR.seconds(slept_at)

    def _look(self) -> None:
        # Under the beat's lock: a beat that ran meanwhile would make the stack read below another callback's.
        with self._lock:
            now = time.monotonic()
            # Read with `now`, before anything below allocates: a collection that ran after `now` (one an
            # allocation of this look's triggers, on this thread) would count as held before `now`, and the next
            # look would blame it on the callback.
            collected = _COLLECTOR.seconds(now)
            if now - self._last_beat < 2 * self._interval_s or self._reported:
                return  # the beat is on time (or this hold was said)
            # Late: the loop runs one long callback, or many short ones in one pass, or waits for the GIL or a
            # CPU. Only the same callback seen for warn_after_s is blamed. It is remembered by a weak reference:
            # a strong one would keep its task, and the request that task holds, alive (a 64 MiB one, say).
            frame, holder = self._callback_frame()
            if holder is None or self._holder is None or holder is not self._holder():
                self._holder = weakref.ref(holder) if holder is not None else None
                self._held_since = now  # (first seen: it may have started a little before)
                self._collected_before = collected
                return
            held_s = now - self._held_since - (collected - self._collected_before)
            if held_s < self._warn_after_s:
                return
            self._reported = True
            running, in_model_code = _innermost(frame, self._plugin_folders)
            if in_model_code:
                log.warning("the event loop has been held for %.1f s by one callback, so every model and client "
                            "waits: an async def that blocks (time.sleep, blocking I/O, a long computation) "
                            "belongs on a worker thread (a plain def infer, or asyncio.to_thread). It is running: "
                            "%s", held_s, running)
            else:
                # (The advice above misled here: a stall inside grpcio, or nereid's own code, is no model author's
                # to move. The callback names what the frames cannot, when no Python frame runs in it.)
                log.warning("the event loop has been held for %.1f s by one callback, so every model and client "
                            "waits; no model code runs in it (the server's own work, or a library's): it is "
                            "running %s (callback %s)", held_s, running, repr(holder)[:200])

    def _callback_frame(self) -> tuple[types.FrameType | None, asyncio.Handle | None]:
        """The frame of asyncio's ``Handle._run`` the loop's thread is in, and its handle, when it is one of this
        loop's; (None, None) when it runs no callback (waiting in its selector, between callbacks)."""
        top = current_frames().get(self._loop_thread) if self._loop_thread is not None else None
        frame = top
        while frame is not None and not (frame.f_code.co_name == "_run" and frame.f_code.co_filename == _HANDLE_FILE):
            frame = frame.f_back
        if frame is None:
            return None, None
        handle = frame.f_locals.get("self")
        if not isinstance(handle, asyncio.Handle) or handle._loop is not self._loop:
            return None, None  # another loop's, on the same thread (this one's ended without stop())
        return top, handle


def current_frames() -> dict[int, types.FrameType]:
    """``sys._current_frames()`` with the collector paused.

    On Python 3.11 before 3.11.9 it makes frame objects while it holds the
    runtime's lock on the list of threads. A collection triggered there runs
    ``gc.callbacks`` (this module's clock among them), whose Python code can
    hand the GIL to a thread that then starts or ends a thread, which waits for
    that lock while holding the GIL: the whole process hung for good (CPython
    gh-106883; the complexity hunt saw a server of 1,000 models hang at its
    stop, the watch reading frames as the unload started threads).
    """
    with collector_paused():
        return sys._current_frames()


def _report_stall(stalled_s: float, plugin_folders: tuple[str, ...] = ()) -> None:
    """Log that no Python code of the process ran for ``stalled_s`` seconds, naming the threads that are in a
    model's own code now (the one that held the GIL may still be: it ran on after its long call)."""
    suspects = _threads_in_model_code(threading.get_ident(), plugin_folders)
    shown = "; ".join(suspects[:_SHOWN_THREADS]) + ("; ..." if len(suspects) > _SHOWN_THREADS else "")
    log.warning("no Python code of the server could run for %.1f s (this watch of its event loop included), so "
                "every model and client waited: a thread held the GIL through a long call into code that does "
                "not release it (sum() over a huge range, a regular expression, a C extension's loop), or the "
                "process got no CPU. %s", stalled_s,
                f"Threads in a model's code now: {shown}" if suspects else "No thread is in a model's code now.")


def _threads_in_model_code(skip: int, plugin_folders: tuple[str, ...] = ()) -> list[str]:
    """Each thread but ``skip`` whose stack holds a model's own code, as ``name (file:line in function)`` for the
    innermost such frame (a thread idle in a pool, or in the server's own code, has none)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    found = []
    for ident, frame in current_frames().items():
        if ident == skip:
            continue
        while frame is not None and not _is_model_code(frame.f_code.co_filename, plugin_folders):
            frame = frame.f_back
        if frame is not None:
            code = frame.f_code
            found.append(f"{names.get(ident, ident)} ({code.co_filename}:{frame.f_lineno} in {code.co_name})")
    return found


def _innermost(frame: types.FrameType | None, plugin_folders: tuple[str, ...] = ()) -> tuple[str, bool]:
    """The innermost frames of the callback ``frame`` runs, outermost first, as ``file:line in function``: what is
    inside asyncio's ``Handle._run``, less asyncio's own frames. When those are all a library's (a blocking call
    deep in ``subprocess``), the innermost frame of a model's own code comes first: the call that blocks. And
    whether a model's own code is among them (not only the standard library's, a package's or nereid's).

    Read from the frames alone, never from their source files (as ``traceback`` would, for lines it shows none
    of): the beat waits on this under the watch's lock.
    """
    stack: list[tuple[str, int, str]] = []  # (file, line, function), innermost first until reversed
    while frame is not None:
        stack.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    stack.reverse()
    starts = [index for index, (filename, _, name) in enumerate(stack) if name == "_run" and filename == _HANDLE_FILE]
    inside = [entry for entry in stack[starts[-1] + 1:] if not entry[0].startswith(_ASYNCIO)] if starts else []
    if not inside:
        return "(asyncio's own code)", False
    shown = inside[-_SHOWN_FRAMES:]
    text = " > ".join(f"{filename}:{line} in {name}" for filename, line, name in shown)
    own = next((entry for entry in reversed(inside) if _is_model_code(entry[0], plugin_folders)), None)
    if own is not None and own not in shown:
        return f"{own[0]}:{own[1]} in {own[2]} > ... > {text}", True
    return text, own is not None


def _is_model_code(filename: str, plugin_folders: tuple[str, ...] = ()) -> bool:
    """Whether code of ``filename`` is a model's own: an installed backend plugin's (``plugin_folders``: package
    folders, each ending in a separator, and module files), or neither a library's (see
    :func:`_library_folders`) nor code with no file (``<string>``, ``<frozen ...>``)."""
    if filename.startswith(plugin_folders):
        return True
    return not filename.startswith(_library_folders()) and not filename.startswith("<")


@functools.cache
def _library_folders() -> tuple[str, ...]:
    """The folders of code that is no model's own: the standard library, installed packages, their console
    scripts (the ``nereid`` command, whose frame is the main thread's outermost: every stall report named it a
    model's code; a bug hunt), and nereid (the core and the built-in backends, apart in an editable install)."""
    folders = {Path(path) for key, path in sysconfig.get_paths().items()
               if key in ("stdlib", "platstdlib", "purelib", "platlib", "scripts")}
    with contextlib.suppress(KeyError):  # (pip install --user puts the command in ~/.local/bin)
        folders.add(Path(sysconfig.get_path("scripts", f"{os.name}_user")))
    folders.update(Path(path) for path in (*site.getsitepackages(), site.getusersitepackages()))
    folders.add(Path(__file__).parent)
    spec = importlib.util.find_spec("nereid.backends")  # (found, not imported: the core imports no backend)
    if spec is not None and spec.submodule_search_locations:
        folders.update(Path(location) for location in spec.submodule_search_locations)
    return tuple(f"{folder}{os.sep}" for folder in folders)
