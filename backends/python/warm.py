"""The server's side of a python model's warm parent (see ``warm_parent.py`` for the protocol).

One :class:`WarmParent` per loaded model. ``run`` is called from worker
threads, any number at once: each run has its own stdin pipe and reply socket,
and the control socket is SOCK_SEQPACKET, so each request is one atomic message.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import select
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Mapping

from nereid.daemon_pool import thread_start_hint
from nereid.errors import ModelFailure, ModelKilled, NereidError, NotStarted, Unavailable
from nereid.files import descriptor_path
from nereid.settings import DEFAULT_CONFIG_NAME

from nereid.backends.python.compiled_script import runnable_script
from nereid.backends.python.preload import Preloads
from nereid.backends.subprocess.runner import (SERVER_LIMITS, FolderNotEntered, ProcessGroups, ProcessResult,
                                               StdinData, close_descriptors, entering_failed, feed_and_wait,
                                               kill_group, open_pipes, run_not_started, timed_out, wait_for_exit)

log = logging.getLogger(__name__)
_PY_WARNINGS = logging.getLogger("py.warnings")  # (where logging.captureWarnings logs Python's own)

WARM_PARENT_SCRIPT = Path(__file__).with_name("warm_parent.py")
START_TIMEOUT_S = 300.0   # preloading torch on a slow disk takes seconds, never minutes
REPLY_TIMEOUT_S = 30.0    # the parent answers a fork at once; this only bounds a wedged parent
STOP_GRACE_S = 5.0
MAX_REPLY_BYTES = 4096
STARTUP_TAIL_BYTES = 2000
# Parents in a row that ended while starting (killed, crashed, silent) before a model goes cold: one that always
# dies (an installed module that now crashes the interpreter as it is imported) is not started again at every batch.
MAX_START_DEATHS = 3
# A model that a restart made cold (MAX_START_DEATHS deaths, or a preload that failed) tries warm start again: what
# made it cold is often passing (an out-of-memory killer on a busy machine, a MemoryError while importing), and cold
# runs cost each batch a fresh interpreter (~100 ms with numpy) until the model is loaded again. The first batch
# WARM_RETRY_FIRST_S after it went cold starts a warm parent beside the cold one, and each try that fails doubles the
# wait, up to WARM_RETRY_MAX_S: 30 s lets a burst of memory pressure pass, and at the cap a model whose preload is
# broken for good costs one parent start (its imports: seconds of a core) every 30 minutes. Read when a batch looks,
# so a test can change them.
WARM_RETRY_FIRST_S = 30.0
WARM_RETRY_MAX_S = 1800.0
# How long a stop waits for a try's parent, killed as it started, to be reaped by the try's thread.
RETRY_STOP_WAIT_S = 30.0
WATCH_RETRY_S = 0.2  # how soon the exit watcher tries again to clear a dead parent whose model was busy


# What the warm parent reads of one request (warm_parent.MAX_REQUEST_BYTES; a test keeps the two equal).
PARENT_MAX_REQUEST_BYTES = 1 << 20
# How a run's child says it could not enter the loaded folder: its exit status, and the start of its last line of
# output, then "ERRNO STRERROR" (warm_parent.FOLDER_NOT_ENTERED_EXIT and _LINE; a test keeps them equal).
FOLDER_NOT_ENTERED_EXIT = 126
FOLDER_NOT_ENTERED_LINE = "nereid warm parent: the run's child cannot enter the model folder: errno "
# What Linux keeps for itself of an AF_UNIX socket's send buffer: it refuses (EMSGSIZE) a SOCK_SEQPACKET message
# longer than SO_SNDBUF less this (unix_dgram_sendmsg); 212960 bytes with the default net.core.wmem_default.
UNIX_MESSAGE_OVERHEAD = 32


def run_request(env: Mapping[str, str], cwd: str, exec_argv: list[str] | None) -> bytes:
    """The message that hands the warm parent one run: its environment and folder, and with ``exec_argv`` the
    program a cold run execs."""
    request: dict[str, object] = {"env": dict(env), "cwd": cwd}
    if exec_argv:
        # With the loaded main.py's bytes, which the parent holds (the scratch folder's copy may be gone):
        # exec_argv is cold_bootstrap.py's.
        request["exec"], request["entry"] = exec_argv, True
    return json.dumps(request).encode()


def max_request_bytes() -> tuple[int, str]:
    """The longest run request the warm parent can be sent here, and what bounds it (for messages).

    A request is one message of a local SOCK_SEQPACKET socket, which its send
    buffer bounds (SO_SNDBUF: net.core.wmem_default for a new socket), and the
    parent reads no more than :data:`PARENT_MAX_REQUEST_BYTES` of it.
    """
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # made as each parent's control is
    with ours, theirs:
        send_buffer = ours.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    by_socket = send_buffer - UNIX_MESSAGE_OVERHEAD
    if by_socket <= PARENT_MAX_REQUEST_BYTES:
        return by_socket, (f"one message of a local socket here: its send buffer of {send_buffer} bytes "
                           f"(net.core.wmem_default) less {UNIX_MESSAGE_OVERHEAD}")
    return PARENT_MAX_REQUEST_BYTES, "what the warm parent reads of one request"


class WarmStartUnavailable(Exception):
    """The warm parent cannot serve this model (an import failed, started threads or initialised CUDA): run cold."""


class EntryImportFailed(WarmStartUnavailable):
    """One of main.py's own top-level imports failed in the warm parent: every run would stop at it.

    A load fails on it. A parent restarted later that meets it runs the model
    cold instead, as for any other reason it cannot preload (the model is
    already serving, and the import may work again).
    """


class WarmParentBlocked(WarmStartUnavailable):
    """The server could not start a warm parent at all, for a reason of its own, not of the model's imports: the
    parent's folder in the scratch folder could not be prepared (a full disk, the folder removed and a file put
    in its place), or a resource limit refused the socket or the process (EMFILE, EAGAIN, ENOMEM).

    Transient, and a parent that preloads nothing meets it just the same, so
    it never turns warm start off: a restart that meets it fails its batch,
    and the next batch tries again (see ``WarmParent._restart``).
    ``folder_error``: the parent could not enter the model folder (its mode
    changed while the model serves), which a restart's batch is failed with as
    a run's (FolderNotEntered); None for any other reason.
    """

    def __init__(self, message: str, folder_error: OSError | None = None, cause: OSError | None = None) -> None:
        super().__init__(message)
        self.folder_error = folder_error
        self.cause = cause  # (what refused it: one of the server's limits is no fault of the model's)


class WarmParentDied(WarmStartUnavailable):
    """The warm parent ended while it started, before it answered: killed (the out-of-memory killer), crashed,
    exited, or silent until START_TIMEOUT_S and killed.

    A fault of that process, not a verdict on its imports: a restart
    starts another one (see ``WarmParent._restart``), and so does a load
    (``PythonModel._start_warm_parent``), which runs the model cold only if
    that one ends too. ``how`` says how
    it ended (``was killed by signal SIGKILL``), ``killed`` whether a signal
    ended it (not ours: one silent until START_TIMEOUT_S is ``timed_out``).
    """

    def __init__(self, message: str, how: str, *, killed: bool, timed_out: bool) -> None:
        super().__init__(message)
        self.how = how
        self.killed = killed
        self.timed_out = timed_out


@dataclass
class _WarmRetry:
    """A model gone cold at a restart trying warm start again (see ``WarmParent._try_warm_again``); read and
    changed under its WarmParent's lock (``describe`` and ``wait_s`` excepted: a report reads them without it)."""

    modules: Preloads  # what its warm parent preloaded, and a try's parent preloads
    since: float  # (time.monotonic) when it went cold, or the last try failed: the wait counts from there
    doublings: int = 0  # how many times the wait has doubled: the tries that failed, and a return that did not last
    failed: int = 0  # the tries that failed since it went cold
    thread: threading.Thread | None = None  # the try in progress
    starting: subprocess.Popen | None = None  # that try's parent, while it starts (a stop kills it)

    def wait_s(self) -> float:
        """How long after ``since`` the next try may start."""
        return min(WARM_RETRY_FIRST_S * 2 ** min(self.doublings, 32), WARM_RETRY_MAX_S)

    def due(self, now: float) -> bool:
        """Whether a batch at ``now`` starts the next try."""
        return self.thread is None and now >= self.since + self.wait_s()

    def describe(self) -> str:
        """Where the tries stand, for the model's runtime report."""
        failed = f" ({self.failed} {'try' if self.failed == 1 else 'tries'} failed so far)" if self.failed else ""
        if self.thread is not None:
            return f"being tried again: a warm parent is starting{failed}"
        left = self.since + self.wait_s() - time.monotonic()
        when = f"the first batch in {math.ceil(left)} s" if left > 0 else "the next batch"
        return f"tried again at {when}{failed}"


class WarmParent:
    """A running warm parent: started with the model's environment, imports preloaded."""

    def __init__(self, *, name: str, folder: Path, env: dict[str, str], modules: Preloads, log_path: Path,
                 entry_source: Path, entry_bytes: bytes, cold_argv: list[str] | None = None,
                 folder_fd: int | None = None, warm: bool = True, config_name: str = DEFAULT_CONFIG_NAME) -> None:
        """``warm``: it serves warm runs (False: a cold model's parent, which preloads nothing and execs each run,
        named only "parent" in messages: its model has warm start off). ``config_name``: the configuration file
        that sets the model's timeout_s, as a timed-out run's error names it (ModelContext.config_name)."""
        self.name = name
        self.config_name = config_name
        self.warm = warm
        # What a cold run execs, should a restarted parent find it can no longer preload.
        self.cold_argv = cold_argv
        self.cold_reason: str | None = None  # why runs went cold after a restart (None: they did not)
        self.cold_since_load = False  # cold_reason is the load's: its warm parents ended as they started
        self.folder = folder
        # An O_PATH descriptor of the loaded folder (the model's, not ours to close), sent with each run: the
        # child enters that folder, never another one put under its name since. None: the path is used.
        self.folder_fd = folder_fd
        self.entry_source = entry_source  # the main.py bytes to compile, named FOLDER/main.py
        self.entry_bytes = entry_bytes  # those bytes, kept: a restart writes them again if the file is gone
        self.env = env
        self.modules = modules
        self.log_path = log_path
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._control: socket.socket | None = None
        self._start_deaths = 0  # parents in a row that ended while starting (see _restart)
        self._blocked: str | None = None  # why restarts could not start a parent since the last one started
        # Runs handed to each parent and not yet over (by parent): a parent replaced while it has some (a cold one
        # when warm start came back) is ended only once the last is (``_retiring``), so none of them is lost.
        self._in_flight: dict[subprocess.Popen, int] = {}
        self._retiring: dict[subprocess.Popen, socket.socket] = {}  # replaced parents, with their control sockets
        self._retry: _WarmRetry | None = None  # trying warm start again, while cold since a restart
        # When warm start last came back, and the retry's doublings then: a model that goes cold again soon after
        # (its parents dying again) waits longer than the last time, not WARM_RETRY_FIRST_S again.
        self._came_back: tuple[float, int] | None = None
        # Set by stop (the model unloaded): no parent is started again, so a batch still going then (its parent
        # stopped or killed under it) fails saying so, rather than start one for a model that is gone.
        self._stopped = False

    @property
    def called(self) -> str:
        """What messages call it: "warm parent", or "parent" once its runs are cold (a model with warm start off,
        or one gone cold), where "warm" sent its reader to a setting that is off."""
        return "warm parent" if self.warm and self.cold_reason is None else "parent"

    # -- life cycle -------------------------------------------------------
    def start(self) -> None:
        """Start the parent and wait until its imports are done; WarmStartUnavailable if it cannot serve."""
        with self._lock:
            self._stopped = False
            self._start()
        if self.modules.left:
            # Once per load (a restart calls _start): main.py's own imports that each run imports itself, with
            # what a statement before them did (an environment variable, a sys.path entry), as python main.py does.
            log.info("model '%s': main.py's imports %s are not preloaded, each run imports them: %s; name them in "
                     "runtime.preload to preload them anyway", self.name,
                     ", ".join(f"'{name}'" for name in self.modules.left), self.modules.left_because)

    def _start(self) -> None:
        """Start the model's parent (warm or cold, as ``self.modules`` says) as the running one. Under the lock."""
        self._adopt(*self._launch(self.modules, self.called))

    def _adopt(self, process: subprocess.Popen, control: socket.socket) -> None:
        """Make ``process``, a parent just started, the running one. Under the lock."""
        self._process, self._control = process, control
        _EXITS.watch(self, process)

    def _launch(self, modules: Preloads, called: str, started: Callable[[subprocess.Popen | None], None] | None = None
                ) -> tuple[subprocess.Popen, socket.socket]:
        """A parent that preloads ``modules`` (``called`` so in messages), started and ready: its process and our
        end of its control socket. WarmStartUnavailable if it cannot serve; the process is then reaped.

        ``started`` is told the process as soon as it runs (before its
        imports), and None before a process that failed is reaped: until then
        its pid is still its own, so killing its group kills nothing else.
        """
        self._prepare_folder()
        try:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        except OSError as err:  # EMFILE, ENFILE, ENOMEM: the server's limits, not the model's
            raise WarmParentBlocked(f"no socket for it: {err.strerror or err}", cause=err) from None
        cwd = self._folder_path()
        try:
            with self._opened_log() as log_file:
                process = subprocess.Popen(
                    [sys.executable, "-P", str(runnable_script(WARM_PARENT_SCRIPT)), str(theirs.fileno()),
                     json.dumps(modules.as_json()), str(self.folder), str(self.entry_source)],
                    cwd=cwd, env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file,
                    pass_fds=(theirs.fileno(),), start_new_session=True)
        except OSError as err:  # the fork (EAGAIN, ENOMEM), the descriptors of its pipes, entering the folder
            ours.close()
            # The bare reason: each caller says what could not be started (a load's "its parent process could not
            # be started: ...", a restart's "could not be restarted"), where this said it a second time.
            raise WarmParentBlocked(err.strerror or str(err),
                                    err if entering_failed(err, cwd) else None, cause=err) from None
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        if started is not None:
            started(process)
        assert process.stdout is not None
        line = _read_line(process.stdout.fileno(), time.monotonic() + START_TIMEOUT_S)
        process.stdout.close()
        line, warned = _startup_warnings(line)
        if line != "ready":
            ours.close()
            if started is not None:
                started(None)
            _end(process)
            if line is not None and line.startswith("broken "):
                raise EntryImportFailed(line.removeprefix("broken "))
            if line is not None and line.startswith("fallback "):
                raise WarmStartUnavailable(line.removeprefix("fallback "))
            tail = self._log_tail()
            tail = f"; output tail: {tail}" if tail else ""
            if line is None:
                how = f"did not answer within {START_TIMEOUT_S:g} s and was killed"
                raise WarmParentDied(f"the {called} {how} while starting{tail}", how, killed=False, timed_out=True)
            if not line:  # its answer's pipe closed unanswered: it ended (no answer is ever written by halves)
                how = _describe_exit(process.returncode)
                raise WarmParentDied(f"the {called} {how} while starting{tail}", how,
                                     killed=process.returncode < 0, timed_out=False)
            raise WarmStartUnavailable(f"the {called} did not start ({line}){tail}")
        for text in warned:
            # (As nereid serve and nereid check log every Python warning: once, where the parent emitted it.)
            _PY_WARNINGS.warning("model '%s': %s (as its warm parent imported main.py's modules)", self.name, text)
        return process, ours

    def _log_tail(self) -> str:
        """The end of the parent's log (what its imports printed, a traceback), or "" when it cannot be read."""
        try:
            return self.log_path.read_bytes()[-STARTUP_TAIL_BYTES:].decode("utf-8", errors="replace").strip()
        except OSError:  # the scratch folder removed meanwhile: the reason is told without it
            return ""

    def _prepare_folder(self) -> None:
        """Give the parent what its start reads and writes: its log's folder, its temporary folder (TMPDIR), and
        the loaded main.py's copy.

        A start after the first (the parent died) finds them gone when a
        /tmp cleaner removed the scratch folder meanwhile, or a run deleted or
        rewrote the copy: every restart would fail, or run another main.py,
        while the model stayed READY. The copy is written again from the
        bytes loaded, so a restart still runs the loaded version.
        """
        try:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            if "TMPDIR" in self.env:
                Path(self.env["TMPDIR"]).mkdir(parents=True, exist_ok=True)
            try:
                current = self.entry_source.read_bytes()
            except OSError:
                current = None
            if current != self.entry_bytes:
                self.entry_source.write_bytes(self.entry_bytes)
        except OSError as err:  # a full disk, a scratch folder made unwritable
            raise WarmParentBlocked(f"cannot prepare its folder {self.log_path.parent}: "
                                    f"{err.strerror or err}") from None

    def _opened_log(self) -> BinaryIO:
        """The parent's log (its stderr), opened to append to; WarmParentBlocked naming it if it cannot be."""
        try:
            return open(self.log_path, "ab")
        except OSError as err:  # a full disk, the descriptor limit, something else made where the file was
            raise WarmParentBlocked(f"cannot open its log {self.log_path}: {err.strerror or err}",
                                    cause=err) from None

    def _folder_path(self) -> str:
        """The loaded folder as a path that leads to it (through its descriptor when there is one)."""
        fd = self.folder_fd
        return descriptor_path(fd) if fd is not None else str(self.folder)

    def stop(self) -> None:
        """End the parent and every child it runs; the parent is reaped. None is started again: a run from now on
        fails (Unavailable, the model was unloaded). A try at warm start again ends with it: its parent, starting,
        is killed and reaped before this returns, and none is tried later."""
        with self._lock:
            self._stopped = True
            process, control = self._process, self._control
            self._process = self._control = None
            retiring, self._retiring = self._retiring, {}
            retry, self._retry = self._retry, None
            trying = retry.thread if retry is not None else None  # (the try clears it as it ends)
            if retry is not None and retry.starting is not None:
                # Its imports may take minutes: not waited for. (Not reaped yet: the try lets go of it under the
                # lock first, so its pid, its group's id, is still its own.)
                kill_group(retry.starting.pid)
        if trying is not None:
            trying.join(RETRY_STOP_WAIT_S)  # it reaps its parent, or ends the one it started meanwhile
            if trying.is_alive():
                log.warning("model '%s': its try at warm start again did not end within %g s of the model's unload",
                            self.name, RETRY_STOP_WAIT_S)
        for replaced, its_control in retiring.items():  # (their runs fail as the running parent's do)
            its_control.close()
            _end(replaced)
        if process is None:
            return
        assert control is not None
        control.close()
        _end(process)

    @property
    def pid(self) -> int | None:
        """The parent's process id while it runs."""
        process = self._process
        return process.pid if process is not None else None

    def resident_bytes(self) -> int | None:
        """The parent's resident memory (VmRSS), or None when it is not running."""
        pid = self.pid
        if pid is None:
            return None
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    # -- runs ---------------------------------------------------------------
    def run(self, *, env: dict[str, str], stdin: StdinData, timeout_s: float | None,
            groups: ProcessGroups, exec_argv: list[str] | None = None) -> ProcessResult:
        """Fork one child that runs ``main.py`` for this batch; as ``run_model_process`` for a cold one.

        With ``exec_argv`` the child execs that program (a cold run) instead,
        with one more argument: a descriptor that holds the loaded main.py's
        bytes (see ``cold_bootstrap.py``).
        A parent found dead is restarted first. A parent that dies before it
        said it forked the run (found alive, killed a moment later) is replaced
        at once, and the run raises NotStarted: the run had not started (a
        child it had forked dies with it), so the scheduler sends the batch
        once more, to the new parent, less the requests whose deadline passed
        meanwhile. If it dies during the run, the run fails with ModelFailure
        giving the reason; the next run restarts it.
        """
        parent, control, cold = self._take_parent()
        try:
            if exec_argv is None and cold:  # (a restart may have just made it cold)
                exec_argv = self.cold_argv
            return self._run_on(parent, control, env, stdin, timeout_s, groups, exec_argv)
        finally:
            self._let_go(parent)

    def _run_on(self, parent: subprocess.Popen, control: socket.socket, env: dict[str, str], stdin: StdinData,
                timeout_s: float | None, groups: ProcessGroups, exec_argv: list[str] | None) -> ProcessResult:
        """``run``, on ``parent`` (``control``: its control socket)."""
        try:
            pid, stdin_write, output_read, reply, parent = self._start_run(parent, control, env, exec_argv)
        except _RunNotStarted as err:
            # Started here, before the batch is given back: the scheduler looks at its requests' deadlines once the
            # wait for the new parent (its preloads imported again, a second or more) is over, not before it.
            # (A ModelFailure when none can be started: the batch's; Unavailable once the model was unloaded.)
            self._running_control()
            raise NotStarted(err.failure) from None
        # timeout_s bounds the run from its fork, as a cold run's from its start: a parent restarted first (its
        # preloads imported again, a second or more) had taken it all, and the run was killed at once, "timed out
        # after 0.5 s" (the warm-start hunt).
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with reply:
            groups.add(pid)
            try:
                exited, tail = feed_and_wait(stdin_write, stdin, reply.fileno(), deadline, output_read)
                if not exited:
                    kill_group(pid)  # still running, so not reaped: the group id is still its own
                    reply.settimeout(STOP_GRACE_S)  # a parent that answers reports the killed run at once
                ended = _receive(reply)
            finally:
                terminated = groups.discard(pid)
        if ended.get("silent"):
            # Not killed for it: its other runs may be fine and about to report. A parent really wedged fails
            # the next batch's fork request, and is replaced then.
            raise timed_out(self.name, timeout_s, f"its process group was killed, but its {self.called} process "
                                                  f"(pid {parent.pid}) did not report its end within "
                                                  f"{STOP_GRACE_S:g} s (stopped or wedged?)", self.config_name, tail)
        if "status" not in ended:
            raise self._died(parent, "it ended while the run was in progress")
        if ended["status"] == FOLDER_NOT_ENTERED_EXIT and exited and not terminated:
            refused = folder_not_entered(tail)
            if refused is not None:
                raise refused
        return ProcessResult(ended["status"], not exited, tail, terminated)

    @staticmethod
    def _kill_silent(process: subprocess.Popen) -> int:
        """Kill ``process``, a parent alive but not answering (stopped, wedged): the next batch starts a new one
        rather than wait on it again. Its pid. (The one the batch went to: another thread may have replaced
        ``self._process`` since.)"""
        kill_group(process.pid)  # its runs die with it (each has it as its death signal's parent)
        # Reaped before the failure is told: the next batch must find it dead (poll), not send itself to it while
        # the kill is still under way (then it went to a new parent only after a refused send, logged so).
        wait_for_exit(process, STOP_GRACE_S)
        return process.pid

    def _start_run(self, parent: subprocess.Popen, control: socket.socket, env: dict[str, str],
                   exec_argv: list[str] | None) -> tuple[int, int, int, socket.socket, subprocess.Popen]:
        """Hand ``parent`` (``control``: its control socket) one run: its child's pid, our ends of its stdin and
        output pipes, the reply socket, and the parent it went to.

        Raises _RunNotStarted when the parent is gone before it said it forked
        the run.
        """
        stdin_read, stdin_write, output_read, output_write, reply, theirs = _run_channels()
        folder_fd = self.folder_fd  # read once: a relocate may replace it meanwhile
        try:
            try:
                message = run_request(env, str(self.folder), exec_argv)
                socket.send_fds(control, [message], [stdin_read, output_write, theirs.fileno(),
                                                     *([folder_fd] if folder_fd is not None else [])])
            except OSError as err:
                if err.errno == errno.EMSGSIZE:
                    # The run's own size, not the parent's fault: said at once, the parent left alone (it used
                    # to wait 5 s for a live parent, then call it unresponsive).
                    raise ModelFailure(
                        f"model '{self.name}': this run's request to its {self.called} ({len(message)} bytes: its "
                        "environment, with every tensor name, dtype and shape) is more than one message of a "
                        "local socket holds here (net.core.wmem_default); shorten the tensor names") from None
                raise self._not_started(parent, f"sending it the run failed: {err.strerror or err}") from None
            finally:
                os.close(stdin_read)
                os.close(output_write)
                theirs.close()
            reply.settimeout(REPLY_TIMEOUT_S)
            started = _receive(reply)
            if "error" in started:  # the parent is fine, but could not start this run (a fork failed)
                if started.get("errno") in SERVER_LIMITS:  # (a process limit: the server's, as a cpp run's is)
                    raise run_not_started(self.name, started["errno"], str(started.get("strerror", "")))
                raise ModelFailure(f"model '{self.name}': its {self.called} could not start the run: "
                                   f"{started['error']}")
            if started.get("silent"):  # alive (stopped, wedged): killed, and the batch not sent again
                raise ModelFailure(f"model '{self.name}': its {self.called} process "
                                   f"(pid {self._kill_silent(parent)}) did not answer within {REPLY_TIMEOUT_S:g} s; "
                                   "the batch was not run; the parent was killed, and the next batch starts a new one")
            if "pid" not in started:
                raise self._not_started(parent, "it did not fork the run")
        except BaseException:
            os.close(stdin_write)
            os.close(output_read)
            reply.close()
            raise
        return started["pid"], stdin_write, output_read, reply, parent

    def _take_parent(self) -> tuple[subprocess.Popen, socket.socket, bool]:
        """The running parent for a run (as ``_running_control``), its control socket, and whether its runs are
        cold; counted as the run's until ``_let_go``. Starts the next try at warm start again when one is due."""
        with self._lock:
            process, control = self._running()
            self._in_flight[process] = self._in_flight.get(process, 0) + 1
            if self._retry is not None and self._retry.due(time.monotonic()):
                self._start_retry(self._retry)
            return process, control, self.cold_reason is not None

    def _let_go(self, process: subprocess.Popen) -> None:
        """A run handed ``process`` (by ``_take_parent``) is over: a parent replaced meanwhile ends with the last
        of its runs."""
        with self._lock:
            left = self._in_flight[process] - 1
            if left:
                self._in_flight[process] = left
                return
            del self._in_flight[process]
            control = self._retiring.pop(process, None)
        if control is not None:
            _retire(process, control)

    def _running_control(self) -> tuple[subprocess.Popen, socket.socket]:
        """The running parent (started, or restarted if found dead) and its control socket; Unavailable once
        stopped (the model was unloaded: a parent started now would be left running for a model that is gone)."""
        with self._lock:
            return self._running()

    def _running(self) -> tuple[subprocess.Popen, socket.socket]:
        """``_running_control``, under the lock."""
        if self._stopped:
            raise Unavailable(f"model '{self.name}' was unloaded (removed, replaced by a new version, or the "
                              f"server stopping) before this batch could run: its {self.called} process was "
                              "stopped; the batch was not run")
        if self._process is not None and self._process.poll() is not None:
            self._forget(self._process, "starting a new one")
        if self._process is None:
            self._restart()
        assert self._process is not None and self._control is not None
        return self._process, self._control

    def _forget(self, process: subprocess.Popen, then: str) -> None:
        """Let go of ``process``, our parent found exited (and reaped): its control socket and lifeline are
        closed. Under the lock."""
        log.warning("model '%s': %s (pid %d) %s; %s", self.name, self.called, process.pid,
                    _describe_exit(process.returncode), then)
        assert self._control is not None
        self._control.close()
        if process.stdin is not None:
            process.stdin.close()
        self._process = self._control = None

    def _parent_exited(self, process: subprocess.Popen) -> bool:
        """Told by the exit watcher that ``process``, a parent of ours, has exited: reap it and close its
        descriptors now, not at the model's next batch (a model may stay idle for hours). The next batch starts
        a new one, as ever. False when that cannot be done at once (another thread holds the parent, and may
        well be clearing it itself): the watcher asks again shortly."""
        if not self._lock.acquire(blocking=False):  # a start holds it for as long as its imports take
            return False
        try:
            if self._process is not process:  # stopped, or found dead by a batch: reaped already
                return True
            if process.poll() is None:  # a thread waiting on it holds its waitpid lock: it reaps it
                return False
            self._forget(process, "the model's next batch starts a new one")
            return True
        finally:
            self._lock.release()

    def _restart(self) -> None:
        """Start a parent for a batch that found none running (the last one died). Under the lock.

        A parent that dies while it starts (killed again, as an out-of-memory
        killer acting twice does) tells nothing about its imports: another one
        is started for the batch, which had not run, as a batch whose parent
        died before forking it is sent once more. Should that one die too (or
        one be silent until START_TIMEOUT_S), the batch fails saying how it
        ended, and the next batch tries warm again. Only the parent's own answer
        (a preload that now fails, starts a thread or initialises CUDA) turns
        warm start off, or MAX_START_DEATHS parents in a row ending so: one that
        always dies is not started again at every batch. Off until a try at
        warm start again, later, succeeds (``_try_warm_again``).

        Nor does a parent the server cannot start at all (WarmParentBlocked:
        its folder cannot be prepared, a resource limit): a parent that
        preloads nothing would meet it just the same, so the batch fails, and
        the next one tries a warm parent again (a failed mkdir or fork: cheap).
        """
        for attempt in (1, 2):
            try:
                self._start()
                self._start_deaths = 0
                self._unblocked()
                return
            except WarmParentBlocked as err:
                raise self._blocked_failure(err) from None
            except WarmParentDied as err:
                self._start_deaths += 1
                if self._start_deaths >= MAX_START_DEATHS and self.modules and self.cold_argv is not None:
                    self._go_cold("its warm parents keep ending while they start",
                                  f"{self._start_deaths} warm parents in a row ended while starting, the last one "
                                  f"{err.how}")
                    return
                if attempt == 2 or err.timed_out:  # (one silent for minutes is not waited on twice per batch)
                    fault = ModelKilled if err.killed else ModelFailure
                    raise fault(f"model '{self.name}': its new {self.called} process {err.how} while starting"
                                f"{', as did the one started before it' if attempt == 2 else ''}; the batch was "
                                "not run, and the next batch starts a new one") from None
                log.warning("model '%s': %s; starting another for the batch", self.name, err)
            except WarmStartUnavailable as err:
                if not self.modules or self.cold_argv is None:
                    raise ModelFailure(f"model '{self.name}': its {self.called} could not be restarted: "
                                       f"{err}") from None
                # Its imports changed under it (one now fails, starts a thread or initialises CUDA): run cold from
                # now on, as a load finding the same would.
                self._go_cold("its restarted warm parent cannot preload", str(err))
                return

    def start_cold_for_now(self, reason: str) -> None:
        """Start for a load whose warm parents ended as they started (``reason``), twice: an out-of-memory
        killer at a busy start, as at a restart, tells nothing about the imports. Runs are cold, and warm start is
        tried again later, as after a restart's (see ``_go_cold``); WarmStartUnavailable if no parent starts."""
        with self._lock:
            self._stopped = False
            self._cold_with_retry("its warm parents ended as they started while it loaded", reason,
                                  at_load=True)
            self._start()

    def _go_cold(self, what: str, reason: str) -> None:
        """Run each batch in a fresh interpreter, forked by a parent that preloads nothing, for ``reason`` (shown by
        ``nereid check``), until a try at warm start again succeeds (see ``_try_warm_again``). Under the lock."""
        self._cold_with_retry(what, reason, at_load=False)
        try:
            self._start()
            self._unblocked()
        except WarmParentBlocked as again:
            raise self._blocked_failure(again) from None
        except WarmStartUnavailable as again:
            fault = ModelKilled if isinstance(again, WarmParentDied) and again.killed else ModelFailure
            raise fault(f"model '{self.name}': its {self.called} could not be restarted: {again}") from None

    def _cold_with_retry(self, what: str, reason: str, at_load: bool) -> None:
        """Make runs cold for ``reason`` (``what`` happened), warm start to be tried again after a back-off; said
        at WARNING. The parent is the caller's to start. Under the lock."""
        now = time.monotonic()
        doublings = 0
        if self._came_back is not None and now - self._came_back[0] < WARM_RETRY_MAX_S:
            doublings = self._came_back[1] + 1  # back a short while ago: not tried again sooner than the last time
        retry = _WarmRetry(self.modules, now, doublings)
        log.warning("model '%s': %s (%s); every batch starts a fresh interpreter until warm start is back: a warm "
                    "parent is tried again at the first batch after %g s", self.name, what, reason, retry.wait_s())
        self.modules, self.cold_reason, self._retry = Preloads(), reason, retry
        self.cold_since_load = at_load

    def _start_retry(self, retry: _WarmRetry) -> None:
        """Start the next try at warm start again on a thread of its own, which the batch that starts it does not
        wait for: batches run cold until its parent is ready. Under the lock; never raises (the batch runs on)."""
        # Started by a batch rather than a timer: a model with no traffic costs nothing, and only batches gain.
        thread = threading.Thread(target=self._try_warm_again, args=(retry,), name=f"nereid-warm-retry-{self.name}",
                                  daemon=True)
        retry.thread = thread
        try:
            thread.start()
        except RuntimeError as err:  # no thread can be started now (a process limit): a try that failed
            retry.thread = None
            self._retry_failed(retry, f"no thread could be started for it: {err}")

    def _try_warm_again(self, retry: _WarmRetry) -> None:
        """One try at warm start again (on its own thread): a warm parent that preloads what the model's did is
        started beside the cold one, which serves on meanwhile, then swapped in (``_swap_in``)."""

        def started(process: subprocess.Popen | None) -> None:
            with self._lock:
                if self._retry is retry or process is None:
                    # (None, about to be reaped, whatever happened meanwhile: an unload's stop that killed it left
                    # it here, and the failure below killed the group of a pid reaped already; the warm-retry hunt.)
                    retry.starting = process
                else:  # the model was unloaded meanwhile: its stop did not see this one
                    kill_group(process.pid)

        try:
            process, control = self._launch(retry.modules, "warm parent", started)
        except Exception as err:  # WarmStartUnavailable: it died or cannot preload; anything else alike
            reason = str(err) if isinstance(err, WarmStartUnavailable) else f"{type(err).__name__}: {err}"
            with self._lock:
                retry.thread = None
                leftover, retry.starting = retry.starting, None  # (None unless it failed in an unforeseen way)
                self._retry_failed(retry, reason)
            if leftover is not None:
                kill_group(leftover.pid)
                _end(leftover)
            return
        self._swap_in(retry, process, control)

    def _retry_failed(self, retry: _WarmRetry, reason: str) -> None:
        """Stay cold after a try at warm start again that failed for ``reason``, and wait twice as long for the next
        (up to WARM_RETRY_MAX_S). Under the lock."""
        if self._retry is not retry:  # the model was unloaded meanwhile: nothing is tried again
            return
        retry.since, retry.doublings, retry.failed = time.monotonic(), retry.doublings + 1, retry.failed + 1
        log.warning("model '%s': a try at warm start again failed (%s); runs stay cold, the next try at the first "
                    "batch after %g s", self.name, reason, retry.wait_s())

    def _swap_in(self, retry: _WarmRetry, process: subprocess.Popen, control: socket.socket) -> None:
        """Make ``process``, the ready warm parent of ``retry``, the running one: batches from now on are forked
        from it; the cold parent is ended once its runs in progress are over (by the last, in ``_let_go``)."""
        with self._lock:
            retry.thread = retry.starting = None
            if self._stopped or self._retry is not retry:  # unloaded meanwhile: ours to end, not to serve with
                old, old_control = process, control
            else:
                old, old_control = self._process, self._control
                self._adopt(process, control)
                self.modules, self.cold_reason, self._retry = retry.modules, None, None
                self._start_deaths, self._blocked = 0, None
                self._came_back = (time.monotonic(), retry.doublings)
                if old is not None and self._in_flight.get(old):
                    self._retiring[old], old = old_control, None
                log.warning("model '%s': warm start is back: a new warm parent (pid %d) started%s; batches are "
                            "forked from it, and the cold parent ends once its runs in progress are over",
                            self.name, process.pid,
                            f" after {retry.failed} failed {'try' if retry.failed == 1 else 'tries'}"
                            if retry.failed else "")
        if old is not None:
            assert old_control is not None
            _retire(old, old_control)

    def retry_state(self) -> str | None:
        """Where trying warm start again stands (``tried again at the first batch in 25 s``), while runs are cold
        since a restart; None otherwise. Read without the lock: a report must not wait for a restart."""
        retry = self._retry
        return retry.describe() if retry is not None else None

    def _blocked_failure(self, err: WarmParentBlocked) -> NereidError | FolderNotEntered:
        """The failure of a batch whose restart could not start a parent, for ``err``; logged once until a parent
        starts again. Under the lock. A parent that could not enter the model folder is a run refused by it:
        FolderNotEntered, which the model names as such (not logged here: each batch's failure is)."""
        if err.folder_error is not None:
            return FolderNotEntered(err.folder_error)
        if self._blocked is None:
            log.warning("model '%s': its %s process could not be restarted (%s); batches fail until one "
                        "can be, each trying again", self.name, self.called, err)
        self._blocked = str(err)
        if err.cause is not None and err.cause.errno in SERVER_LIMITS:
            # A limit of the server's, as a run's child not forked (the review hunt: INTERNAL, a model's fault).
            return run_not_started(self.name, err.cause.errno, err.cause.strerror or str(err.cause))
        return ModelFailure(f"model '{self.name}': its {self.called} process could not be restarted: {err}; the "
                            "batch was not run, and the next batch tries again")

    def _unblocked(self) -> None:
        """Say once that a parent started again after restarts that could not start one. Under the lock."""
        if self._blocked is None:
            return
        self._blocked = None
        warm = "warm start is back" if self.cold_reason is None else f"runs stay cold ({self.cold_reason})"
        log.info("model '%s': a new %s process (pid %s) started; batches run again, %s", self.name,
                 self.called, self.pid, warm)

    def _not_started(self, process: subprocess.Popen, what: str) -> ModelFailure | _RunNotStarted:
        """The failure of a run ``process`` (its parent) never started (its end of the sockets closed):
        _RunNotStarted (sent again) once the parent has exited; the failure itself should it still run after the
        grace (no new parent is started for a running one, so sending the batch again would go to it once more)."""
        failure = self._died(process, what)
        return _RunNotStarted(failure) if process.poll() is not None else failure

    def _died(self, process: subprocess.Popen, what: str) -> ModelFailure:
        """The failure of a run whose parent, ``process``, died; the parent is reaped so the reason is known:
        ModelKilled when a signal ended it (the OOM killer's SIGKILL, a crash), a plain ModelFailure otherwise.
        (The parent the run went to: by now the exit watcher may have let go of it.)"""
        # The socket closed, so the parent is exiting right now.
        if wait_for_exit(process, STOP_GRACE_S):
            reason = _describe_exit(process.returncode)
            fault = ModelKilled if process.returncode < 0 else ModelFailure
        else:
            reason, fault = "stopped answering", ModelFailure
        if process in self._retiring:  # (read without the lock: only what a message says hangs on it)
            # The cold parent that warm start came back from, ending with its last runs: not restarted, and not the
            # warm parent "called" now names (the warm-retry hunt).
            return fault(f"model '{self.name}': its parent process {reason} ({what}), as warm start came back; "
                         "the next request goes to its new warm parent")
        return fault(f"model '{self.name}': its {self.called} process {reason} ({what}); "
                     "it is restarted for the next request")


class _RunNotStarted(Exception):
    """The parent was gone before it said it forked the run: sending the batch again runs it once (see
    NotStarted). ``failure`` is what the run fails with if it cannot be sent again."""

    def __init__(self, failure: ModelFailure) -> None:
        super().__init__(str(failure))
        self.failure = failure


class _ExitWatcher:
    """Notices warm parents that exit while their model is idle (killed by the out-of-memory killer, say), so
    that each is reaped and its control socket and lifeline closed at once: a batch would otherwise be the first
    to look, and a rarely used model kept a zombie and two descriptors for as long as it had no traffic.

    One daemon thread for every parent of the process, waiting on their
    pidfds (as ``wait_for_exit`` waits on one); it runs only while there are
    parents to watch. A pidfd is the watcher's own, closed once its parent has
    exited, so a parent's own descriptors are never polled while it closes them.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: dict[int, tuple[WarmParent, subprocess.Popen]] = {}  # by pidfd
        self._thread: threading.Thread | None = None
        self._wake: tuple[int, int] | None = None  # a pipe that has the thread look at _watched again

    def watch(self, parent: WarmParent, process: subprocess.Popen) -> None:
        """Have ``parent`` told (``_parent_exited``) when ``process``, its running parent and our child, exits."""
        try:
            pidfd = os.pidfd_open(process.pid)  # not reaped yet (nothing but its owner reaps it), so still ours
        except OSError as err:  # out of descriptors: its next batch finds it dead, as ever
            log.debug("model '%s': %s (pid %d) not watched: %s", parent.name, parent.called, process.pid, err)
            return
        with self._lock:
            self._watched[pidfd] = (parent, process)
            if self._wake is None:
                self._wake = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            if self._thread is None:
                self._start_thread(parent)
                return
        try:
            os.write(self._wake[1], b"\0")
        except BlockingIOError:  # full of wake-ups the thread has yet to read: it looks again anyway
            pass

    def _start_thread(self, parent: WarmParent) -> None:
        """Start the watching thread, for ``parent`` just watched; when it cannot start (a process or thread
        limit), say so and leave it to the next watch, the pidfds kept. Under the lock.

        Kept as started before it was: an unstarted thread kept here passed
        for a running one, so no watch ever started one again, and the load
        that met the limit failed (the resource-limits hunt).
        """
        thread = threading.Thread(target=self._run, name="nereid-warm-parent-exits", daemon=True)
        try:
            thread.start()
        except RuntimeError as err:  # ("can't start new thread")
            log.warning("model '%s': the thread that notices warm parents exiting while idle could not start (%s: "
                        "%s); it is started again at the next parent's start, and until then a parent that dies "
                        "while its model is idle is reaped at the model's next batch", parent.name, err,
                        thread_start_hint())
            return
        self._thread = thread

    def _run(self) -> None:
        busy: list[tuple[WarmParent, subprocess.Popen]] = []  # exited, but their model held them: asked again
        while True:
            with self._lock:
                if not self._watched and not busy:
                    self._thread = None  # a watch from now on starts another thread
                    return
                assert self._wake is not None
                wake, pidfds = self._wake[0], list(self._watched)
            poller = select.poll()
            for fd in (wake, *pidfds):
                poller.register(fd, select.POLLIN)
            ready = {fd for fd, _ in poller.poll(int(WATCH_RETRY_S * 1000) if busy else None)}
            if wake in ready:
                while True:
                    try:
                        if not os.read(wake, 4096):
                            break
                    except BlockingIOError:
                        break
            exited = []
            with self._lock:
                for fd in ready & self._watched.keys():
                    exited.append(self._watched.pop(fd))
                    os.close(fd)
            busy = [(parent, process) for parent, process in busy + exited if not parent._parent_exited(process)]


_EXITS = _ExitWatcher()


def folder_not_entered(tail: str) -> FolderNotEntered | None:
    """The refusal a run's child reported (exit status :data:`FOLDER_NOT_ENTERED_EXIT`) when ``tail``, the run's
    output, ends with its line (:data:`FOLDER_NOT_ENTERED_LINE`); None when it does not (main.py's own exit)."""
    last = tail.rsplit("\n", 1)[-1]
    if not last.startswith(FOLDER_NOT_ENTERED_LINE):
        return None
    number, _, strerror = last.removeprefix(FOLDER_NOT_ENTERED_LINE).partition(" ")
    if not number.isdigit():
        return None
    code = int(number)
    return FolderNotEntered(OSError(code, strerror or os.strerror(code)))


def _run_channels() -> tuple[int, int, int, int, socket.socket, socket.socket]:
    """A run's stdin pipe, output pipe and reply socket pair: ``(stdin_read, stdin_write, output_read,
    output_write, reply, theirs)``, all close-on-exec.

    All or none: when one cannot be made (EMFILE, the server out of
    descriptors) those made before it are closed, or each failed run would leak
    them and the server would stay out of descriptors for good.
    """
    stdin_read, stdin_write, output_read, output_write = opened = open_pipes(2)
    try:
        reply, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    except BaseException:
        close_descriptors(*opened)
        raise
    return stdin_read, stdin_write, output_read, output_write, reply, theirs


def _startup_warnings(line: str | None) -> tuple[str | None, list[str]]:
    """A parent's start-up answer without what follows ``ready`` (``ready {"warnings": [...]}``), and those
    warnings: what its preloaded imports warned, each as Python shows it."""
    if line is None or not line.startswith("ready "):
        return line, []
    try:
        told = json.loads(line.removeprefix("ready "))["warnings"]
    except (ValueError, KeyError, TypeError):
        return "ready", []
    return "ready", [str(text) for text in told] if isinstance(told, list) else []


def _read_line(fd: int, deadline: float) -> str | None:
    """One line from ``fd`` (the parent's stdout), waiting at most until ``deadline``: "" when it closed with
    none, None at the deadline."""
    data = b""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while b"\n" not in data:
        remaining_ms = int((deadline - time.monotonic()) * 1000)
        if remaining_ms <= 0 or not poller.poll(remaining_ms):
            return None
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        data += chunk
    return data.split(b"\n", 1)[0].decode("utf-8", errors="replace").strip()


def _receive(reply: socket.socket) -> dict:
    """One message from the parent; {} when the parent is gone, ``{"silent": True}`` when it did not answer
    within the reply socket's timeout."""
    try:
        message = reply.recv(MAX_REPLY_BYTES)
    except TimeoutError:
        return {"silent": True}
    except OSError:
        return {}
    return json.loads(message) if message else {}


def _retire(process: subprocess.Popen, control: socket.socket) -> None:
    """End ``process``, a parent replaced whose runs are all over, and close our end of its control socket."""
    control.close()
    _end(process)


def _end(process: subprocess.Popen) -> None:
    """Close the lifeline (the parent then kills its children and exits), kill it if it lingers, reap it."""
    if process.stdin is not None:
        process.stdin.close()
    if not wait_for_exit(process, STOP_GRACE_S):
        kill_group(process.pid)
        process.wait()


def _describe_exit(returncode: int) -> str:
    return ProcessResult(returncode, False, "").describe()
