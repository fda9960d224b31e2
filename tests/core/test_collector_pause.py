"""collector_pause: the garbage collector paused from several threads at once."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading

from nereid.collector_pause import collector_paused


def test_the_collector_is_on_again_only_once_the_last_pause_ends_and_only_if_it_was_on() -> None:
    assert gc.isenabled()
    first, second = collector_paused(), collector_paused()
    first.__enter__()
    entered, leave = threading.Event(), threading.Event()

    def other() -> None:
        with second:
            entered.set()
            leave.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    try:
        assert entered.wait(10) and not gc.isenabled()
        first.__exit__(None, None, None)
        assert not gc.isenabled()  # (each turning it back on as it ended turned it on under the other)
    finally:
        leave.set()
        thread.join(10)
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # off before the pause: left off
    finally:
        gc.enable()


# Another thread's frames read while threads start and end and a gc callback runs Python code: on Python 3.11
# before 3.11.9, sys._current_frames() deadlocks the process there within a second or two (CPython gh-106883).
FRAMES_UNDER_LOAD = """
import gc, sys, threading, time
from nereid.loop_watch import current_frames

def on_collection(phase, info):
    total = 0
    for i in range(300000):  # longer than the GIL's switch interval: another thread takes the GIL here
        total += i

gc.callbacks.append(on_collection)
gc.set_threshold(20)

def busy():
    while True:
        (lambda: time.sleep(0.001))()  # a frame each step: reading the frames makes objects for them

for _ in range(30):
    threading.Thread(target=busy, daemon=True).start()

def watch():
    while True:
        current_frames()

threading.Thread(target=watch, daemon=True).start()
ends = time.monotonic() + 2

def start_and_end_threads():
    while time.monotonic() < ends:
        thread = threading.Thread(target=lambda: None)
        thread.start()
        thread.join()

starters = [threading.Thread(target=start_and_end_threads, daemon=True) for _ in range(8)]
for thread in starters:
    thread.start()
for thread in starters:
    thread.join()
print("ended")
"""


def test_frames_read_while_threads_start_and_end_never_deadlock_the_process() -> None:
    """The complexity hunt: a server of 1,000 models hung for good at its stop, the loop watch reading frames
    (sys._current_frames) as the unload started threads. Read with the collector paused, it cannot."""
    done = subprocess.run([sys.executable, "-c", FRAMES_UNDER_LOAD], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, "ended"), done.stderr
