"""The process runner on its own: exit noticed at once, timeouts kill the group, nothing leaks."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from nereid.backends.subprocess import runner
from nereid.backends.subprocess.runner import ProcessGroups, run_model_process

from support import process_alive, zombie_children

PYTHON = [sys.executable, "-S", "-c"]


def run(tmp_path: Path, code: str, stdin: bytes = b"", timeout_s: float | None = 30, **kwargs):
    return run_model_process([*PYTHON, code], cwd=tmp_path, env={}, stdin=stdin, timeout_s=timeout_s,
                             **kwargs)


def test_exit_code_signal_and_output_tail(tmp_path):
    result = run(tmp_path, "import sys; sys.stderr.write('x' * 5000 + 'the end'); sys.exit(3)")
    assert (result.returncode, result.timed_out) == (3, False)
    assert result.describe() == "exited with code 3"
    assert result.output_tail.endswith("the end") and len(result.output_tail) <= 2000
    killed = run(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert killed.describe() == "was killed by signal SIGSEGV"


def test_large_stdin_is_delivered_whole(tmp_path):
    payload = os.urandom(3 << 20)  # many times a pipe's capacity
    code = ("import sys, hashlib; data = sys.stdin.buffer.read(); "
            "sys.stdout.write(hashlib.sha256(data).hexdigest())")
    result = run(tmp_path, code, stdin=payload)
    import hashlib
    assert result.returncode == 0 and result.output_tail == hashlib.sha256(payload).hexdigest()


def test_stdin_given_as_several_buffers_is_delivered_as_their_join(tmp_path):
    """A multi-tensor model's frames go to its stdin as buffers written one after the other (each header, then a
    view of its tensor's data), never joined into one copy: the program reads exactly what the join would hold,
    whatever the pipe takes at each write (the 1 MiB part is many times its capacity)."""
    big = np.arange(1 << 18, dtype=np.float32).reshape(512, 512)  # a non-byte, 2-D view: written as its bytes
    parts = [b"float32 512,512\n", memoryview(big), b"", b"int32 3\n", memoryview(bytes(range(12)))]
    code = ("import sys, hashlib; data = sys.stdin.buffer.read(); "
            "sys.stdout.write(hashlib.sha256(data).hexdigest())")
    result = run(tmp_path, code, stdin=parts)
    assert result.returncode == 0
    assert result.output_tail == hashlib.sha256(b"".join(bytes(part) for part in parts)).hexdigest()
    # A program that reads nothing ends the writing, as with one buffer.
    assert run(tmp_path, "import sys; sys.exit(0)", stdin=[b"x", memoryview(big)]).returncode == 0


def test_output_is_kept_only_as_a_bounded_tail(tmp_path):
    """A chatty model's output is never spooled whole: only the tail that errors report is kept."""
    code = "import sys\nfor i in range(20000): sys.stdout.write('line %06d ' % i * 10 + '\\n')\nsys.exit(1)"
    result = run(tmp_path, code)
    assert result.returncode == 1 and len(result.output_tail.encode()) <= 2000
    assert result.output_tail.endswith("line 019999")


# 'é€😀' is 2 + 3 + 4 UTF-8 bytes: with these pads the tail's first kept byte falls inside each of the three
# characters, after each of its bytes.
@pytest.mark.parametrize("pad", [3, 5, 6, 8, 0, 1])
def test_a_tail_alone_is_kept_whole_characters(tmp_path, pad):
    """Defect: a model's output tail cut inside a character ("é" * 3000 on stderr, then exit 9) started with a
    U+FFFD in its INTERNAL message and the server's ERROR log line."""
    text = "é€😀" * 1000 + "e" * pad
    result = run(tmp_path, f"import sys; sys.stderr.buffer.write({text!r}.encode()); sys.exit(9)")
    assert result.returncode == 9
    assert "\ufffd" not in result.output_tail, result.output_tail[:10]
    assert text.endswith(result.output_tail)
    assert runner.STDERR_TAIL_BYTES - 3 <= len(result.output_tail.encode()) < runner.STDERR_TAIL_BYTES


@pytest.mark.parametrize("pad", range(4))
def test_a_head_and_a_tail_are_kept_whole_characters_with_what_was_left_out_said(tmp_path, pad):
    """gcc quotes with ‘’ (3 bytes each in UTF-8): a cut inside one showed a stray U+FFFD. A head of whitespace
    only still says what was left out."""
    code = (f"import sys; out = sys.stdout.buffer; out.write(b'x' * {95 + pad} + '‘first’'.encode())\n"
            "out.write(b'y' * 5000); out.write('‘last’ end'.encode())")
    result = run(tmp_path, code, head_bytes=100, tail_bytes=12)
    head, marker, tail = result.output_tail.split("\n")
    assert "\ufffd" not in result.output_tail, result.output_tail
    assert head.startswith("x" * 95) and tail.endswith("end")
    left_out = int(marker.removeprefix("... (").removesuffix(" bytes left out) ..."))
    assert left_out + len(head.encode()) + len(tail.encode()) <= 95 + pad + 11 + 5000 + 14  # (UTF-8 bytes)
    assert left_out >= 5000
    blank = run(tmp_path, "import sys; sys.stdout.write(' ' * 200 + 'y' * 5000 + 'end')", head_bytes=100,
                tail_bytes=10)
    assert blank.output_tail.startswith("\n... (") and blank.output_tail.endswith("end")


def test_child_that_ignores_stdin_does_not_hang_the_writer(tmp_path):
    started = time.monotonic()
    result = run(tmp_path, "import sys; sys.exit(0)", stdin=b"\0" * (8 << 20))
    assert result.returncode == 0 and time.monotonic() - started < 10
    closes_stdin = run(tmp_path, "import os, time; os.close(0); time.sleep(0.2)", stdin=b"\0" * (8 << 20))
    assert closes_stdin.returncode == 0


def test_exit_is_noticed_without_polling_delay(tmp_path):
    """Popen.wait(timeout) notices an exit up to 50 ms late; here the wait ends with the child."""
    code = "import time; time.sleep(0.065)"
    for _ in range(3):  # best of three: the machine is shared
        started = time.perf_counter()
        run(tmp_path, code, timeout_s=60)
        served = time.perf_counter() - started
        started = time.perf_counter()
        run(tmp_path, code, timeout_s=None)
        unbounded = time.perf_counter() - started
        if served < unbounded + 0.02:
            break
    assert served < unbounded + 0.02, (served, unbounded)


def test_timeout_kills_the_whole_group(tmp_path):
    code = ("import subprocess, sys, time; "
            "p = subprocess.Popen(['sleep', '300']); print(p.pid, flush=True); time.sleep(300)")
    started = time.monotonic()
    result = run(tmp_path, code, timeout_s=1)
    assert result.timed_out and result.returncode == -9
    assert time.monotonic() - started < 10
    grandchild = int(result.output_tail.split()[0])
    deadline = time.monotonic() + 5
    while process_alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not process_alive(grandchild)


def test_kill_all_ends_running_groups(tmp_path):
    groups = ProcessGroups()
    results = []
    thread = threading.Thread(target=lambda: results.append(
        run(tmp_path, "import time; time.sleep(300)", timeout_s=None, groups=groups)))
    thread.start()
    deadline = time.monotonic() + 10
    while not groups.kill_all() and time.monotonic() < deadline:
        time.sleep(0.01)
    thread.join(10)
    assert not thread.is_alive() and results[0].returncode == -9
    assert results[0].terminated  # killed by kill_all: no crash of the model's own


def test_a_run_killed_by_a_signal_kill_all_did_not_send_is_not_terminated(tmp_path):
    groups = ProcessGroups()
    result = run(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)", groups=groups)
    assert (result.returncode, result.terminated) == (-9, False)
    assert groups.kill_all() == 0  # and nothing is left listed


def test_hundreds_of_children_leave_no_zombie_and_no_thread(tmp_path):
    # The threads alive before, not their count: a thread an earlier test left ending may go meanwhile.
    threads_before = set(threading.enumerate())
    fds_before = len(os.listdir("/proc/self/fd"))
    for _ in range(300):
        result = run_model_process(["/bin/true"], cwd=tmp_path, env={}, stdin=b"abc", timeout_s=30)
        assert result.returncode == 0
    assert zombie_children() == []
    assert set(threading.enumerate()) - threads_before == set()
    assert len(os.listdir("/proc/self/fd")) == fds_before


@pytest.mark.parametrize("timeout_s", [None, 30])
def test_both_wait_modes_agree(tmp_path, timeout_s):
    result = run(tmp_path, "import sys; sys.stdout.write(sys.stdin.read()[::-1])", stdin=b"abc",
                 timeout_s=timeout_s)
    assert (result.returncode, result.output_tail, result.timed_out) == (0, "cba", False)


@pytest.mark.parametrize("timeout_s", [2_160_000, 1e300, sys.float_info.max])
def test_any_finite_timeout_lets_the_run_finish(tmp_path, timeout_s):
    """poll() takes a C int of milliseconds: past 24.8 days every run failed with OverflowError."""
    result = run(tmp_path, "import sys; sys.stdout.write(sys.stdin.read())", stdin=b"abc", timeout_s=timeout_s)
    assert (result.returncode, result.output_tail, result.timed_out) == (0, "abc", False)


def test_a_wait_longer_than_one_poll_is_polled_in_slices_until_the_real_deadline(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "MAX_POLL_MS", 20)  # as if 20 ms were all that poll could take
    slept = run(tmp_path, "import time; time.sleep(0.2)", timeout_s=30)
    assert (slept.returncode, slept.timed_out) == (0, False)  # an empty poll is not the deadline
    started = time.monotonic()
    hung = run(tmp_path, "import time; time.sleep(300)", timeout_s=0.3)
    assert hung.timed_out and 0.3 <= time.monotonic() - started < 10


def test_wait_for_exit_takes_any_finite_timeout(tmp_path):
    process = subprocess.Popen([*PYTHON, "pass"])
    assert runner.wait_for_exit(process, 1e300) and process.returncode == 0


# Runs under an open-file limit of 64 (see starved_descriptors); prints what each did.
RUN_OUT_OF_DESCRIPTORS = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
from starved_descriptors import runs_short_of_descriptors
from nereid.backends.subprocess.runner import run_model_process

run = lambda: run_model_process(["/bin/true"], cwd="/", env={}, stdin=b"x", timeout_s=30).returncode
print(json.dumps(runs_short_of_descriptors(run, 8)))
'''


def test_a_run_that_cannot_get_its_descriptors_closes_those_it_had_opened():
    # A real limit, in a process of its own: a run failing at its second pipe (EMFILE) leaked the first, so a
    # server at its limit lost more descriptors with every request and never got them back.
    result = subprocess.run([sys.executable, "-c", RUN_OUT_OF_DESCRIPTORS, str(Path(__file__).parents[2])],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    outcomes = json.loads(result.stdout)
    assert [leaked for _, _, leaked in outcomes] == [0] * len(outcomes), f"descriptors left open: {outcomes}"
    # Out of descriptors at the first pipe, at the second, at Popen's own; then enough for a whole run.
    failed = {free: outcome for free, outcome, _ in outcomes if outcome != 0}
    assert set(failed.values()) == {"EMFILE"} and {0, 2, 4} <= failed.keys(), outcomes
    assert outcomes[-1][1] == 0, outcomes


def test_a_run_whose_pidfd_cannot_be_opened_ends_and_reaps_its_child(tmp_path, monkeypatch):
    # pidfd_open comes after Popen: failing (EMFILE from another thread's descriptors, ENOMEM), it left the
    # child running unreaped and the run's two pipe ends open.
    children: list[int] = []

    def no_pidfd(pid: int) -> int:
        children.append(pid)
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    fds_before = sorted(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(runner.os, "pidfd_open", no_pidfd)
    with pytest.raises(OSError) as failed:
        run(tmp_path, "import time; time.sleep(30)", stdin=b"abc")
    monkeypatch.undo()
    assert failed.value.errno == errno.EMFILE
    assert len(children) == 1 and not process_alive(children[0])
    assert zombie_children() == []
    assert sorted(os.listdir("/proc/self/fd")) == fds_before


def test_waiting_for_an_exit_without_a_pidfd_still_reaps_the_child(monkeypatch):
    # wait_for_exit opened a pidfd of its own: out of descriptors, a warm parent being stopped raised EMFILE
    # instead of being waited for, and was left unreaped.
    import subprocess
    import sys

    def no_pidfd(pid: int) -> int:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    quick = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)"])
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    monkeypatch.setattr(runner.os, "pidfd_open", no_pidfd)
    try:
        assert runner.wait_for_exit(quick, 10) and quick.returncode == 0
        assert not runner.wait_for_exit(slow, 0.1)  # still running: False, as on timeout
    finally:
        monkeypatch.undo()
        slow.kill()
        slow.wait()


def test_closing_descriptors_closes_the_rest_after_one_that_fails():
    # The cleanup of a run that could not get its descriptors stopped at the first close that failed, leaving
    # the others open.
    read_end, write_end = os.pipe()
    with pytest.raises(OSError) as failed:
        runner.close_descriptors(write_end, write_end, read_end)  # the second close of write_end fails (EBADF)
    assert failed.value.errno == errno.EBADF
    with pytest.raises(OSError) as closed:  # (listing /proc/self/fd would open a descriptor of that number)
        os.fstat(read_end)
    assert closed.value.errno == errno.EBADF


def test_a_timed_out_run_names_the_configuration_file_that_sets_timeout_s():
    """`nereid serve --config prod.yaml`: the client was sent to the model's timeout_s "in nereid.yaml"."""
    assert str(runner.timed_out("m", 1, "its process group was killed", "prod.yaml")) == (
        "model 'm' timed out after 1 s (the model's timeout_s in prod.yaml, default 60 s); its process group was "
        "killed")
