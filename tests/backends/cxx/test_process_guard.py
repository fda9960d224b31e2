"""backends/cxx/process_guard.py: what native code changes of the process's signal handling and working folder is
put back (a library's own calls are in test_model.py)."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import subprocess
import sys
import threading

from nereid.backends.cxx.process_guard import _dispositions, process_state_kept

LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
LIBC.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
LIBC.signal.restype = ctypes.c_void_p
SIG_IGN = 1


def test_a_signal_ignored_and_a_folder_moved_by_native_code_are_put_back_and_the_model_named(tmp_path, caplog):
    working = os.getcwd()
    caplog.set_level(logging.WARNING, logger="nereid.backends.cxx.process_guard")
    with process_state_kept("m", "its nereid_load"):
        LIBC.signal(signal.SIGCHLD, SIG_IGN)  # as native code does: Python's own record is left as it was
        os.chdir(tmp_path)
        assert subprocess.run(["true"]).returncode == 0 and subprocess.run(["false"]).returncode == 0  # (unread)
    assert subprocess.run(["false"]).returncode == 1 and os.getcwd() == working
    assert caplog.messages == [
        f"model 'm': its nereid_load changed the server's handling of SIGCHLD and working folder (from {working}); "
        "put back as it was: a cxx library shares the server's process, and must leave its signal handling and "
        "working folder alone (a SIGCHLD ignored made every failed cpp run read as exiting 0, a SIGTERM handler "
        "of its own stopped the server without its drain)"]


def test_a_handler_python_itself_set_meanwhile_is_the_server_s_and_stays(caplog):
    """The server's own changes (its stop, on the loop's thread, while a load runs) are made through Python, which
    records them: a change Python knows of is left as it is, and said of no model."""
    previous = signal.getsignal(signal.SIGHUP)
    try:
        with process_state_kept("m", "its nereid_load"):
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        handler = _dispositions()[signal.SIGHUP][:ctypes.sizeof(ctypes.c_void_p)]
        assert int.from_bytes(handler, sys.byteorder) == SIG_IGN  # (for the C library too)
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_change_made_while_two_libraries_loaded_names_the_other_too(caplog):
    """Which of two loads running at once changed it cannot be told: the one that finds it says so, naming both."""
    caplog.set_level(logging.WARNING, logger="nereid.backends.cxx.process_guard")
    first_inside, second_done = threading.Event(), threading.Event()

    def first() -> None:
        with process_state_kept("a", "opening its shared library"):
            first_inside.set()
            second_done.wait(10)

    thread = threading.Thread(target=first)
    thread.start()
    first_inside.wait(10)
    with process_state_kept("b", "its nereid_load"):
        LIBC.signal(signal.SIGCHLD, SIG_IGN)
    second_done.set()
    thread.join(10)
    assert subprocess.run(["false"]).returncode == 1
    assert [m.split(";")[0] for m in caplog.messages] == [
        "model 'b': its nereid_load changed the server's handling of SIGCHLD (or the library of 'a', loading at "
        "the same time)"]
