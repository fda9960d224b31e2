"""Running one model process: its own process group, a minimal environment, a hard timeout.

Waiting never polls. CPython's ``Popen.wait(timeout)`` loops on
``waitpid(WNOHANG)`` with a sleep that doubles up to 50 ms, so a child that
exits is noticed up to 50 ms late. Here the child's exit is a file descriptor
that becomes readable (a pidfd for a child we spawned, a socket for one forked
by a warm parent), waited on with ``poll`` together with the stdin pipe and the
deadline: the wait ends the moment the child exits or the timeout passes.
"""

from __future__ import annotations

import errno
import math
import os
import select
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Iterator, TypeAlias

from nereid.errors import ModelTimedOut, RunNotStarted
from nereid.settings import DEFAULT_CONFIG_NAME, DEFAULT_TIMEOUT_S

STDERR_TAIL_BYTES = 2000
# The PATH a model's runs and a compiler get when the server has none (env -i, a bare init).
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
DRAIN_MAX_READS = 64  # after the exit: at most 4 MiB more, so a chatty leftover process cannot hold the run
# ``poll`` takes its timeout as a C int of milliseconds (about 24.8 days): a longer wait (timeout_s may be
# any finite number) is made of several polls of at most this, until the real deadline.
MAX_POLL_MS = 2**31 - 1
# Buffers handed to one writev: far under Linux's IOV_MAX (1024), and plenty for a request's frames.
WRITEV_MAX_BUFFERS = 64
# What starting a run meets at a limit of the server's process (descriptors, processes, memory): no model's fault.
SERVER_LIMITS = frozenset({errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.ENOMEM})


def run_not_started(model: str, error_number: int, strerror: str) -> RunNotStarted:
    """The error of a run of ``model`` that a limit of the server's process kept from starting (``error_number``,
    one of :data:`SERVER_LIMITS`): it was "model 'm' failed: OSError: [Errno 24] Too many open files", an ERROR
    with nereid's traceback counted as the model's fault (the exhaustion hunt)."""
    code = errno.errorcode.get(error_number, error_number)
    return RunNotStarted(f"model '{model}': the server could not start a run ({code}: {strerror}: a limit of the "
                         "server's process is reached: open files, processes or memory); try again later")

# What a run writes to its program's stdin: one buffer, or several written one after the other as if joined (a
# multi-tensor model's frames: each header's bytes, then a view of its tensor's data), so that no tensor is
# copied to be sent.
StdinBuffer: TypeAlias = bytes | memoryview
StdinData: TypeAlias = StdinBuffer | Sequence[StdinBuffer]


@dataclass(frozen=True)
class ProcessResult:
    """How a model process ended: its return code (negative: killed by that signal) and output tail.

    ``terminated``: its group was killed by :meth:`ProcessGroups.kill_all` while
    it ran (its version was being retired), so a signal it died of is no crash.
    """

    returncode: int
    timed_out: bool
    output_tail: str
    terminated: bool = False

    def describe(self) -> str:
        """``exited with code 3`` / ``was killed by signal SIGSEGV``."""
        if self.returncode < 0:
            try:
                name = signal.Signals(-self.returncode).name
            except ValueError:
                name = str(-self.returncode)
            return f"was killed by signal {name}"
        return f"exited with code {self.returncode}"


def timed_out(name: str, timeout_s: float, how_it_ended: str, config_name: str = DEFAULT_CONFIG_NAME,
              output_tail: str = "") -> ModelTimedOut:
    """The error for a run of model ``name`` still going at its ``timeout_s``: one wording for a cold run and a
    warm one, ``how_it_ended`` saying what was done about it; ``config_name``: the configuration file that sets
    timeout_s (ModelContext.config_name); ``output_tail``: what the run printed last, as every other failed run's
    error reports it (the author hunt: a hung model's "waiting for db:5432 ..." was told nowhere)."""
    # (Which setting, and its default: a model without one was told of a timeout_s nowhere written.)
    tail = f"; output tail: {output_tail}" if output_tail else ""
    return ModelTimedOut(f"model '{name}' timed out after {timeout_s:g} s (the model's timeout_s in {config_name}, "
                         f"default {DEFAULT_TIMEOUT_S:g} s); {how_it_ended}{tail}")


class FolderNotEntered(Exception):
    """A run's program could not start: entering its model folder, the run's working directory, failed with
    ``error`` (a PermissionError: the folder's mode was changed while the model serves, ``chmod 000``).

    Raised by the launchers: :func:`run_model_process` when its child's chdir
    fails, a warm parent's side when the run's child reports it could not
    enter the folder. The model (``SubprocessModel``) answers it naming the
    folder and the remedy; it never reaches a client as it is.
    """

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass
class _Run:
    """A run in progress on one thread (see :meth:`ProcessGroups.running`)."""

    killed: bool = False  # kill_all came while it ran
    listed: bool = False  # add has named its group


class ProcessGroups:
    """The process groups of one model's running programs, so that all can be ended at once.

    A run's group is known only once its program is running (its pid comes back
    after the fork, and for a spawned child only after the exec): a run is
    counted from before that, by :meth:`running`, so that a :meth:`kill_all` that
    comes before :meth:`add` names its group still ends it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups: set[int] = set()
        self._killed: set[int] = set()  # listed groups that kill_all ended, until their run discards them
        # Runs in progress, by thread: a run starts its program, adds and discards its group on the one thread
        # that serves its batch, so add finds its run without the launchers (cold, warm) passing anything.
        self._runs: dict[int, _Run] = {}

    @contextmanager
    def running(self) -> Iterator[None]:
        """Count the calling thread's run for the time of the block, before its group is known.

        A :meth:`kill_all` during the block ends the group this thread's
        :meth:`add` names, when add names it: a run whose program has started
        but whose pid is not listed yet (or that is still preparing) is not
        missed. Blocks nested on one thread are one run.
        """
        me = threading.get_ident()
        with self._lock:
            outermost = me not in self._runs
            if outermost:
                self._runs[me] = _Run()
        try:
            yield
        finally:
            if outermost:
                with self._lock:
                    del self._runs[me]

    def add(self, pgid: int) -> None:
        """List ``pgid``, the group of a program just started; killed at once when :meth:`kill_all` came during
        this thread's :meth:`running` block (its version was retired while the run was starting)."""
        with self._lock:
            self._groups.add(pgid)
            run = self._runs.get(threading.get_ident())
            if run is None:
                return
            run.listed = True
            if run.killed:
                self._killed.add(pgid)
                kill_group(pgid)

    def discard(self, pgid: int) -> bool:
        """Stop listing ``pgid`` (its run is over); True when :meth:`kill_all` killed it meanwhile."""
        with self._lock:
            self._groups.discard(pgid)
            if pgid in self._killed:
                self._killed.discard(pgid)
                return True
            return False

    def kill_all(self) -> int:
        """SIGKILL every running group (its version is retired past the grace), and the group of every run still
        starting as soon as :meth:`add` names it; returns how many runs that ends."""
        with self._lock:
            self._killed.update(self._groups)  # before the signal: the run may be reporting its end at once
            starting = 0
            for run in self._runs.values():
                run.killed = True
                starting += not run.listed
            # Signalled under the lock: a cold run reaps its child only after discard, which waits for the lock,
            # so none of its groups here can be a pid reused meanwhile by another process.
            for pgid in self._groups:
                kill_group(pgid)
            return len(self._groups) + starting


def run_model_process(argv: list[str], *, cwd: Path | str, env: dict[str, str], stdin: StdinData,
                      timeout_s: float | None, groups: ProcessGroups | None = None,
                      tail_bytes: int = STDERR_TAIL_BYTES, head_bytes: int = 0) -> ProcessResult:
    """Run ``argv`` to completion; on timeout kill its whole process group.

    The child's stdout and stderr go to a pipe of which only the last
    ``tail_bytes`` are kept (reported on failure), after the first
    ``head_bytes`` (a compiler's first error is the one that matters). The process group is
    always killed at the end, so nothing the model started outlives the
    request, and the child is always reaped. While it runs, from before its
    program starts, it is counted in ``groups`` (see :meth:`ProcessGroups.running`).
    ``stdin`` is written as :func:`feed_and_wait` writes it.
    """
    # Counted as running before its program starts: a kill_all from here on ends it (see ProcessGroups).
    with groups.running() if groups is not None else nullcontext():
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        # Our own pipes rather than Popen's file objects: feed_and_wait owns and closes their parent ends.
        # Each step that can fail (EMFILE: the server is out of descriptors) closes what the steps before it
        # opened: a descriptor leaked per failed run would keep the server out of them for good.
        stdin_read, stdin_write, output_read, output_write = open_pipes(2)
        try:
            process = subprocess.Popen(argv, cwd=cwd, env=env, stdin=stdin_read, stdout=output_write,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        except BaseException as err:
            close_descriptors(stdin_write, output_read)
            if entering_failed(err, cwd):
                # Told as such: the bare "[Errno 13] Permission denied: '/proc/self/fd/18'" named no folder.
                raise FolderNotEntered(err) from None
            raise
        finally:
            close_descriptors(stdin_read, output_write)  # the child's ends: it has its own copies (or never ran)
        try:
            exit_fd = os.pidfd_open(process.pid)
        except BaseException:
            # Without its pidfd the run cannot be waited on: end the child (and its group) and reap it here.
            close_descriptors(stdin_write, output_read)
            kill_group(process.pid)
            process.wait()
            raise
        if groups is not None:
            groups.add(process.pid)
        terminated = False
        try:
            exited, tail = feed_and_wait(stdin_write, stdin, exit_fd, deadline, output_read, tail_bytes,
                                         head_bytes)
        finally:
            if groups is not None:
                terminated = groups.discard(process.pid)
            # The child is not reaped yet (a zombie at worst), so its pid, the group's id, cannot be reused.
            kill_group(process.pid)
            os.close(exit_fd)
            process.wait()  # returns at once: the child has exited or was just killed
        return ProcessResult(process.returncode, not exited, tail, terminated)


def entering_failed(err: BaseException, cwd: Path | str) -> bool:
    """Whether ``err``, raised by ``Popen`` started in ``cwd``, is its child's chdir into ``cwd`` refused by the
    folder's permission bits (Popen names ``cwd`` as the file then; the program's own name when its exec failed)."""
    return isinstance(err, PermissionError) and err.filename is not None and \
        os.fsdecode(err.filename) == os.fsdecode(cwd)


def feed_and_wait(stdin_fd: int, data: StdinData, exit_fd: int, deadline: float | None,
                  output_fd: int, tail_bytes: int = STDERR_TAIL_BYTES, head_bytes: int = 0) -> tuple[bool, str]:
    """Write ``data`` to the child's stdin, keep the tail of its output, wait until ``exit_fd`` is readable.

    ``data`` is one buffer or a sequence of them, written one after the other
    (each as it is: none is copied). ``exit_fd`` becomes readable when the child has exited (a pidfd, or a socket
    on which its warm parent reports the exit). Returns whether the child exited
    (False: ``deadline``, a ``time.monotonic()`` value, passed first; None: no
    deadline) and the last ``tail_bytes`` of its output, decoded. A child
    that exits or closes stdin before reading everything ends the writing: its
    exit status tells the story. ``stdin_fd`` and ``output_fd`` are closed on return.
    """
    pending = _pending_views(data)
    tail = _Tail(output_fd, tail_bytes, head_bytes)
    poller = select.poll()
    poller.register(exit_fd, select.POLLIN)
    poller.register(output_fd, select.POLLIN)
    stdin_open = True
    try:
        if pending:
            os.set_blocking(stdin_fd, False)
            _write_some(stdin_fd, pending)  # a small input fits in the pipe at once
        if pending:
            poller.register(stdin_fd, select.POLLOUT)
        else:
            stdin_open = False
            os.close(stdin_fd)
        while True:
            events = poller.poll(poll_timeout_ms(deadline))
            if not events:
                if deadline is not None and time.monotonic() < deadline:
                    continue  # one slice of a wait longer than poll can take
                return False, tail.text()
            for fd, event in events:
                if fd == exit_fd:
                    tail.drain()
                    return True, tail.text()
                if fd == output_fd:
                    if not tail.read():
                        poller.unregister(output_fd)  # every writer closed it: no more events
                    continue
                if event & (select.POLLERR | select.POLLHUP):
                    pending.clear()  # the child closed its stdin
                else:
                    _write_some(stdin_fd, pending)
                if not pending:
                    poller.unregister(stdin_fd)
                    stdin_open = False
                    os.close(stdin_fd)
    finally:
        if stdin_open:  # closed exactly once: a second close could hit a descriptor another thread reuses
            os.close(stdin_fd)
        os.close(output_fd)


def _pending_views(data: StdinData) -> deque[memoryview]:
    """``data`` as the byte views still to write, in order; empty ones left out (nothing to write)."""
    buffers = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
    views = (memoryview(buffer).cast("B") for buffer in buffers)  # flat bytes: sliced by the bytes written
    return deque(view for view in views if view)


def _whole_characters(data: bytes, *, at_end: bool) -> bytes:
    """``data`` less the bytes of a UTF-8 character cut at its end (``at_end``) or at its start (at most 3)."""
    if at_end:
        for back in range(1, min(4, len(data)) + 1):
            byte = data[-back]
            if byte < 0x80:
                return data
            if byte >= 0xC0:  # a character's first byte: whole when its length fits in what follows it
                length = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
                return data if back >= length else data[:-back]
        return data
    skip = 0
    while skip < min(3, len(data)) and 0x80 <= data[skip] < 0xC0:  # continuation bytes of a cut character
        skip += 1
    return data[skip:]


class _Tail:
    """The first ``head`` and the last ``size`` bytes read from a child's output pipe; the rest is dropped as it
    arrives (counted: the text says how much was left out between the two)."""

    def __init__(self, fd: int, size: int, head: int = 0) -> None:
        self.fd = fd
        self.size = size
        self.head_size = head
        self.head = b""
        self.data = b""
        self.total = 0
        os.set_blocking(fd, False)

    def _add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        if len(self.head) < self.head_size:
            taken = self.head_size - len(self.head)
            self.head, chunk = self.head + chunk[:taken], chunk[taken:]
        self.data = (self.data + chunk)[-self.size:]

    def read(self) -> bool:
        """Read what is there; False at end of file."""
        try:
            chunk = os.read(self.fd, 65536)
        except BlockingIOError:
            return True
        self._add(chunk)
        return bool(chunk)

    def drain(self) -> None:
        """Read until the pipe is empty (a process the child left behind may still hold it open and write)."""
        try:
            for _ in range(DRAIN_MAX_READS):
                chunk = os.read(self.fd, 65536)
                if not chunk:
                    return
                self._add(chunk)
        except BlockingIOError:
            pass

    def text(self) -> str:
        omitted = self.total - len(self.head) - len(self.data)
        if omitted <= 0:
            return (self.head + self.data).decode("utf-8", errors="replace").strip()
        if not self.head_size:  # (a tail alone is a tail: a model's output, its last lines)
            # Cut at a character's edge too: the first bytes kept may be the end of a character dropped before.
            return _whole_characters(self.data, at_end=False).decode("utf-8", errors="replace").strip()
        # Each part cut at a character's edge: a cut inside one (gcc's ‘quotes’) would show a stray U+FFFD.
        head = _whole_characters(self.head, at_end=True).decode("utf-8", errors="replace").rstrip()
        tail = _whole_characters(self.data, at_end=False).decode("utf-8", errors="replace").strip()
        return f"{head}\n... ({omitted} bytes left out) ...\n{tail}"


def _write_some(fd: int, pending: deque[memoryview]) -> None:
    """Write what the pipe takes now from the front of ``pending``, dropping what was written (all of it when the
    reader is gone: nothing more can be written)."""
    try:
        while pending:
            written = os.writev(fd, list(islice(pending, WRITEV_MAX_BUFFERS)))
            _drop_written(pending, written)
    except BlockingIOError:
        pass
    except BrokenPipeError:
        pending.clear()


def _drop_written(pending: deque[memoryview], written: int) -> None:
    """Take ``written`` bytes off the front of ``pending``: the buffers written whole, and the start of the next."""
    while written:
        first = pending[0]
        if written < first.nbytes:
            pending[0] = first[written:]
            return
        written -= first.nbytes
        pending.popleft()


def wait_for_exit(process: subprocess.Popen, timeout_s: float) -> bool:
    """Wait until ``process`` (our child) has exited, at most ``timeout_s``, and reap it; False on timeout.

    The exit is a pidfd becoming readable, so the wait ends the moment the
    process does (``Popen.wait(timeout)`` would poll with growing sleeps).
    """
    if process.poll() is not None:
        return True
    try:
        pidfd = os.pidfd_open(process.pid)
    except OSError:  # out of descriptors (EMFILE): wait as Popen does, rather than leave the child unreaped
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        deadline = time.monotonic() + timeout_s
        while not poller.poll(poll_timeout_ms(deadline)):
            if time.monotonic() >= deadline:
                return False
    finally:
        os.close(pidfd)
    process.wait()  # returns at once: it has exited
    return True


def poll_timeout_ms(deadline: float | None) -> int:
    """The timeout of one ``poll`` waiting until ``deadline`` (a ``time.monotonic()`` value; None: -1, forever).

    Rounded up, so a poll that ends empty ends at or past the deadline, and at
    most :data:`MAX_POLL_MS`: past that the caller polls again. Bounded in
    seconds before the conversion, so a deadline of 1e308 s overflows nothing.
    """
    if deadline is None:
        return -1
    remaining_s = min(deadline - time.monotonic(), MAX_POLL_MS / 1000)
    return max(0, min(MAX_POLL_MS, math.ceil(remaining_s * 1000)))


def open_pipes(count: int) -> list[int]:
    """``count`` close-on-exec pipes, as ``[read, write, read, write, ...]``: all or none.

    When one cannot be made (EMFILE, the server out of descriptors) those made
    before it are closed, or each failed run would leak them and the server
    would stay out of descriptors for good.
    """
    opened: list[int] = []
    try:
        for _ in range(count):
            opened.extend(os.pipe2(os.O_CLOEXEC))
    except BaseException:
        close_descriptors(*opened)
        raise
    return opened


def close_descriptors(*fds: int) -> None:
    """Close each of ``fds`` (descriptors this process opened and no one else closes); every one is closed
    even when an earlier close fails (EIO, say), and the first such error is raised after."""
    failed: OSError | None = None
    for fd in fds:
        try:
            os.close(fd)
        except OSError as err:
            failed = failed or err
    if failed is not None:
        raise failed


def kill_group(pgid: int) -> None:
    """SIGKILL a process group, if it still exists."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already gone
