"""How a nereid process stops (``nereid.processes``): the signals it takes as a stop, stops recorded while it starts,
and the children it ends.

What changes the process for good (a death, the children killed, new children stopped) runs in a child Python
process of its own; the rest runs here, on the main thread, where handlers can be set.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from nereid.processes import not_ignored, record_early_stops, release_early_stops, stop_signals


def run_python(source: str) -> subprocess.CompletedProcess:
    """``source`` run by this interpreter in a process of its own (nereid importable), its output captured."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(source)], capture_output=True, text=True,
                          timeout=60)


@pytest.fixture
def handlers():
    """Puts back, after the test, the handlers of the signals these tests set."""
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)}
    yield
    release_early_stops()  # (a test that failed while recording)
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_a_stop_signal_ignored_by_whoever_started_the_process_stays_ignored(handlers) -> None:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    assert stop_signals() == [signal.SIGTERM, signal.SIGINT, signal.SIGHUP]
    assert not_ignored(signal.SIGUSR1, signal.SIGHUP) == [signal.SIGUSR1, signal.SIGHUP]
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup nereid serve
    assert stop_signals() == [signal.SIGTERM, signal.SIGINT]
    assert not_ignored(signal.SIGUSR1, signal.SIGHUP) == [signal.SIGUSR1]


def test_a_stop_while_starting_is_recorded_and_handed_over_with_the_handlers_it_replaced(handlers) -> None:
    def own(signum: int, frame: object) -> None:
        raise AssertionError("the handler that was replaced ran")

    signal.signal(signal.SIGUSR1, own)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # (an ignored one is not recorded: it stays ignored)
    assert release_early_stops() is None  # nothing is recording
    record_early_stops([signal.SIGUSR1, signal.SIGUSR2])
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_IGN and signal.getsignal(signal.SIGUSR1) is not own
    # (At this very thread: Python runs the handler before the next line, where another thread's delivery
    # would leave it to the main thread's next check.)
    signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)
    signal.pthread_kill(threading.get_ident(), signal.SIGUSR2)
    assert release_early_stops() is signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) is own and signal.getsignal(signal.SIGUSR2) is signal.SIG_IGN
    assert release_early_stops() is None  # handed over once
    record_early_stops([signal.SIGUSR1])
    assert release_early_stops() is None  # a start that no stop came during


def test_a_recorded_stop_ends_the_process_as_its_signal_would_once_handed_back() -> None:
    child = run_python("""
        import os, signal, sys
        from nereid.processes import record_early_stops, redeliver_early_stops
        record_early_stops([signal.SIGTERM, signal.SIGINT])
        os.kill(os.getpid(), signal.SIGTERM)
        print("imports done", end="", flush=False)  # (still buffered when the process dies: flushed first)
        redeliver_early_stops()
        print("still running")
        """)
    assert child.returncode == -signal.SIGTERM, child
    assert child.stdout == "imports done" and child.stderr == ""


def test_a_second_stop_while_starting_ends_the_process_at_once_saying_so() -> None:
    child = run_python("""
        import os, signal, time
        from nereid.processes import record_early_stops
        record_early_stops([signal.SIGTERM, signal.SIGINT])
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)  # (an import hung on a network share: the second stop is meant)
        time.sleep(30)
        print("still running")
        """)
    assert child.returncode == -signal.SIGTERM, child
    assert child.stderr == "nereid: SIGTERM again while starting: stopping now\n" and child.stdout == ""


def test_only_live_children_are_listed_and_each_is_killed_with_the_group_it_leads(tmp_path: Path) -> None:
    grandchild_pid = tmp_path / "grandchild.pid"
    child = run_python(f"""
        import os, subprocess, sys, time
        from nereid.processes import child_pids, kill_children
        plain = subprocess.Popen(["sleep", "60"])
        leader = subprocess.Popen(["sh", "-c", "sleep 60 & echo $! > {grandchild_pid}; wait"], start_new_session=True)
        zombie = subprocess.Popen(["true"])
        deadline = time.monotonic() + 20
        while not (os.path.exists("{grandchild_pid}") and open("{grandchild_pid}").read().strip()) or \\
                open(f"/proc/{{zombie.pid}}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the children did not start"
            time.sleep(0.01)
        print(sorted(child_pids()) == sorted([plain.pid, leader.pid]))  # (the zombie is no live child)
        print(kill_children())
        print(plain.wait(10), leader.wait(10), zombie.wait(10))
        print(child_pids())
        """)
    assert child.returncode == 0, child.stderr
    assert child.stdout.splitlines() == ["True", "2", "-9 -9 0", "[]"], child.stdout
    pid = int(grandchild_pid.read_text())
    deadline = time.monotonic() + 20
    while _alive(pid):  # killed with its group (reparented, it is reaped by whoever adopted it)
        assert time.monotonic() < deadline, f"the leader's own child {pid} outlived the kill"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a process that has not ended (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_once_the_server_has_stopped_no_work_starts_a_child() -> None:
    child = run_python("""
        from nereid.processes import new_children_stopped, stop_new_children
        print(new_children_stopped())
        stop_new_children()
        print(new_children_stopped())
        """)
    assert child.returncode == 0, child.stderr
    assert child.stdout.splitlines() == ["False", "True"]
