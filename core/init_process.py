"""nereid's own init, for a ``nereid serve`` that is PID 1 (a container's entrypoint, without ``--init``).

The kernel hands every orphan of a PID namespace to its PID 1, which must reap
it: a cpp run's forked helper, what a killed warm parent's runs had detached.
The server cannot reap them itself: a catch-all ``waitpid(-1)`` would take the
exit statuses of its own runs from ``subprocess`` (which then reads ECHILD as
status 0). So, as tini and ``docker run --init`` do, PID 1 forks the server and
becomes an init that does nothing else: it forwards the signals the server
stops on, reaps every child, and exits with the server's status.

This module imports nothing of the server's: the init keeps what its process
had imported before the fork, and touches none of it.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys

from nereid.processes import stop_signals

# Set to 1 where the container already has an init (tini, ``docker run --init``): serve then stays PID 1 itself.
NO_INIT_VARIABLE = "NEREID_NO_INIT"


def exit_status(wait_status: int) -> int:
    """The status a shell gives a process that ended with ``wait_status``: its code, or 128 + the signal."""
    code = os.waitstatus_to_exitcode(wait_status)
    return 128 - code if code < 0 else code


def fork_init_if_pid_1() -> None:
    """When this process is PID 1, fork: the child returns and serves; this process becomes the init, never returns.

    Call it before any thread starts (the child keeps only the calling one).
    Nothing happens when the process is not PID 1, or with ``NEREID_NO_INIT=1``.
    """
    if os.getpid() != 1 or os.environ.get(NO_INIT_VARIABLE) == "1":
        return
    forwarded = stop_signals()  # (as the server takes them: an ignored SIGHUP, nohup's, stays so)
    # Blocked from before the fork until sigtimedwait takes them: a signal to a PID 1 with no handler is dropped
    # by the kernel, unless blocked (then it waits, pending). Blocking SIGCHLD queues it in the same way.
    waited = {*forwarded, signal.SIGCHLD}
    before = signal.pthread_sigmask(signal.SIG_BLOCK, waited)
    for stream in (sys.stdout, sys.stderr):  # what they buffered is written once, not again by the child
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # (closed, or no stream at all)
            pass
    try:
        server = os.fork()
    except OSError as err:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
        logging.getLogger(__name__).warning(
            "running as PID 1 without an init: cannot fork one (%s); orphans the kernel hands this process will "
            "stay zombies (run it under tini or docker run --init)", err)
        return
    if server == 0:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
        logging.getLogger(__name__).info(
            "running under nereid's own init (PID 1): it reaps the orphans the kernel hands PID 1 and forwards %s "
            "(%s=1 turns it off)",
            ", ".join(signum.name for signum in forwarded), NO_INIT_VARIABLE)
        return
    os._exit(_init(server, forwarded, waited))


def _init(server: int, forwarded: list[signal.Signals], waited: set[signal.Signals]) -> int:
    """Forward ``forwarded`` to ``server`` and reap every child until ``server`` has ended; its exit status."""
    # The init shares the server's memory pages until one of them writes: a collection here would copy them all.
    gc.disable()
    # An ignored SIGCHLD (inherited) would have the kernel reap the server before its status could be read.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    while True:
        info = signal.sigtimedwait(waited, 1.0)  # (a timeout as well: a lost SIGCHLD still gets its reaping)
        if info is not None and info.si_signo != signal.SIGCHLD:
            try:
                os.kill(server, info.si_signo)
            except ProcessLookupError:  # (ended: its status is reaped next)
                pass
        while True:
            try:
                pid, wait_status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:  # (no child left, the server's status not seen: it cannot be, but no hang)
                return 1
            if pid == 0:
                break
            if pid == server:
                return exit_status(wait_status)
