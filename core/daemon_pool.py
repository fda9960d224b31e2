"""A thread pool whose threads never hold the process open.

``ThreadPoolExecutor`` joins its threads when the interpreter exits, so one
backend call that never returns (an in-process model stuck in native code)
made SIGTERM hang forever, even after the unload had given up on it. This pool
runs the same way (threads started on demand up to ``max_workers``, idle ones
reused) on daemon threads: what is abandoned stays abandoned.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import os
import queue
import threading
import time
from concurrent.futures import CancelledError, Executor, Future
from typing import Any, Callable, TypeVar

from nereid.errors import Unavailable, describe_exception
from nereid.memory import address_space_limit_mib

T = TypeVar("T")

log = logging.getLogger(__name__)

_STOP = None


class ThreadStartFailed(Unavailable, RuntimeError):
    """A call the pool could not start a worker thread for; it was not queued, and never runs.

    The process cannot start another thread now: a process or thread limit
    (``ulimit -u``, a container's pids limit) is reached, as a rule. A
    condition of the process that passes, not a fault of what was called:
    UNAVAILABLE (HTTP 503) where it reaches a client (the server's own work off
    the loop, a large request's decode: it was a 500 and a bug's traceback; the
    review hunt). ``cause`` is what the thread's start raised.
    """

    def __init__(self, cause: RuntimeError) -> None:
        super().__init__(f"{describe_exception(cause)}: {thread_start_hint()}")
        self.cause = cause


def start_daemon_thread(target: Callable[..., object], name: str, *args: Any, **kwargs: Any) -> threading.Thread:
    """Start ``target(*args, **kwargs)`` on a new daemon thread called ``name``; ThreadStartFailed when the process
    can start no thread, naming the usual causes (see :func:`thread_start_hint`).

    Threads outside the pool (a load's, the server's watchers) failed with a bare ``RuntimeError: can't start new
    thread``: a load's reason, or a traceback ending ``nereid serve`` as it started (the deploy hunt, under
    ``ulimit -v``)."""
    thread = threading.Thread(target=target, name=name, args=args, kwargs=kwargs, daemon=True)
    try:
        thread.start()
    except RuntimeError as err:  # (the interpreter's "can't start new thread": EAGAIN from pthread_create)
        raise ThreadStartFailed(err) from err
    return thread


def thread_start_hint() -> str:
    """Why a thread cannot start, as a rule: a process or thread limit, or (when the server has one) an address-space
    limit too low for another thread's stack. Under ``ulimit -v`` the limit alone was named, the wrong cause (the
    deploy hunt)."""
    hint = "a process or thread limit, such as ulimit -u or a container's pids limit, is reached"
    if (limit := address_space_limit_mib()) is not None:
        hint += f", or the address-space limit (ulimit -v, {limit} MiB) leaves no room for another thread's stack"
    return hint


def make_room_for_threads(count: int) -> None:
    """Start ``count`` threads that wait, then end them; ThreadStartFailed when they could not all start.

    Asked before native code that aborts the whole process when it cannot start
    its own threads (XLA's CPU client and compiler pools, an absl CHECK): at a
    process or thread limit the work is refused, where the server died (the
    exhaustion hunt). Others may take the room between this and that code:
    it makes the abort unlikely, not impossible."""
    release = threading.Event()
    started: list[threading.Thread] = []
    try:
        for _ in range(count):
            thread = threading.Thread(target=release.wait, name="nereid-thread-room", daemon=True)
            try:
                thread.start()
            except RuntimeError as err:
                raise ThreadStartFailed(err) from None
            started.append(thread)
    finally:
        release.set()
        for thread in started:
            thread.join()


# How long a worker thread waits idle for a call before it ends (the next call starts another).
IDLE_THREAD_S = 60.0


class DaemonThreadPool(Executor):
    """An :class:`~concurrent.futures.Executor` of at most ``max_workers`` daemon threads.

    A thread idle for ``idle_s`` ends: every model has a pool of its own, and a
    server of hundreds of models, each called once, kept a thread per model and
    instance for good, which under a container's pids limit left later models'
    calls no thread to start on (the scale hunt).
    """

    def __init__(self, max_workers: int, thread_name_prefix: str = "nereid-pool",
                 idle_s: float = IDLE_THREAD_S) -> None:
        if max_workers < 1:
            raise ValueError("max_workers must be at least 1")
        self._max_workers = max_workers
        self._prefix = thread_name_prefix
        self._idle_s = idle_s
        self._started = 0  # threads started so far: names stay unique as threads end and others start
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        # Idle threads no queued call is promised to, and queued calls promised to a busy thread (every thread
        # busy, at max_workers): counted exactly, under the lock. (A busy thread took a call queued for it and
        # then counted itself idle too: harmless while threads never ended, but once idle ones did, the pool
        # counted idle threads it no longer had, and later calls waited for them for ever: the hunt of this
        # session's changes.)
        self._idle = 0
        self._owed = 0
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._shut_down = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        """Schedule ``fn(*args, **kwargs)``; its future. ThreadStartFailed when it needed a new worker thread
        that could not start (it never runs)."""
        future: Future = Future()
        self._put((future, fn, args, kwargs))
        return future

    def call(self, fn: Callable[[Any], Any], argument: Any, done: Callable[[Any, BaseException | None], None]) -> None:
        """Schedule ``fn(argument)``; then call ``done(result, None)`` or ``done(None, error)`` on the worker thread.

        The lean form of :meth:`submit` for a caller that hands the outcome on itself
        (the scheduler wakes its event loop once), with no Future in between. A call
        dropped by ``shutdown(cancel_futures=True)`` gets ``done(None, CancelledError())``. ThreadStartFailed
        when it needed a new worker thread that could not start: ``done`` is never called, ``fn`` never runs.
        """
        self._put((None, fn, argument, done))

    def _put(self, item: tuple) -> None:
        with self._lock:
            if self._shut_down:
                raise RuntimeError("cannot schedule new calls after shutdown")
            if self._idle:
                self._idle -= 1
            elif len(self._threads) < self._max_workers:
                self._start_thread()
            else:
                self._owed += 1  # (the first busy thread to finish takes it)
            self._work.put(item)

    def _start_thread(self) -> None:
        """Start one more worker thread, for the call about to be queued; ThreadStartFailed if it cannot start.
        Under the lock.

        Started before the call is queued: queued first, a call whose thread
        failed to start was reported failed to its caller and yet ran later, on
        the next thread to come (a request answered INTERNAL still ran; found by
        a resource-limits hunt). Nor is it queued for the busy threads then: one
        of them may never return (a hung model), and the idle count would
        promise a thread that never frees, so the pool would run short of one.
        """
        thread = threading.Thread(target=self._run, name=f"{self._prefix}_{self._started}", daemon=True)
        try:
            thread.start()
        except RuntimeError as err:  # (the interpreter's "can't start new thread": EAGAIN from pthread_create)
            raise ThreadStartFailed(err) from err
        self._started += 1
        self._threads.append(thread)

    def _run(self) -> None:
        while True:
            try:
                item = self._work.get(timeout=self._idle_s)
            except queue.Empty:
                if self._retired():
                    return
                continue
            if item is _STOP:
                return
            try:
                if item[0] is None:
                    _run_call(*item[1:])
                else:
                    _run_submitted(*item)
            except BaseException:  # (a call's ``done`` that raised: this thread still serves the pool)
                log.exception("a %s thread's call raised past its handler", self._prefix)
            del item  # the call's arguments and result are not kept alive while this thread idles
            with self._lock:
                if self._owed:
                    self._owed -= 1  # (this thread takes the call queued for a busy one next)
                else:
                    self._idle += 1

    def _retired(self) -> bool:
        """Whether this thread, idle for ``idle_s``, ends now: it takes back an idle thread's count, unless every
        one was taken by calls queued meanwhile (one of them is for this thread), or the pool is shutting down
        (the stop queued for each thread is this one's to take)."""
        with self._lock:
            if self._shut_down or not self._idle:
                return False
            self._idle -= 1
            self._threads.remove(threading.current_thread())
            return True

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Refuse new calls; with ``cancel_futures`` drop the queued ones; with ``wait`` join the threads."""
        with self._lock:
            self._shut_down = True
            if cancel_futures:
                while True:
                    try:
                        item = self._work.get_nowait()
                    except queue.Empty:
                        break
                    if item is _STOP:
                        continue
                    if item[0] is None:
                        item[3](None, CancelledError())
                    else:
                        item[0].cancel()
            for _ in self._threads:
                self._work.put(_STOP)
        if wait:
            for thread in self._threads:
                thread.join()


def _run_call(fn: Callable[[Any], Any], argument: Any, done: Callable[[Any, BaseException | None], None]) -> None:
    try:
        result = fn(argument)
    except BaseException as error:  # handed on, whatever it is
        done(None, error)
        del error  # no cycle through this frame's traceback
    else:
        done(result, None)


def _run_submitted(future: Future, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn(*args, **kwargs)
    except BaseException as error:  # handed to the future, whatever it is
        future.set_exception(error)
        del error  # no cycle through this frame's traceback
    else:
        future.set_result(result)
    finally:
        # Nor through the future, which keeps the error (it held the failed call's frames, a plain-def
        # orchestration's locals, until a garbage collection).
        del future


# The server's own work off the event loop that may wait on the network: a bucket's listing, a store's answer.
_IO_THREADS = 16
_io_pool: DaemonThreadPool | None = None
_pools_lock = threading.Lock()  # (the I/O pool's and the work pool's: made once, released together)


async def _awaited_on(pool: DaemonThreadPool, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` awaited on a thread of ``pool``, in this task's context, as ``asyncio.to_thread``
    runs it."""
    context = contextvars.copy_context()
    return await asyncio.get_running_loop().run_in_executor(
        pool, functools.partial(context.run, fn, *args, **kwargs))


def io_pool() -> DaemonThreadPool:
    """The process's pool for the server's own work that may wait on the network (see :func:`on_io_thread`)."""
    global _io_pool
    with _pools_lock:
        if _io_pool is None:
            _io_pool = DaemonThreadPool(_IO_THREADS, thread_name_prefix="nereid-io")
        return _io_pool


async def on_io_thread(fn: Callable[..., T], /, *args: Any) -> T:
    """``fn(*args)`` awaited on a daemon thread of the process's I/O pool, in this task's context, as
    ``asyncio.to_thread`` runs it.

    Not asyncio's default executor, whose threads the interpreter joins at
    exit: a listing stuck on a store that did not answer held a stopped
    server's exit for up to the store client's 30 s timeout, after "nereid
    stopped" (found by a bug hunt).
    """
    return await _awaited_on(io_pool(), fn, *args)


# The server's own CPU work off the event loop: large decodes, encodes and their compression, classification,
# folder stamps, reads of nereid.yaml. Not asyncio's default executor either: that one is model code's
# (asyncio.to_thread in a meta model's orchestration), whose blocking calls could take every thread of it, and
# every other model's large requests, and loads, then waited behind them (the pipelines hunt).
_WORK_THREADS = min(32, (os.cpu_count() or 1) + 4)  # (as many as asyncio's default executor has)
_work_pool: DaemonThreadPool | None = None


def work_pool() -> DaemonThreadPool:
    """The process's pool for the server's own CPU work off the event loop (see :func:`on_work_thread`)."""
    global _work_pool
    with _pools_lock:
        if _work_pool is None:
            _work_pool = DaemonThreadPool(_WORK_THREADS, thread_name_prefix="nereid-work")
        return _work_pool


async def on_work_thread(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` awaited on a thread of :func:`work_pool`, in this task's context, as
    ``asyncio.to_thread`` runs it: the server's own work never waits for model code's threads."""
    return await _awaited_on(work_pool(), fn, *args, **kwargs)


async def on_work_thread_or_here(fn: Callable[..., T], /, *args: Any) -> T:
    """:func:`on_work_thread`, or ``fn(*args)`` here, on the loop, when no thread can be started now: for work
    whose refusal would be wrong (a request whose model has run already; the review hunt)."""
    try:
        return await on_work_thread(fn, *args)
    except ThreadStartFailed:
        return fn(*args)


def release_server_pools(wait_s: float = 0.1) -> None:
    """End the idle threads of the I/O and work pools (waiting up to ``wait_s`` in all); a busy one is left to the
    process's end. The next :func:`on_io_thread` or :func:`on_work_thread` starts a new pool.

    At a stop's end: an idle thread of them still alive passed for one the server abandoned (a call past the
    grace), and the process then ended at once, skipping what an embedder runs after ``nereid serve``."""
    global _io_pool, _work_pool
    with _pools_lock:
        pools = [pool for pool in (_io_pool, _work_pool) if pool is not None]
        _io_pool = _work_pool = None
    for pool in pools:
        pool.shutdown(wait=False)
    deadline = time.monotonic() + wait_s
    for pool in pools:
        for thread in list(pool._threads):
            thread.join(max(0.0, deadline - time.monotonic()))
