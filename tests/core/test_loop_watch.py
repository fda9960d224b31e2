"""The event-loop watch: a callback holding the loop is named while it holds it, and nothing else is."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import re
import subprocess
import sys
import threading
import os
import time
import weakref
from pathlib import Path

import pytest

from nereid.loop_watch import LoopWatch

WARN_AFTER_S = 0.3


def watched(body, warn_after_s: float = WARN_AFTER_S, plugin_code: tuple[str, ...] = ()) -> None:
    """Run ``body()`` (a coroutine function) on a fresh loop under a LoopWatch of ``warn_after_s``."""
    async def main() -> None:
        watch = LoopWatch(asyncio.get_running_loop(), warn_after_s, plugin_code=plugin_code)
        watch.start()
        try:
            await asyncio.sleep(0.05)
            await body()
            await asyncio.sleep(warn_after_s / 5)  # a beat after the hold: its end is logged
        finally:
            watch.stop()
        # Ended by stop(): nereid serve ends the process at once when a nereid- thread is alive at its exit.
        assert not watch._thread.is_alive()
    asyncio.run(main())


def a_large_heap(objects: int = 400_000) -> tuple[list, float]:
    """A heap whose full collection takes a while (kept alive by the caller), and how long one took."""
    heap = [(index, [index]) for index in range(objects)]
    started = time.monotonic()
    gc.collect()
    return heap, time.monotonic() - started


def watch_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "nereid.loop"]


def blocking_infer() -> None:
    time.sleep(WARN_AFTER_S * 2.5)


def test_a_coroutine_that_blocks_is_named_while_it_holds_the_loop_and_its_end_is_logged(caplog):
    caplog.set_level(logging.WARNING, "nereid.loop")

    async def model() -> None:
        blocking_infer()
    watched(model)
    held, again = watch_lines(caplog)
    assert re.match(r"the event loop has been held for 0\.\d s by one callback, so every model and client waits", held)
    assert "asyncio.to_thread" in held
    # The blocking function and its caller, innermost last; none of asyncio's own frames.
    running = held.split("It is running: ")[1]
    assert running.endswith(f"{__file__}:{blocking_infer.__code__.co_firstlineno + 1} in blocking_infer"), running
    assert re.search(rf"{re.escape(__file__)}:\d+ in model > ", running), running
    assert "asyncio" not in running
    assert again.startswith("the event loop runs again after 0.") and again.endswith(" s held by one callback")
    assert 0.6 <= float(again.split("after ")[1].split(" s")[0]) < 1.5


def test_a_hold_with_no_model_code_in_it_names_its_callback_and_gives_no_advice_to_model_authors(caplog):
    """Found by a bug hunt of isolation between models: a stall inside grpcio (or nereid's own code) was
    reported as "(asyncio's own code)" with the advice to move an async def to a worker thread, which no
    model author could follow."""
    caplog.set_level(logging.WARNING, "nereid.loop")

    def held_by(callback, *args) -> str:
        async def server_work() -> None:
            asyncio.get_running_loop().call_soon(callback, *args)
            await asyncio.sleep(WARN_AFTER_S * 3)
        caplog.clear()
        watched(server_work)
        [line] = [line for line in watch_lines(caplog) if "has been held" in line]
        assert "no model code runs in it (the server's own work, or a library's)" in line, line
        assert "asyncio.to_thread" not in line
        return line

    # A C call with no Python frame: named by its callback.
    assert "running (asyncio's own code) (callback <Handle sleep(" in held_by(time.sleep, WARN_AFTER_S * 2.5)
    # The standard library's frames only (a library blocking the loop).
    line = held_by(subprocess.run, ["sleep", str(WARN_AFTER_S * 2.5)])
    assert "subprocess.py" in line and "(callback <Handle run(" in line, line


def test_a_hold_in_an_installed_plugin_s_code_is_blamed_on_it(caplog):
    """From the README walkthrough: a pip-installed backend plugin whose async infer blocked the loop was said to
    run "no model code" (site-packages holds libraries), although the stack named the plugin's infer."""
    import sysconfig
    plugin_file = Path(sysconfig.get_paths()["purelib"]) / "acme_backend" / "backend.py"
    namespace: dict = {}
    exec(compile(f"import time\ndef infer():\n    time.sleep({WARN_AFTER_S * 2.5})\n", str(plugin_file), "exec"),
         namespace)  # (its frames name the file; nothing reads it)

    async def plugin_call() -> None:
        asyncio.get_running_loop().call_soon(namespace["infer"])  # (its frames alone in the callback)
        await asyncio.sleep(WARN_AFTER_S * 3)
    caplog.set_level(logging.WARNING, "nereid.loop")
    watched(plugin_call)
    assert "no model code runs in it" in watch_lines(caplog)[0]  # a library's code, unless it is a plugin's
    caplog.clear()
    watched(plugin_call, plugin_code=(f"{plugin_file.parent}{os.sep}",))
    held = watch_lines(caplog)[0]
    assert "asyncio.to_thread" in held and f"{plugin_file}:3 in infer" in held, held


def test_a_loop_that_only_awaits_and_a_short_hold_log_nothing(caplog):
    caplog.set_level(logging.WARNING, "nereid.loop")

    async def model() -> None:
        await asyncio.sleep(WARN_AFTER_S * 3)  # waiting in the selector, for longer than the limit
        time.sleep(WARN_AFTER_S / 3)
        await asyncio.to_thread(time.sleep, WARN_AFTER_S * 2)  # the blocking call on a worker thread
    watched(model)
    assert watch_lines(caplog) == []


def hold_the_gil(seconds: float) -> None:
    ctypes.PyDLL(None).usleep(int(seconds * 1e6))  # a C call that keeps the GIL (PyDLL: ctypes does not drop it)
    time.sleep(WARN_AFTER_S)  # still in this function when the other threads run again


def test_a_thread_holding_the_gil_is_reported_once_the_stall_is_over_naming_the_threads_in_model_code(caplog):
    """Carried since a bug hunt of isolation between models: a model holding the GIL on a worker thread (a plain
    def orchestration summing 1.5e8 numbers) froze the server, health included, for 3.5-8.3 s with no line in the
    log: the loop ran no callback, and the watching thread could not run either."""
    caplog.set_level(logging.WARNING, "nereid.loop")

    async def model() -> None:
        worker = threading.Thread(target=hold_the_gil, args=(WARN_AFTER_S * 3,), name="model-worker")
        worker.start()
        await asyncio.to_thread(worker.join)
    watched(model)
    [line] = watch_lines(caplog)
    assert re.match(r"no Python code of the server could run for \d+\.\d s \(this watch of its event loop included\), "
                    r"so every model and client waited: a thread held the GIL", line), line
    assert "Threads in a model's code now: " in line and f"model-worker ({__file__}:" in line, line
    assert " in hold_the_gil)" in line, line
    stalled_s = float(line.split("could run for ")[1].split(" s")[0])
    assert WARN_AFTER_S * 2 <= stalled_s < WARN_AFTER_S * 6, line


def test_a_stall_with_no_thread_in_model_code_left_says_so():
    # A process whose only code outside nereid and the libraries is `python -c`'s (no file: not a model's).
    report = ("import logging; from nereid import loop_watch; logging.basicConfig(format='%(message)s'); "
              "loop_watch._report_stall(2.04)")
    printed = subprocess.run([sys.executable, "-c", report], capture_output=True, text=True, check=True).stderr
    assert printed.startswith("no Python code of the server could run for 2.0 s (this watch of its event loop "
                              "included)"), printed
    assert printed.endswith("or the process got no CPU. No thread is in a model's code now.\n"), printed


def test_a_late_beat_while_the_loop_waits_in_its_selector_is_not_blamed_on_a_callback():
    # A beat is late too when the loop's thread waits for the GIL or a CPU (a busy machine, a C extension on
    # another thread holding the GIL): then no callback holds the loop, and the watch names none.
    readings: dict[str, asyncio.Handle | None] = {}

    async def main() -> None:
        watch = LoopWatch(asyncio.get_running_loop(), WARN_AFTER_S)
        watch.start()
        try:
            await asyncio.sleep(0.05)
            idle = threading.Timer(0.1, lambda: readings.setdefault("idle", watch._callback_frame()[1]))
            idle.start()
            await asyncio.sleep(0.3)  # in the selector when the timer reads
            busy = threading.Timer(0.1, lambda: readings.setdefault("busy", watch._callback_frame()[1]))
            busy.start()
            blocking_infer()
        finally:
            watch.stop()
    asyncio.run(main())
    assert readings["idle"] is None
    assert isinstance(readings["busy"], asyncio.Handle)


def test_two_holds_are_each_reported_once(caplog):
    caplog.set_level(logging.WARNING, "nereid.loop")

    async def model() -> None:
        blocking_infer()
        await asyncio.sleep(WARN_AFTER_S / 2)
        blocking_infer()
    watched(model)
    lines = watch_lines(caplog)
    assert [line.split(" for ")[0].split(" after ")[0] for line in lines] == [
        "the event loop has been held", "the event loop runs again",
        "the event loop has been held", "the event loop runs again"], lines


def test_many_short_callbacks_in_one_pass_of_the_loop_blame_none_of_them(caplog):
    # 3,000 tasks woken by one Event.set() run in one pass of the loop, 0.3 ms each: the beat is late by about
    # a second, but no callback holds the loop; one of them, sampled then, was named as if it did.
    caplog.set_level(logging.WARNING, "nereid.loop")

    def short_work() -> None:
        end = time.perf_counter() + 0.0003
        while time.perf_counter() < end:
            pass

    async def client(gate: asyncio.Event) -> None:
        await gate.wait()
        short_work()

    async def model() -> None:
        gate = asyncio.Event()
        tasks = []
        for _ in range(30):
            # Made a hundred at a time: making all 3,000 in one step is itself a hold on a loaded machine (0.4 s
            # in one CI run), and the watch rightly named it.
            tasks += [asyncio.create_task(client(gate)) for _ in range(100)]
            await asyncio.sleep(0)
        await asyncio.sleep(0.05)
        started = time.monotonic()
        gate.set()
        await asyncio.gather(*tasks)
        assert time.monotonic() - started > WARN_AFTER_S * 2  # the pass was late enough to be taken for a hold
    watched(model)
    # None blamed. (A process starved of CPU is said to be, rightly: a run at nice 19 beside busy loops said so.)
    assert [line for line in watch_lines(caplog) if not line.startswith("no Python code of the server could run")] \
        == []


def test_a_watch_whose_loop_ended_without_stop_blames_nothing_of_a_later_loop_and_ends(caplog):
    caplog.set_level(logging.WARNING, "nereid.loop")
    watches = []

    async def first() -> None:
        watch = LoopWatch(asyncio.get_running_loop(), WARN_AFTER_S)
        watch.start()  # never stopped (a server whose stop() never ran)
        watches.append(watch)
        await asyncio.sleep(0.05)
    asyncio.run(first())

    async def second() -> None:  # another loop on the same thread
        blocking_infer()
    asyncio.run(second())
    assert watch_lines(caplog) == []
    watches[0]._thread.join(WARN_AFTER_S)
    assert not watches[0]._thread.is_alive()


def test_a_hold_deep_in_a_library_names_the_code_that_called_it_first(caplog):
    # subprocess.run's innermost frames are all the library's: the model that called it went unnamed.
    caplog.set_level(logging.WARNING, "nereid.loop")

    async def model() -> None:
        subprocess.run(["sleep", str(WARN_AFTER_S * 2.5)], check=True)
    watched(model)
    held = watch_lines(caplog)[0]
    running = held.split("It is running: ")[1]
    assert re.match(rf"{re.escape(__file__)}:\d+ in model > \.\.\. > ", running), running
    assert running.count(" > ") == 4 + 1 and "subprocess.py" in running.rsplit(" > ", 1)[1], running


def test_a_hold_inside_an_import_names_the_model_s_line_not_importlib_s(tmp_path, caplog, monkeypatch):
    """A lazy `import heavy` in an async infer runs through importlib's frozen frames, which are under no folder:
    they were taken for the model's own code, and the warning named `<frozen importlib._bootstrap>`."""
    import importlib
    import sys

    from nereid import loop_watch

    (tmp_path / "heavy_lazy_package.py").write_text(f"import time\ntime.sleep({WARN_AFTER_S * 2.5})\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    # The package counts as a library's (as one in site-packages would); the standard library's and nereid's too.
    libraries = tuple(f"{folder}{os.sep}" for folder in (tmp_path, Path(os.__file__).parent,
                                                          Path(loop_watch.__file__).parent))
    monkeypatch.setattr(loop_watch, "_library_folders", lambda: libraries)
    caplog.set_level(logging.WARNING, "nereid.loop")

    async def model() -> None:
        importlib.import_module("heavy_lazy_package")
    try:
        watched(model)
    finally:
        sys.modules.pop("heavy_lazy_package", None)
    running = watch_lines(caplog)[0].split("It is running: ")[1]
    assert re.match(rf"{re.escape(__file__)}:\d+ in model > \.\.\. > ", running), running


def test_the_nereid_command_s_own_script_is_no_model_s_code() -> None:
    """A bug hunt: every stall report of a server started with the `nereid` command said "Threads in a model's code
    now: MainThread (.../bin/nereid:8 in <module>)": the console script, the main thread's outermost frame."""
    import shutil
    import sysconfig

    from nereid import loop_watch

    script = os.path.join(sysconfig.get_paths()["scripts"], "nereid")
    assert not loop_watch._is_model_code(script)
    installed = shutil.which("nereid")
    if installed is not None and os.path.dirname(installed) == sysconfig.get_paths()["scripts"]:
        assert not loop_watch._is_model_code(installed)
    # (A `pip install --user`'s, in ~/.local/bin, too: the hunt of this fix.)
    assert not loop_watch._is_model_code(os.path.join(sysconfig.get_path("scripts", f"{os.name}_user"), "nereid"))
    assert loop_watch._is_model_code(__file__)  # (a file of no library's folder still is)


class Big:
    """Something a held callback holds (a large request, say)."""


BIG_REFS: list = []


def decode_big() -> None:
    """A plain function (a coroutine's frame is cleared when it ends; a function's frame object keeps its locals)."""
    big = Big()
    BIG_REFS.append(weakref.ref(big))
    time.sleep(WARN_AFTER_S * 0.8)  # read by the watch (the beat late), not long enough to be reported


def test_what_a_held_callback_held_is_let_go_once_it_returns() -> None:
    """Defect: the watching thread kept the frame it had read of the loop's thread until its next look at a late
    beat: a 64 MiB request whose receipt held the loop stayed in memory for good (a memory test caught it)."""
    BIG_REFS.clear()

    async def main() -> None:
        watch = LoopWatch(asyncio.get_running_loop(), WARN_AFTER_S)
        watch.start()
        try:
            await asyncio.sleep(0.05)
            decode_big()
            await asyncio.sleep(WARN_AFTER_S / 2)  # beats on time: the watch holds nothing of the callback now
            # (No gc.collect(): nothing but a reference keeps it, and a collection slow enough to make a beat late
            # would have the watch read the stack again, dropping the old frame by chance.)
            assert BIG_REFS[0]() is None
        finally:
            watch.stop()
    asyncio.run(main())


def test_a_callback_held_up_by_the_garbage_collector_is_not_blamed(caplog):
    """A full collection of a large heap (0.3-0.7 s for 700,000 objects under a loaded test run) ran inside one
    step of a test's coroutine, and the watch named that step as a callback that blocks the loop."""
    from nereid import loop_watch

    caplog.set_level(logging.WARNING, "nereid.loop")
    heap, _ = a_large_heap()

    async def model() -> None:
        end = time.monotonic() + WARN_AFTER_S * 2.5
        while time.monotonic() < end:
            gc.collect()
    try:
        watched(model)
    finally:
        del heap
    assert watch_lines(caplog) == []
    assert loop_watch._COLLECTOR._on_collection not in gc.callbacks  # stopped watches count no collection


def test_a_look_that_lands_as_a_collection_ends_counts_it_as_the_collector_s(caplog):
    """The watching thread waits for the GIL through a collection and gets it as the collector's callback
    begins, before the collection's time is added: that look blamed the whole collection on the callback (a
    flaky failure of the test above in loaded runs, where one collection can take longer than the limit)."""
    caplog.set_level(logging.WARNING, "nereid.loop")
    heap, one_collection_s = a_large_heap()
    warn_after_s = one_collection_s / 2  # each collection alone lasts longer than the limit

    async def model() -> None:
        # The callback first runs code of its own, for less than the limit: the watch sees it hold the loop
        # outside any collection. Then collections, each longer than the limit.
        end = time.monotonic() + warn_after_s * 0.4
        while time.monotonic() < end:
            pass
        end = time.monotonic() + max(0.5, one_collection_s * 6)
        while time.monotonic() < end:
            gc.collect()
    try:
        watched(model, warn_after_s)
    finally:
        del heap
    assert watch_lines(caplog) == []


def test_a_callback_that_blocks_is_blamed_for_its_own_time_beside_the_collector_s(caplog):
    caplog.set_level(logging.WARNING, "nereid.loop")

    async def model() -> None:
        end = time.monotonic() + WARN_AFTER_S * 2.5
        while time.monotonic() < end:
            gc.collect(0)  # short collections, between which the model's own code runs
            time.sleep(0.005)
    watched(model)
    held, _ = watch_lines(caplog)
    assert "in model" in held


def test_a_collection_that_a_look_triggers_is_not_blamed_on_the_callback_by_the_next_look(caplog, monkeypatch):
    """An allocation of the watching thread's own look can start a collection, after the look read the time:
    counted before the hold was first seen, it was the callback's at the next look."""
    caplog.set_level(logging.WARNING, "nereid.loop")
    # A limit of about 0.15 s, of which the callback's own code takes half: the other half is the margin for the
    # process waiting for a core, which the watch cannot tell from a hold (0.015 s at 400,000 objects and 0.7 of
    # the limit: a CI run under load failed on it).
    heap, one_collection_s = a_large_heap(1_200_000)
    warn_after_s = one_collection_s * 0.9  # the collection alone lasts longer than the limit
    looked: list[bool] = []
    callback_frame = LoopWatch._callback_frame

    def callback_frame_then_a_collection(self):
        found = callback_frame(self)
        if found[1] is not None and not looked:
            looked.append(True)
            gc.collect()  # what an allocation of the look (its frames dict, a weak reference) may start
        return found
    monkeypatch.setattr(LoopWatch, "_callback_frame", callback_frame_then_a_collection, raising=True)

    async def model() -> None:
        # The callback's own code, for half the limit (the time the look's collection stops it is not its):
        # the watch looks again after its collection, while the callback still holds the loop.
        own_s, last = 0.0, time.monotonic()
        while own_s < warn_after_s * 0.5:
            now = time.monotonic()
            if now - last < warn_after_s / 4:
                own_s += now - last
            last = now
    try:
        watched(model, warn_after_s)
    finally:
        del heap
    assert looked and watch_lines(caplog) == []


def test_the_collector_clock_counts_a_running_collection_and_forgets_one_left_by_a_detach():
    from nereid.loop_watch import _CollectorClock

    clock = _CollectorClock()
    clock._on_collection("start", {})
    started = time.monotonic()
    assert clock.seconds(started + 2.0) >= 2.0  # the running collection, so far
    clock._on_collection("stop", {})
    finished = clock.seconds(time.monotonic() + 5.0)
    assert 0.0 <= finished < 1.0  # finished collections only: the clock stands still between them
    clock._on_collection("start", {})  # ... and its watches detach before this collection ends
    gc.disable()  # (no real collection while the clock is attached: it would count one)
    clock.attach()
    try:
        assert clock.seconds(time.monotonic() + 5.0) == finished
    finally:
        clock.detach()
        gc.enable()
