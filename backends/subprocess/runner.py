"""Running one model process: its own process group, a minimal environment, a hard timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

STDERR_TAIL_BYTES = 2000


@dataclass(frozen=True)
class ProcessResult:
    """How a model process ended: its return code (negative: killed by that signal) and output tail."""

    returncode: int
    timed_out: bool
    output_tail: str

    def describe(self) -> str:
        """``exited with code 3`` / ``was killed by signal SIGSEGV``."""
        if self.returncode < 0:
            try:
                name = signal.Signals(-self.returncode).name
            except ValueError:
                name = str(-self.returncode)
            return f"was killed by signal {name}"
        return f"exited with code {self.returncode}"


class ProcessGroups:
    """The process groups of one model's running programs, so that all can be ended at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups: set[int] = set()

    def add(self, pgid: int) -> None:
        with self._lock:
            self._groups.add(pgid)

    def discard(self, pgid: int) -> None:
        with self._lock:
            self._groups.discard(pgid)

    def kill_all(self) -> int:
        """SIGKILL every running group (server shutdown past its grace); returns how many."""
        with self._lock:
            groups = list(self._groups)
        for pgid in groups:
            _kill_group(pgid)
        return len(groups)


def run_model_process(argv: list[str], *, cwd: Path, env: dict[str, str], stdin: bytes,
                      timeout_s: float | None, log_path: Path,
                      groups: ProcessGroups | None = None) -> ProcessResult:
    """Run ``argv`` to completion; on timeout kill its whole process group.

    The child's stdout and stderr go to ``log_path`` (its tail is reported on
    failure). The process group is always killed at the end, so nothing the
    model started outlives the request, and the child is always reaped. While
    it runs, its group is listed in ``groups``.
    """
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=log_file,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        if groups is not None:
            groups.add(process.pid)
        timed_out = False
        try:
            process.communicate(stdin, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        except BrokenPipeError:
            # The model exited without reading all of stdin; its exit status tells the story.
            pass
        finally:
            if groups is not None:
                groups.discard(process.pid)
            _kill_group(process.pid)
            process.wait()
    return ProcessResult(process.returncode, timed_out, _tail(log_path))


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already gone


def _tail(path: Path) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - STDERR_TAIL_BYTES))
        return f.read().decode("utf-8", errors="replace").strip()
