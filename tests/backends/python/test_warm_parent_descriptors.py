"""A real warm parent's descriptors: a run's child holds the pipes meant for it, and no other descriptor of the run.

The parent receives each run's descriptors from the server (SCM_RIGHTS), and
may fork a child while it holds them: the spare it forks when the one forked
ahead has died. That child must not keep copies of them (the run's reply
socket, a second write end of its output pipe), nor may they outlive an exec.
Its stdout pipe carries the start-up answer alone, whatever a preloaded module
prints, and a run's output is what its main.py wrote, as ``python main.py``
would write it. A run's child keeps its pid (unreaped) until the server has
closed the run's reply socket.
"""

from __future__ import annotations

import json
import re
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nereid.backends.python.warm import WARM_PARENT_SCRIPT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the warm parent needs Linux")

# main.py: reads its stdin to the end, then prints the descriptors open in its process.
LIST_DESCRIPTORS = """
import os, sys

def is_open(fd):
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True

sys.stdin.read()
print(" ".join(str(fd) for fd in range(256) if is_open(fd)))
"""

O_CLOEXEC_FLAG = 0o2000000  # in /proc/PID/fdinfo/FD's octal "flags"


class WarmParent:
    """warm_parent.py started as the server starts it, with no preloads, driven over its control socket."""

    def __init__(self, folder: Path, modules: tuple[str, ...] = (), env: dict[str, str] | None = None) -> None:
        """Started with ``modules`` to preload, and ``env`` (None: this process's environment)."""
        self.folder = folder
        self.control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with open(folder / "parent.log", "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-P", str(WARM_PARENT_SCRIPT), str(theirs.fileno()),
                 json.dumps({"imports": list(modules), "extra": []}), str(folder), str(folder / "main.py")],
                cwd=folder, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                pass_fds=(theirs.fileno(),), start_new_session=True)
        theirs.close()
        self.answer = self.process.stdout.readline()
        assert self.answer == b"ready\n", f"answer {self.answer!r}, log: {(folder / 'parent.log').read_text()!r}"

    def send_run(self, exec_argv: list[str] | None = None) -> tuple[socket.socket, int, int]:
        """Hand the parent a run as the server does; our ends: the reply socket, the stdin and output pipes.
        (Its first answer, the child's pid, is left to :meth:`started`.)"""
        stdin_read, stdin_write = os.pipe2(os.O_CLOEXEC)
        output_read, output_write = os.pipe2(os.O_CLOEXEC)
        reply, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        folder_fd = os.open(self.folder, os.O_PATH | os.O_CLOEXEC)
        request = {"env": {}, "cwd": str(self.folder), **({"exec": exec_argv} if exec_argv else {})}
        try:
            socket.send_fds(self.control, [json.dumps(request).encode()],
                            [stdin_read, output_write, theirs.fileno(), folder_fd])
        finally:
            for fd in (stdin_read, output_write, theirs.fileno(), folder_fd):
                os.close(fd)
            theirs.detach()
        reply.settimeout(30)
        return reply, stdin_write, output_read

    @staticmethod
    def started(reply: socket.socket) -> int:
        """The pid of the run's child, once the parent has forked it."""
        return json.loads(reply.recv(4096))["pid"]

    @staticmethod
    def finish(reply: socket.socket, stdin_write: int, output_read: int) -> list[int]:
        """End the run's input (once started); the descriptors its main.py listed (it must exit 0)."""
        status, text = WarmParent.outcome(reply, stdin_write, output_read)
        assert status == 0, f"the run's child ended with status {status}, output {text!r}"
        assert text.endswith("\n") and text.count("\n") == 1, f"main.py's one line expected, the output is {text!r}"
        return [int(fd) for fd in text.split()]

    @staticmethod
    def outcome(reply: socket.socket, stdin_write: int, output_read: int) -> tuple[int, str]:
        """End the run's input (once started); its exit status and its output (stdout and stderr)."""
        os.close(stdin_write)
        with os.fdopen(output_read, "rb") as output:
            text = output.read().decode()
        status = json.loads(reply.recv(4096))["status"]
        reply.close()
        return status, text

    def spare(self) -> int:
        """The pid of the child forked ahead (the parent's only child between runs)."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with open(f"/proc/{self.process.pid}/task/{self.process.pid}/children") as f:
                children = [int(pid) for pid in f.read().split()]
            if len(children) == 1:
                return children[0]
            time.sleep(0.01)
        raise AssertionError(f"the warm parent has children {children}, expected one spare")

    def stop(self) -> None:
        self.control.close()
        self.process.stdin.close()
        self.process.wait(10)
        self.process.stdout.close()


def _wait_for_state(pid: int, states: str) -> None:
    """Wait until ``pid``'s state (/proc/PID/stat) is one of ``states``; gone counts as "X" (dead)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):  # (ESRCH: reaped between the open and the read)
            state = "X"
        if state in states:
            return
        assert time.monotonic() < deadline, f"process {pid} is in state {state}, expected one of {states}"
        time.sleep(0.005)


@pytest.fixture
def parent(tmp_path):
    (tmp_path / "main.py").write_text(LIST_DESCRIPTORS)
    running = WarmParent(tmp_path)
    yield running
    running.stop()


def test_the_parent_holds_a_run_s_descriptors_close_on_exec(parent) -> None:
    """Received with SCM_RIGHTS, a descriptor is inheritable unless asked otherwise: the reply socket the
    parent keeps for the run's length was, unlike every descriptor it opens itself."""
    run = parent.send_run()
    parent.started(run[0])
    pid = parent.process.pid
    control = int(parent.process.args[3])  # passed by the server, to be inherited: the spare closes it itself
    inheritable = []
    for name in os.listdir(f"/proc/{pid}/fdinfo"):
        try:
            with open(f"/proc/{pid}/fdinfo/{name}") as f:
                flags = int(next(line for line in f if line.startswith("flags:")).split()[1], 8)
            if int(name) > 2 and int(name) != control and not flags & O_CLOEXEC_FLAG:
                inheritable.append((int(name), os.readlink(f"/proc/{pid}/fd/{name}")))
        except FileNotFoundError:  # closed since the listing: one the parent only used a moment, not one it holds
            continue
    assert inheritable == []
    assert parent.finish(*run) == [0, 1, 2]  # the run has its stdin, stdout and stderr


@pytest.mark.parametrize("cold", [False, True], ids=["warm", "cold"])
def test_a_child_forked_while_the_parent_holds_a_run_s_descriptors_keeps_none_of_them(parent, cold) -> None:
    """Defect: when the spare forked ahead had died, the parent forked the run's child while it held the run's
    descriptors, and the child kept copies of them besides its own (the reply socket, on which model code could
    answer in the parent's name; a second write end of its output pipe; the folder), through an exec too.
    And the dead spare's pidfd, reported in the same poll as the run, was taken for that child's (its number
    reused): the run was killed at once (status -9), as if it had ended."""
    spare = parent.spare()
    # The parent, stopped, learns of the spare's death together with the run: it forks the run's child
    # while it holds the run's descriptors.
    os.kill(parent.process.pid, signal.SIGSTOP)
    try:
        _wait_for_state(parent.process.pid, "T")
        os.kill(spare, signal.SIGKILL)
        _wait_for_state(spare, "ZX")
        run = parent.send_run([sys.executable, "-P", "main.py"] if cold else None)
    finally:
        os.kill(parent.process.pid, signal.SIGCONT)
    assert parent.started(run[0]) != spare
    assert parent.finish(*run) == [0, 1, 2], "the run's child holds descriptors beyond its stdin, stdout and stderr"


def test_a_run_s_child_is_reaped_only_once_the_server_has_closed_its_reply_socket(parent) -> None:
    """Defect: the parent reaped a run's child before it reported the run's end, while the server still listed the
    run's process group for terminate_running: a signal sent to that group in between could reach processes given
    the freed id. The child stays a zombie (its pid and group id reserved) until the server closes the reply
    socket, which it does once it has stopped listing the group."""
    reply, stdin_write, output_read = parent.send_run()
    pid = parent.started(reply)
    os.close(stdin_write)
    with os.fdopen(output_read, "rb") as output:
        output.read()
    assert json.loads(reply.recv(4096)) == {"status": 0}
    _wait_for_state(pid, "Z")  # ended, reported, and not reaped
    with open(f"/proc/{pid}/stat") as f:
        assert int(f.read().rsplit(")", 1)[1].split()[1]) == parent.process.pid  # still the parent's child
    reply.close()
    _wait_for_state(pid, "X")  # reaped now
    run = parent.send_run()  # and the parent serves on
    parent.started(run[0])
    assert parent.finish(*run) == [0, 1, 2]


# Imported by the warm parent before it answers: prints to stdout as libraries' banners do, in every way
# (a line; Python's buffer and descriptor 1 without a newline; C stdio's buffer, never flushed by the module).
BANNER_MODULE = """
import ctypes, os
print("The Zen of a banner")
print("python, no newline", end="")
os.write(1, b"descriptor 1, no newline")
ctypes.CDLL(None).printf(b"C stdio, no newline")
"""


def test_a_preloaded_module_that_prints_leaves_the_answer_and_the_runs_output_alone(tmp_path) -> None:
    """Defect: a preloaded module that printed as it was imported (``import this``, a library's banner) came
    before the parent's "ready" on the pipe the server reads it from: warm start was off, the reason "the warm
    parent did not start (The Zen of Python, by Tim Peters)". What it prints goes to the parent's log."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "banner.py").write_text(BANNER_MODULE)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "main.py").write_text(LIST_DESCRIPTORS)
    # As the server starts it: no PYTHONUNBUFFERED, so what the module prints is buffered, Python's and C's.
    parent = WarmParent(folder, modules=("banner",), env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(site)})
    try:
        # The answer was the pipe's only line: it is closed now, held by no child (nothing more comes, no wait).
        assert select.select([parent.process.stdout], [], [], 10)[0] == [parent.process.stdout]
        assert parent.process.stdout.read() == b""
        # A run's output is its main.py's alone (none of the banner, C stdio's included), and it holds no
        # descriptor but its stdin, stdout and stderr.
        for _ in range(2):
            run = parent.send_run()
            parent.started(run[0])
            assert parent.finish(*run) == [0, 1, 2]
        log = (folder / "parent.log").read_text()
        for printed in ("The Zen of a banner", "python, no newline", "descriptor 1, no newline", "C stdio, no newline"):
            assert log.count(printed) == 1, f"{printed!r} once in the warm parent's log expected: {log!r}"
    finally:
        parent.stop()


def test_a_compile_error_in_main_py_is_reported_as_python_main_py_reports_it(tmp_path) -> None:
    """Defect: each run's report of a main.py that did not compile started with a traceback in the warm parent
    ("<nereid.backends>/python/warm_parent.py", line N, in compile_entry); python main.py prints the error's
    file, line and caret alone. (The server refuses such a main.py at load: this is the parent's own guard.)"""
    (tmp_path / "main.py").write_text("import sys\nsys.stdin.read()\nreturn 1\n")
    python = subprocess.run([sys.executable, "main.py"], cwd=tmp_path, stdin=subprocess.DEVNULL, capture_output=True,
                            timeout=30)
    assert python.returncode == 1 and python.stdout == b""
    assert python.stderr.decode().startswith(f'  File "{tmp_path / "main.py"}", line 3\n')
    parent = WarmParent(tmp_path)
    try:
        for _ in range(2):  # the error is kept: every run reports it
            run = parent.send_run()
            parent.started(run[0])
            assert parent.outcome(*run) == (1, python.stderr.decode())
    finally:
        parent.stop()


# How main.py ends, each after writing: what `python main.py` prints and exits with there is what the interpreter's
# end does (flushing sys.stdout and sys.stderr, sys.exit's value as an exit status); W writes but cannot flush.
ENDINGS = {
    "stdout None": "print('out'); sys.stdout = None",
    "stderr None": "print('out'); sys.stderr = None",
    "stdout None, a finalizer prints": "exec('class D:\\n def __del__(s): print(\"finalized\")'); d = D(); "
                                       "sys.stdout = None",
    "stdout unflushable": "sys.stdout = W()",
    "stdout unflushable, exit 4": "sys.stdout = W(); sys.exit(4)",
    "stdout unflushable, uncaught": "sys.stdout = W(); raise ValueError('v')",
    "stderr unflushable": "sys.stderr = W()",
    "flush raises": "exec('class F:\\n def write(s, x): return len(x)\\n def flush(s): raise KeyError(\"k\")'); "
                    "sys.stdout = F()",
    "own unraisablehook": "sys.unraisablehook = lambda a: (print('hook', a.exc_type.__name__, file=sys.__stderr__), "
                          "sys.__unraisablehook__(a)); sys.stdout = 3",
    "unraisablehook raises": "sys.unraisablehook = lambda a: 1 / 0; sys.stdout = 3",
    "flushes once only": "exec('class O:\n n = 0\n def write(s, x): return len(x)\n def flush(s):\n  O.n += 1\n"
                         "  if O.n == 1: raise OSError(\"first\")'); sys.stdout = O()",
    "pending stdout closed": "sys.stdout.write('pending'); os.close(1)",
    "pending stdout closed, exit 5": "sys.stdout.write('pending'); os.close(1); sys.exit(5)",
    "pending stdout closed, interrupted": "sys.stdout.write('pending'); os.close(1); raise KeyboardInterrupt",
    "pending stdout, exit message": "sys.stdout.write('pending'); sys.exit('bye')",
    "stderr None, exit message": "sys.stderr = None; sys.exit('bye')",
    "stderr None, uncaught": "sys.stderr = None; raise ValueError('v')",
    "exit 2**70": "sys.exit(2**70)",
    "exit -2**70": "sys.exit(-2**70)",
    "exit 2**32+7": "sys.exit(2**32 + 7)",
    "exit -9": "sys.exit(-9)",
    "exit 3.0": "sys.exit(3.0)",
    "exit code unreadable": "exec('class E(SystemExit):\\n @property\\n def code(s): raise ValueError()'); raise E(3)",
    # The warm-start hunt: a hook that exits or raises, or none, ended the run with status 1 and the warm parent's
    # traceback, skipping atexit; __file__ was still there at exit, sys.last_value was not; a file held by another
    # module than main.py's own lost its buffered bytes.
    "excepthook exits": "import atexit; atexit.register(lambda: print('atexit')); "
                        "sys.excepthook = lambda *a: (print('hook', a[1]), sys.exit(5)); raise ValueError('boom')",
    "excepthook raises": "import atexit; atexit.register(lambda: print('atexit')); sys.excepthook = lambda *a: 1 / 0; "
                         "raise ValueError('boom')",
    "excepthook missing": "del sys.excepthook; raise ValueError('boom')",
    "what is left at exit": "import atexit; atexit.register(lambda: print(repr(getattr(sys, 'last_value', None)), "
                            "'__file__' in globals(), '__cached__' in globals())); raise ValueError('boom')",
    "what is left at a clean exit": "import atexit; atexit.register(lambda: print('__file__' in globals()))",
    "a file held by another module": "sys.kept = os.fdopen(os.dup(1), 'w'); sys.kept.write('held bytes')",
}

ENDING_MAIN = """
import os, sys
class W:
    def write(self, text):
        return len(text)
sys.stdin.read()
exec(open("ending.py").read())
"""


def test_main_py_ends_warm_as_python_main_py_ends(tmp_path) -> None:
    """Found by a bug hunt: warm, the end of a run was not the interpreter's. sys.stdout or sys.stderr set to None
    failed a run that python main.py ends with 0 (the traceback of the warm parent's own flush); a flush that
    failed at exit (an unflushable sys.stdout, pending output on a closed descriptor) ended it with 0 or 1, or
    main.py's own code, where python main.py ends with 120; sys.exit(2**70) ended it with 0, not 255."""
    (tmp_path / "main.py").write_text(ENDING_MAIN)
    # As the server starts both: no PYTHONUNBUFFERED (with it, nothing is left to flush at exit).
    env = {"PATH": os.environ.get("PATH", "")}
    parent = WarmParent(tmp_path, env=env)
    try:
        for case, ending in ENDINGS.items():
            (tmp_path / "ending.py").write_text(ending)
            python = subprocess.run([sys.executable, "main.py"], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=30)
            run = parent.send_run()
            parent.started(run[0])
            status, output = parent.outcome(*run)
            expected = (python.returncode, _no_addresses(python.stdout.decode()))
            assert (status, _no_addresses(output)) == expected, f"{case}: python main.py's ending expected"
    finally:
        parent.stop()


def _no_addresses(text: str) -> str:
    return re.sub(r" at 0x[0-9a-f]+>", " at 0x...>", text)
