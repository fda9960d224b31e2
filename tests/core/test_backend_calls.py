"""Calls into a backend on daemon threads: bounded, their exits contained, late results handed back."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from nereid.backend_calls import await_build, bounded_backend_call, on_daemon_thread


def test_a_backend_call_that_exits_raises_its_failure_and_never_ends_the_process() -> None:
    """sys.exit() (or KeyboardInterrupt) in a backend's unload or terminate_running is its failure."""

    def exits() -> None:
        raise SystemExit(3)

    def interrupts() -> None:
        raise KeyboardInterrupt

    async def scenario() -> None:
        assert await bounded_backend_call("m", "unload", lambda: None) is True
        with pytest.raises(RuntimeError, match="^SystemExit: 3$"):
            await bounded_backend_call("m", "unload", exits)
        with pytest.raises(RuntimeError, match="^KeyboardInterrupt$"):
            await bounded_backend_call("m", "terminate_running", interrupts)
    asyncio.run(scenario())


def test_a_result_its_caller_no_longer_waits_for_goes_to_unclaimed_on_its_thread() -> None:
    """A load abandoned by its caller (a cancelled RepositoryModelLoad) still finishes: what it built must be
    handed to ``unclaimed`` (which unloads it), not dropped with its resources held."""
    release = threading.Event()
    unclaimed: list[tuple[str, str]] = []
    handed = threading.Event()

    def hand_back(result: str) -> None:
        unclaimed.append((result, threading.current_thread().name))
        handed.set()

    async def scenario() -> None:
        future = on_daemon_thread(lambda: release.wait(5) and "built", "nereid-load-m", hand_back)
        await asyncio.sleep(0.05)
        future.cancel()
        release.set()
        assert await asyncio.to_thread(handed.wait, 5)
        assert await on_daemon_thread(lambda: "taken", "nereid-load-n", hand_back) == "taken"
    asyncio.run(scenario())
    assert unclaimed == [("built", "nereid-load-m")]


def test_a_result_whose_future_is_cancelled_while_it_is_being_delivered_still_goes_to_unclaimed() -> None:
    """Defect: a future cancelled after the call had returned and its thread had seen it not cancelled (an unload
    giving up on a load that had just finished) dropped the result: the model it built was never unloaded."""
    unclaimed: list[str] = []
    handed = threading.Event()

    def hand_back(result: str) -> None:
        unclaimed.append(result)
        handed.set()

    async def scenario() -> None:
        future = on_daemon_thread(lambda: "built", "nereid-load-racing", hand_back)
        # Without yielding to the loop: the call returns and its thread schedules the delivery meanwhile.
        deadline = time.monotonic() + 5
        while any(t.name == "nereid-load-racing" for t in threading.enumerate()):
            assert time.monotonic() < deadline
            time.sleep(0.001)
        future.cancel()  # before the delivery has run
        assert await asyncio.to_thread(handed.wait, 5)
    asyncio.run(scenario())
    assert unclaimed == ["built"]


def test_a_build_done_as_its_load_is_cancelled_is_unloaded_not_leaked():
    """A fuzzing review: the stop cancelled a load whose build had just delivered its model, before the load
    resumed; cancelling the finished build did nothing, and what its load() acquired leaked."""
    import types

    unloaded = threading.Event()
    built = types.SimpleNamespace(backend=types.SimpleNamespace(unload=unloaded.set))

    async def scenario() -> None:
        building = asyncio.get_running_loop().create_future()
        load = asyncio.create_task(await_build("m", building, 0.0))
        await asyncio.sleep(0)  # waiting for the build
        building.set_result(built)  # delivered ...
        load.cancel()  # ... and the load cancelled before it resumed
        with pytest.raises(asyncio.CancelledError):
            await load
    asyncio.run(scenario())
    assert unloaded.wait(5)


# A call on a daemon thread where no thread can start: an address-space limit just above what the process maps.
CALLS_WITHOUT_ROOM_FOR_A_THREAD = """
import asyncio, resource
from nereid.backend_calls import on_daemon_thread
from nereid.daemon_pool import ThreadStartFailed

async def main():
    size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (size + (4 << 20), resource.RLIM_INFINITY))
    try:
        print(await on_daemon_thread(lambda: "ran", "nereid-load-m"))
    except ThreadStartFailed as failed:
        print(failed)

asyncio.run(main())
"""


def test_a_call_no_thread_can_start_for_names_the_limits_that_cause_it() -> None:
    """The deploy hunt: under ulimit -v a model's load (run on a daemon thread of its own) failed with a bare
    "RuntimeError: can't start new thread", and the server's own watcher threads ended `nereid serve` at its start
    with that traceback."""
    import re
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", CALLS_WITHOUT_ROOM_FOR_A_THREAD], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.fullmatch(r"RuntimeError: can't start new thread: a process or thread limit, such as ulimit -u or a "
                        r"container's pids limit, is reached, or the address-space limit \(ulimit -v, \d+ MiB\) "
                        r"leaves no room for another thread's stack\n", done.stdout), done.stdout
