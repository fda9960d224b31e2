"""What a cxx library must leave as it found it in the server's process: how signals are handled, and the
working folder.

A cxx library runs in the server's own process, and its static constructors and
``nereid_load`` can change what is the whole process's (the native-models hunt):

* ``signal(SIGCHLD, SIG_IGN)``, which libraries that start helpers use against
  zombies, lets the kernel reap every child itself: each cpp run that failed
  then read as exiting 0, and one that wrote its output and exited 3 was served;
* a crash-reporting library's own SIGTERM handler (glog's, say) ended the
  server at once on SIGTERM, with no drain;
* ``chdir(model_folder)`` moved every later relative path, a cxx model's
  library named relative to nereid.yaml among them.

:func:`process_state_kept` puts each back as it was, and says which model's
library changed it. The dispositions are read and written with the C library's
``sigaction``, which sees what a library set with ``signal()`` (Python's
``signal.getsignal`` tells only what Python set) and works on any thread. A
signal whose handling Python itself changed meanwhile (the server's stop, on
the loop's thread) is the server's doing, and is left as it is.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import itertools
import logging
import os
import signal
import threading
from typing import Iterator

log = logging.getLogger(__name__)

# The signals whose handling is the server's: children's exits (reaped and read by cpp and python runs), the stop
# signals it drains on, the ones Python ignores from the start (SIGPIPE, SIGXFSZ), and those faulthandler reports.
GUARDED_SIGNALS = tuple(signal.Signals[name] for name in (
    "SIGCHLD", "SIGTERM", "SIGINT", "SIGHUP", "SIGPIPE", "SIGXFSZ", "SIGSEGV", "SIGABRT", "SIGBUS", "SIGFPE",
    "SIGILL"))
# Room for any C library's struct sigaction (glibc and musl on x86-64 and arm64: 152 bytes or less), read and
# written back whole. Its first field is the handler (SIG_DFL, SIG_IGN or a function), the one compared: the rest
# of the bytes a read gives back are not all set by the C library (glibc's mask past the kernel's 64 signals).
_SIGACTION_BYTES = 512
_HANDLER_BYTES = ctypes.sizeof(ctypes.c_void_p)

_sections_lock = threading.Lock()
# Each section under way: its model, and the models whose sections ran beside it.
_sections: dict[int, tuple[str, set[str]]] = {}
_section_ids = itertools.count()


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.sigaction.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
    return libc


_LIBC = _libc()


def _dispositions() -> dict[signal.Signals, bytes]:
    """How each guarded signal is handled now, as the C library's ``sigaction`` says (opaque bytes)."""
    found = {}
    for signum in GUARDED_SIGNALS:
        action = ctypes.create_string_buffer(_SIGACTION_BYTES)
        if _LIBC.sigaction(signum, None, action) == 0:
            found[signum] = action.raw
    return found


def _python_handlers() -> dict[signal.Signals, object]:
    """What Python holds as each guarded signal's handler (what its own ``signal.signal`` calls set)."""
    return {signum: signal.getsignal(signum) for signum in GUARDED_SIGNALS}


def _put_back(signum: signal.Signals, raw: bytes) -> None:
    action = ctypes.create_string_buffer(raw, _SIGACTION_BYTES)
    if _LIBC.sigaction(signum, action, None) != 0:
        log.error("cannot put back the handling of %s: %s", signum.name, os.strerror(ctypes.get_errno()))


@contextlib.contextmanager
def process_state_kept(model: str, what: str) -> Iterator[None]:
    """Run the block (``what`` model ``model``'s library does: ``opening its shared library``, ``its nereid_load``)
    and put back, each with a WARNING, the signal handling and the working folder it changed."""
    with _sections_lock:
        section = next(_section_ids)
        for _, beside in _sections.values():
            beside.add(model)
        _sections[section] = (model, {other for other, _ in _sections.values()})
    before, python_before, folder = _dispositions(), _python_handlers(), _working_folder()
    try:
        yield
    finally:
        after, python_after = _dispositions(), _python_handlers()
        changed = [signum for signum, raw in before.items()
                   if (after.get(signum) or b"")[:_HANDLER_BYTES] != raw[:_HANDLER_BYTES]
                   and python_after[signum] is python_before[signum]]
        for signum in changed:
            _put_back(signum, before[signum])
        moved = folder is not None and _working_folder() != folder
        if moved:
            os.chdir(folder)
        with _sections_lock:
            beside = _sections.pop(section)[1] - {model}
        if changed or moved:
            _warn(model, what, [signum.name for signum in changed], folder if moved else None, sorted(beside))


def _working_folder() -> str | None:
    try:
        return os.getcwd()
    except OSError:  # (removed under the server: nothing to put back)
        return None


def _warn(model: str, what: str, signals: list[str], folder: str | None, beside: list[str]) -> None:
    changes = []
    if signals:
        changes.append(f"handling of {', '.join(signals)}")
    if folder is not None:
        changes.append(f"working folder (from {folder})")
    others = f" (or the library of {', '.join(repr(m) for m in beside)}, loading at the same time)" if beside else ""
    log.warning("model '%s': %s changed the server's %s%s; put back as it was: a cxx library shares the server's "
                "process, and must leave its signal handling and working folder alone (a SIGCHLD ignored made "
                "every failed cpp run read as exiting 0, a SIGTERM handler of its own stopped the server without "
                "its drain)", model, what, " and ".join(changes), others)
