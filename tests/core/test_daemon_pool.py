"""The daemon thread pool: the Executor API, the lean call() form, reuse, shutdown."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from nereid.daemon_pool import DaemonThreadPool


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
