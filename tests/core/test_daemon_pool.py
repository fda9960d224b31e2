"""The daemon thread pool: the Executor API, the lean call() form, reuse, shutdown, a thread that cannot start."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import threading
import time

import pytest

from nereid.daemon_pool import (DaemonThreadPool, ThreadStartFailed, make_room_for_threads, on_io_thread,
                                release_server_pools)
from support import fail_thread_starts


def wait_running(futures, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(f.running() for f in futures):
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_the_daemon_pool_runs_calls_reuses_threads_and_cancels_queued_ones() -> None:
    pool = DaemonThreadPool(2, thread_name_prefix="t")
    assert [pool.submit(pow, 2, n).result(5) for n in range(5)] == [1, 2, 4, 8, 16]
    assert pool.submit(threading.current_thread).result(5).name.startswith("t_")
    assert sum(t.name.startswith("t_") for t in threading.enumerate()) == 1  # one idle thread, reused
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result(5)
    gate = threading.Event()
    blocked = [pool.submit(gate.wait, 5) for _ in range(2)]
    wait_running(blocked)
    queued = pool.submit(pow, 3, 2)  # both threads are busy: this one waits in the queue
    pool.shutdown(wait=False, cancel_futures=True)
    assert queued.cancelled()
    gate.set()
    assert all(f.result(5) for f in blocked)
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(pow, 1, 1)


def test_call_hands_the_result_or_the_error_to_its_callback_on_the_worker_thread() -> None:
    pool = DaemonThreadPool(1, thread_name_prefix="c")
    outcomes: list[tuple] = []
    finished = threading.Event()

    def done(result, error) -> None:
        outcomes.append((result, type(error).__name__ if error else None, threading.current_thread().name))
        if len(outcomes) == 2:
            finished.set()

    pool.call(lambda n: n * 2, 21, done)
    pool.call(lambda n: 1 / n, 0, done)
    assert finished.wait(5)
    assert outcomes == [(42, None, "c_0"), (None, "ZeroDivisionError", "c_0")]
    pool.shutdown()


def test_a_call_dropped_by_shutdown_is_told_so() -> None:
    pool = DaemonThreadPool(1, thread_name_prefix="d")
    gate = threading.Event()
    blocked = pool.submit(gate.wait, 5)
    wait_running([blocked])
    dropped: list = []
    pool.call(lambda n: n, 1, lambda result, error: dropped.append(error))
    pool.shutdown(wait=False, cancel_futures=True)
    assert len(dropped) == 1 and isinstance(dropped[0], concurrent.futures.CancelledError)
    gate.set()
    assert blocked.result(5)


LIMIT_REACHED = ("RuntimeError: can't start new thread: a process or thread limit, such as ulimit -u or a "
                 "container's pids limit, is reached")


def test_a_call_whose_thread_cannot_start_is_refused_and_never_runs(monkeypatch) -> None:
    """Found by the resource-limits hunt: a call whose worker thread could not start (RLIMIT_NPROC) was reported
    failed to its caller, yet stayed queued and ran on the next thread to start, ahead of the next call."""
    refused = fail_thread_starts(monkeypatch, "limit")
    pool = DaemonThreadPool(1, thread_name_prefix="limit")
    ran: list[str] = []
    told: list = []
    with pytest.raises(ThreadStartFailed) as info:
        pool.call(ran.append, "A", lambda result, error: told.append(error))
    assert str(info.value) == LIMIT_REACHED and isinstance(info.value, RuntimeError)  # (what callers caught)
    assert refused == ["limit_0"]
    finished = threading.Event()
    pool.call(ran.append, "B", lambda result, error: finished.set())
    assert finished.wait(5)
    assert pool.submit(ran.append, "C").result(5) is None
    assert ran == ["B", "C"] and told == []  # A never ran, and its callback was never called
    assert [thread.name for thread in pool._threads] == ["limit_0"]
    pool.shutdown()


def test_a_call_whose_thread_cannot_start_does_not_wait_behind_the_busy_ones(monkeypatch) -> None:
    """Nor is it queued for the threads already busy (one may never return): the pool's next call gets the thread
    it lacked, and runs beside the busy one at once."""
    pool = DaemonThreadPool(2, thread_name_prefix="busy")
    gate = threading.Event()
    blocked = pool.submit(gate.wait, 30)
    wait_running([blocked])
    fail_thread_starts(monkeypatch, "busy")
    ran: list[str] = []
    with pytest.raises(ThreadStartFailed):
        pool.submit(ran.append, "refused")
    assert pool.submit(ran.append, "next").result(10) is None  # (queued behind the gate, it would wait 30 s)
    assert not blocked.done()
    gate.set()
    assert blocked.result(5)
    pool.shutdown()
    assert ran == ["next"]


def test_the_io_pool_runs_calls_as_to_thread_does_on_daemon_threads_and_lets_a_stuck_one_go() -> None:
    """A listing stuck on a store that does not answer must not hold the process's exit (asyncio's default executor
    is joined at exit): its threads are daemon ones, and the pool's release waits for none past a moment."""
    request = contextvars.ContextVar("request", default="none")
    stuck = threading.Event()

    def where() -> tuple[str, str, bool]:
        thread = threading.current_thread()
        return request.get(), thread.name, thread.daemon

    async def scenario() -> None:
        request.set("r1")
        context, name, daemon = await on_io_thread(where)
        assert context == "r1" and name.startswith("nereid-io_") and daemon  # in the caller's context
        with pytest.raises(ZeroDivisionError):
            await on_io_thread(lambda: 1 / 0)
        asyncio.get_running_loop().run_in_executor(None, lambda: None)  # (the default executor is left alone)
        waiting = asyncio.ensure_future(on_io_thread(stuck.wait, 10))
        await asyncio.sleep(0.05)
        waiting.cancel()  # its thread runs on, as to_thread's does
    try:
        asyncio.run(scenario())
        started = time.monotonic()
        release_server_pools(wait_s=0.2)
        assert time.monotonic() - started < 1  # the stuck call is not waited for
        assert any(t.name.startswith("nereid-io") and t.daemon for t in threading.enumerate())
    finally:
        stuck.set()
    # A later call gets a pool of its own.
    assert asyncio.run(on_io_thread(lambda: 42)) == 42
    release_server_pools()



def test_a_thread_idle_past_its_time_ends_and_a_later_call_starts_another() -> None:
    """Found by the scale hunt: each model's pool kept its threads for good, so a server of hundreds of models,
    each called once, held a thread per model until a container's pids limit left later calls none to start."""
    pool = DaemonThreadPool(2, thread_name_prefix="idle-test", idle_s=0.05)
    try:
        assert pool.submit(threading.current_thread).result(5).name == "idle-test_0"
        deadline = time.monotonic() + 10
        while pool._threads and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool._threads == []
        assert not [t for t in threading.enumerate() if t.name == "idle-test_0"]
        # Calls queued while threads end are all run: none is left for a thread that is gone.
        results = [pool.submit(time.sleep, 0.001) for _ in range(50)]
        for _ in range(20):
            results.append(pool.submit(threading.current_thread))
            time.sleep(0.01)
        assert all(future.result(10) is None or isinstance(future.result(10), threading.Thread) for future in results)
        assert len(pool._threads) <= 2
    finally:
        pool.shutdown(wait=True)


def test_calls_queued_behind_busy_threads_leave_no_idle_thread_counted_that_has_ended() -> None:
    """Found by the hunt of this session's changes: a call queued while every thread was busy was counted as an
    idle thread by the busy one that took it, so once idle threads ended, the pool counted threads it no longer had
    and the next calls waited for them for ever (a hook pool after a burst and a minute of quiet)."""
    pool = DaemonThreadPool(1, thread_name_prefix="owed-test", idle_s=0.05)
    try:
        gate = threading.Event()
        first = pool.submit(gate.wait, 5)
        second = pool.submit(pow, 2, 3)  # queued behind the busy thread
        gate.set()
        assert first.result(5) is True and second.result(5) == 8
        deadline = time.monotonic() + 10
        while pool._threads and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool._threads == []
        assert [pool.submit(pow, 3, n).result(5) for n in range(3)] == [1, 3, 9]  # (each hung before)
        # Bursts past the threads, with quiet between: every call runs, once.
        ran = []
        for _ in range(10):
            futures = [pool.submit(ran.append, n) for n in range(4)]
            assert [f.result(5) for f in futures] == [None] * 4
            time.sleep(0.06)
        assert len(ran) == 40
    finally:
        pool.shutdown(wait=True)


def test_a_done_callback_that_raises_leaves_its_thread_serving_the_pool(caplog) -> None:
    """Found by the hunt of the last fixes: the raise ended the worker thread, which the pool still counted, so
    with every thread lost so, later calls waited for ever."""
    pool = DaemonThreadPool(1, thread_name_prefix="done-raises")
    try:
        def failing_done(result, error):
            raise RuntimeError("done failed")

        pool.call(abs, -1, failing_done)
        assert pool.submit(pow, 2, 5).result(5) == 32
        assert "a done-raises thread's call raised past its handler" in caplog.text
    finally:
        pool.shutdown(wait=True)


def test_work_that_must_not_be_refused_runs_on_the_loop_when_no_thread_can_start(monkeypatch) -> None:
    """The review hunt: a check of outputs whose model had run already, a comparison, a classification and the
    repository follower's look were refused at a thread limit (UNAVAILABLE, or the follower stopping for good);
    they run here instead."""
    import nereid.daemon_pool as daemon_pool

    class NoThreads:
        def submit(self, *args, **kwargs):
            raise ThreadStartFailed(RuntimeError("can't start new thread"))

    monkeypatch.setattr(daemon_pool, "work_pool", NoThreads)

    async def scenario() -> None:
        assert await daemon_pool.on_work_thread_or_here(lambda a, b: a + b, 2, 3) == 5
        with pytest.raises(ThreadStartFailed):
            await daemon_pool.on_work_thread(lambda: 1)
    asyncio.run(scenario())


def test_room_for_threads_is_asked_by_starting_them_and_none_is_left_running(monkeypatch) -> None:
    """Asked before native code that aborts the process when it cannot start its threads (the exhaustion hunt:
    a bundle's load at a pids limit killed the server)."""
    def room_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "nereid-thread-room"]

    make_room_for_threads(8)
    assert room_threads() == []
    refused = fail_thread_starts(monkeypatch, "nereid-thread-room", times=1)
    with pytest.raises(ThreadStartFailed, match=r"^RuntimeError: can't start new thread: a process or thread limit"):
        make_room_for_threads(8)
    assert refused == ["nereid-thread-room"] and room_threads() == []


def test_a_thread_that_cannot_start_under_an_address_space_limit_names_that_limit_too() -> None:
    """Defect (the deploy hunt): under ``ulimit -v`` a thread's start fails for want of room for its stack, and the
    refusal named only process and thread limits."""
    import subprocess
    import sys

    script = ("import resource\nresource.setrlimit(resource.RLIMIT_AS, (1 << 30, resource.RLIM_INFINITY))\n"
              "from nereid.daemon_pool import ThreadStartFailed, make_room_for_threads\n"
              "try:\n    make_room_for_threads(4096)\nexcept ThreadStartFailed as failed:\n    print(failed)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("a process or thread limit, such as ulimit -u or a container's pids limit, "
                                        "is reached, or the address-space limit (ulimit -v, 1024 MiB) leaves no "
                                        "room for another thread's stack"), done.stdout
