"""How a ``nereid`` process stops: the signals it takes as a stop, and the child processes it leaves behind.

Ending children is only for a process that *is* the server (``nereid serve``) or
the check: a model load abandoned at SIGTERM may have started a program (a
compiler, a warm process) whose owner never got a chance to stop it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import NoReturn


def not_ignored(*signums: signal.Signals) -> list[signal.Signals]:
    """Those of ``signums`` this process does not ignore.

    An ignored SIGHUP (``nohup nereid serve``) or SIGINT (``nereid check &`` in a
    script) was asked for by whoever started the process: it stays ignored.
    """
    return [signum for signum in signums if signal.getsignal(signum) is not signal.SIG_IGN]


def stop_signals() -> list[signal.Signals]:
    """The signals a ``nereid`` process stops on: SIGTERM, and SIGINT and SIGHUP (a closed terminal, a dropped ssh
    session) unless it was started ignoring them (``nereid serve &`` in a script, ``nohup``; serve drained on an
    ignored SIGINT, where check went on: the CLI hunt)."""
    return [signal.SIGTERM, *not_ignored(signal.SIGINT, signal.SIGHUP)]


# Stop signals that came while ``nereid serve`` imported what it serves with, and the handlers they replaced (see
# record_early_stops); None when nothing records them.
_early_stops: list[signal.Signals] = []
_replaced: dict[signal.Signals, object] | None = None


def record_early_stops(signums: list[signal.Signals]) -> None:
    """Record ``signums`` rather than die of them, until :func:`release_early_stops`: ``nereid serve`` spends its
    first half second importing what it serves with, and a SIGTERM then ended it with 143 (no line, no clean-up).
    On the main thread only (where handlers can be set; elsewhere this does nothing)."""
    global _replaced
    if threading.current_thread() is not threading.main_thread() or _replaced is not None:
        return
    _early_stops.clear()
    # (A handler set outside Python reads as None and could not be put back: that signal is left as it is. An
    # ignored one stays ignored, as whoever started the process asked: a SIGINT that reached `nereid check &` in a
    # script during its imports, recorded, ended it; the hunt of the redelivery.)
    _replaced = {signum: handler for signum in signums
                 if (handler := signal.getsignal(signum)) is not None and handler is not signal.SIG_IGN}
    for signum in _replaced:
        signal.signal(signum, _record_early_stop)


def _record_early_stop(signum: int, frame: object) -> None:
    if _early_stops:
        # A second stop while still importing: the first waited for the command to be able to act on it, and an
        # import that never returns (a plugin's, hung on a network mount) would keep it waiting for ever, Ctrl-C
        # pressed twice included (the hunt of the console script's fix). The second is taken to mean it: nothing
        # that needs a clean-up has been started yet.
        _say(f"nereid: {signal.Signals(signum).name} again while starting: stopping now\n")
        die_of(signal.Signals(signum))
    _early_stops.append(signal.Signals(signum))


def _say(line: str) -> None:
    try:
        os.write(2, line.encode())
    except OSError:  # (no stderr left: the exit status still says it)
        pass


def die_of(signum: signal.Signals) -> NoReturn:
    """End this process as ``signum``'s default action does (its wait status names the signal: a shell says 143 for
    SIGTERM, 130 for SIGINT; no KeyboardInterrupt traceback), or, where the kernel gives that signal no default
    action (a PID namespace's init, a container's PID 1), exit with 128 + its number. Never returns."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
    signal.raise_signal(signum)
    os._exit(128 + signum)  # (still here: the default is ignored in this process)


def redeliver_early_stops() -> None:
    """Put back the handlers :func:`record_early_stops` replaced, and end the process as the first stop signal it
    recorded would have (:func:`die_of`): for a command that does not start a server, a stop during its imports
    acts as the signal does (143 for SIGTERM, 130 without a traceback for Ctrl-C), only later; as PID 1 too, where
    raising it again was ignored and the command ran on."""
    came = release_early_stops()
    if came is not None:
        die_of(came)


def release_early_stops() -> signal.Signals | None:
    """Put back the handlers :func:`record_early_stops` replaced, and return the first stop signal it recorded
    (None if none came, or nothing was recording). Called before the server starts: from there a signal acts as
    it did before (the server sets its own handlers as it serves), and a start that a stop came during does not
    begin; and on every other way out of ``serve``, so an in-process caller gets its handlers back."""
    global _replaced
    if _replaced is None:
        return None
    for signum, handler in _replaced.items():
        signal.signal(signum, handler)  # type: ignore[arg-type]
    _replaced = None
    came = _early_stops[0] if _early_stops else None
    _early_stops.clear()
    return came


def child_pids(parent: int | None = None) -> list[int]:
    """PIDs of the live (not zombie) children of ``parent`` (default: this process), from /proc."""
    parent = os.getpid() if parent is None else parent
    children = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == parent and fields[0] != b"Z":
            children.append(int(entry))
    return children


_NO_NEW_CHILDREN = threading.Event()


def stop_new_children() -> None:
    """The process ends next (``nereid serve`` has stopped): work still waiting to start a child (a compile
    waiting for its slot) must not, since :func:`kill_children` has run or is about to."""
    _NO_NEW_CHILDREN.set()


def new_children_stopped() -> bool:
    """Whether :func:`stop_new_children` was called."""
    return _NO_NEW_CHILDREN.is_set()


def kill_children() -> int:
    """SIGKILL every child of this process, with its process group when it leads its own; the count."""
    own_group = os.getpgrp()
    killed = 0
    for pid in child_pids():
        try:
            group = os.getpgid(pid)
            if group == pid and group != own_group:
                os.killpg(group, signal.SIGKILL)  # a child that leads a group: its descendants too
            else:
                os.kill(pid, signal.SIGKILL)
            killed += 1
        except (ProcessLookupError, PermissionError):
            continue
    return killed
