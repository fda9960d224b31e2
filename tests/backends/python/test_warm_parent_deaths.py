"""A warm parent that dies on its own: while it restarts (before it says ready), and while its model is idle; and
a model made cold by such deaths trying warm start again.

Real warm parents, started and driven as the python backend drives them (a
:class:`WarmParent` in this process), killed with ``os.kill`` as the
out-of-memory killer kills them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import re
import threading
from pathlib import Path

import pytest

from nereid.backend import ModelContext
from nereid.backends.python.plugin import PythonModel, cold_command
from nereid.backends.python.preload import Preloads
from nereid.backends.python import warm
from nereid.backends.python.warm import MAX_START_DEATHS, WarmParent
from nereid.backends.subprocess.runner import ProcessGroups
from nereid.errors import ModelFailure, ModelKilled, NotStarted, Unavailable
from nereid.settings import ModelSettings

from support import fail_thread_starts, process_alive, textproto_single, wait_until, zombie_children

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the warm parent needs Linux")

# Preloaded by the parent: while the file NEREID_TEST_STALL names exists, it writes its pid beside it (one file
# per parent) and sleeps, a parent still importing; while NEREID_TEST_DIE names one, it kills itself (a module
# that now crashes the interpreter).
STALLS_IF_ASKED = """
import os, signal, time
stall, die = os.environ["NEREID_TEST_STALL"], os.environ["NEREID_TEST_DIE"]
if os.path.exists(die):
    os.kill(os.getpid(), signal.SIGKILL)
if os.path.exists(stall):
    with open(f"{stall}.{os.getpid()}", "w") as pid_file:
        pid_file.write(str(os.getpid()))
    time.sleep(60)
"""
# A main.py that prints how it ran: "warm" (forked from a parent that preloaded stalls_if_asked) or "cold" (a fresh
# interpreter); with NEREID_TEST_RUNS it notes each run there, and with NEREID_TEST_HOLD it says it runs (a file
# HOLD.PID) and goes on only once the file HOLD is gone.
TELLS_HOW_IT_RAN = """
import os, sys, time
sys.stdin.buffer.read()
if "NEREID_TEST_RUNS" in os.environ:
    with open(os.environ["NEREID_TEST_RUNS"], "a") as runs:
        runs.write(f"{os.getpid()}\\n")
hold = os.environ.get("NEREID_TEST_HOLD")
if hold:
    open(f"{hold}.{os.getpid()}", "w").close()
    while os.path.exists(hold):
        time.sleep(0.01)
print("warm" if "stalls_if_asked" in sys.modules else "cold")
"""


class Model:
    """A model folder whose warm parent preloads ``stalls_if_asked``, and the switches that module reads."""

    def __init__(self, tmp_path: Path, main: str = "import sys\nsys.stdin.buffer.read()\n") -> None:
        self.folder = tmp_path / "model"
        self.folder.mkdir()
        (self.folder / "main.py").write_text(main)
        site = tmp_path / "site"
        site.mkdir()
        (site / "stalls_if_asked.py").write_text(STALLS_IF_ASKED)
        self.stall, self.die = tmp_path / "stall", tmp_path / "die"
        scratch = tmp_path / "scratch"
        scratch.mkdir()
        env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(site), "NEREID_TEST_STALL": str(self.stall),
               "NEREID_TEST_DIE": str(self.die)}
        self.parent = WarmParent(name="m", folder=self.folder, env=env, modules=Preloads(extra=("stalls_if_asked",)),
                                 log_path=scratch / "log", entry_source=scratch / "main.py.loaded",
                                 entry_bytes=(self.folder / "main.py").read_bytes(), cold_argv=cold_command())

    def run(self) -> int:
        """One batch; its exit status. Sent once more when its parent did not start it (NotStarted), and failing
        with the backend's failure when it does not start again, as the scheduler does."""
        try:
            return self._run_once()
        except NotStarted:
            try:
                return self._run_once()
            except NotStarted as again:
                raise again.failure from None

    def _run_once(self) -> int:
        return self.parent.run(env={}, stdin=b"x", timeout_s=30, groups=ProcessGroups()).returncode

    def how_it_ran(self, env: dict[str, str] | None = None) -> str:
        """One batch of a TELLS_HOW_IT_RAN main.py (with ``env``): "warm" or "cold", as it printed."""
        result = self.parent.run(env=env or {}, stdin=b"x", timeout_s=60, groups=ProcessGroups())
        assert result.returncode == 0, result
        return result.output_tail.strip()

    def stalled_parents(self) -> list[int]:
        """The pids of the parents stalled in their imports so far, oldest first."""
        files = sorted(self.stall.parent.glob(f"{self.stall.name}.*"), key=lambda file: file.stat().st_mtime_ns)
        return [int(file.read_text() or 0) for file in files]

    def python_model(self, tmp_path: Path) -> PythonModel:
        """The folder loaded as a python model (not loaded yet) whose warm parent preloads ``stalls_if_asked`` and
        reads these switches (the model's processes inherit no PYTHONPATH: the parent finds the module so)."""
        (self.folder / "model_inference.textproto").write_text(textproto_single())
        scratch = tmp_path / "server_scratch"
        scratch.mkdir()
        settings = ModelSettings("m", runtime={"preload": ["stalls_if_asked"]})
        model = PythonModel(ModelContext("m", self.folder, settings, scratch, "nereid.yaml: models[0]"))
        base_environment = model.base_environment
        model.base_environment = lambda: {**base_environment(), **self.parent.env}
        return model

    def stop(self) -> None:
        self.parent.stop()
        for pid in self.stalled_parents():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def model(tmp_path):
    model = Model(tmp_path)
    model.parent.start()
    yield model
    model.stop()


def kill_the_restarting_parents(model: Model, count: int) -> list[int]:
    """Kill (SIGKILL) the next ``count`` parents started, each as it stalls in its imports, unstalling the last
    before it is killed; the pids killed."""
    killed: list[int] = []
    while len(killed) < count:
        pid = wait_until(lambda: next((pid for pid in model.stalled_parents() if pid and pid not in killed), None))
        assert pid, f"no new warm parent stalled in its imports after {killed}"
        if len(killed) == count - 1:
            model.stall.unlink()  # the parent started after this one imports at once
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
    return killed


def run_in_background(model: Model) -> tuple[list, threading.Thread]:
    """One batch on a thread of its own: its exit status, or what it raised, is appended to the list."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(model.run())
        except Exception as err:  # the test looks at it
            outcome.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    return outcome, thread


def test_a_parent_killed_while_it_restarts_is_started_again_and_the_model_stays_warm(model, no_zombies):
    """Defect (found by a leak hunt): a restarted parent killed before it said ready (an out-of-memory killer
    acting twice) was taken for one whose imports now fail: the model ran cold until reloaded, logging "its
    restarted warm parent cannot preload (the warm parent did not start (no answer))"."""
    first = model.parent.pid
    os.kill(first, signal.SIGKILL)
    model.stall.write_text("")
    outcome, thread = run_in_background(model)
    killed = kill_the_restarting_parents(model, 1)
    thread.join(30)
    assert outcome == [0]  # the batch, which had not run, went to the parent started after the killed one
    assert model.parent.cold_reason is None
    assert model.parent.modules == Preloads(extra=("stalls_if_asked",))  # still preloaded: warm
    assert process_alive(model.parent.pid) and model.parent.pid not in (first, *killed)
    assert model.run() == 0 and model.parent.cold_reason is None


def test_a_batch_whose_restarting_parents_are_killed_twice_fails_saying_so_and_the_next_runs_warm(model, no_zombies):
    first = model.parent.pid
    os.kill(first, signal.SIGKILL)
    model.stall.write_text("")
    outcome, thread = run_in_background(model)
    kill_the_restarting_parents(model, 2)
    thread.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], ModelKilled), outcome
    assert str(outcome[0]) == ("model 'm': its new warm parent process was killed by signal SIGKILL while starting, "
                               "as did the one started before it; the batch was not run, and the next batch starts "
                               "a new one")
    assert model.parent.pid is None and model.parent.cold_reason is None
    assert model.run() == 0  # a new parent, warm
    assert model.parent.cold_reason is None and model.parent.modules == Preloads(extra=("stalls_if_asked",))


def test_parents_that_keep_dying_as_they_start_turn_warm_start_off_saying_so(model, no_zombies):
    # A preloaded module that now kills the interpreter: not started again at every batch for ever.
    model.die.write_text("")
    first = model.parent.pid
    os.kill(first, signal.SIGKILL)
    assert wait_until(lambda: not process_alive(first))
    with pytest.raises(ModelKilled, match=r"its new warm parent process was killed by signal SIGKILL while starting, "
                                          r"as did the one started before it"):
        model.run()
    assert MAX_START_DEATHS == 3
    assert model.run() == 0  # the third death: cold from now on
    assert model.parent.cold_reason == ("3 warm parents in a row ended while starting, the last one was killed by "
                                        "signal SIGKILL")
    assert model.parent.modules == Preloads()
    assert model.run() == 0


def test_a_parent_that_dies_while_its_model_is_idle_is_reaped_at_once(tmp_path, no_zombies):
    """Defect (found by a leak hunt): a dead parent was noticed only by its model's next batch; a model without
    traffic kept it a zombie, with its control socket and lifeline open in the server, for hours."""
    model = Model(tmp_path)
    try:
        model.parent.start()
        pid = model.parent.pid
        # Its two descriptors in this process (the process's descriptor count is no measure under xdist: other
        # tests' threads in this worker open and close theirs meanwhile).
        control, lifeline = model.parent._control, model.parent._process.stdin
        os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: model.parent.pid is None and pid not in zombie_children(), timeout_s=5), \
            f"warm parent {pid} left a zombie: {zombie_children()}"
        assert control.fileno() == -1 and lifeline.closed
        assert model.run() == 0 and process_alive(model.parent.pid)  # the next batch starts a new one, warm
        assert model.parent.cold_reason is None
    finally:
        model.stop()


def test_an_exit_watcher_whose_thread_cannot_start_says_so_and_starts_it_at_the_next_parent(tmp_path, monkeypatch,
                                                                                             caplog, no_zombies):
    """Found by the resource-limits hunt: the exit watcher's thread failing to start (ulimit -u) failed the load
    that started it, and the unstarted thread was kept for a running one, so none was started again: every warm
    parent dying while its model was idle stayed a zombie until the model's next batch. The parent is still
    watched, the failure is a WARNING, and the next parent's start starts the thread."""
    assert wait_until(lambda: warm._EXITS._thread is None, timeout_s=30)  # (other tests' parents all gone)
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    first, second = Model(tmp_path / "first"), Model(tmp_path / "second")
    refused = fail_thread_starts(monkeypatch, "nereid-warm-parent-exits")
    try:
        with caplog.at_level(logging.WARNING, logger="nereid.backends.python.warm"):
            first.parent.start()
        assert refused == ["nereid-warm-parent-exits"] and warm._EXITS._thread is None
        assert [(r.levelname, r.getMessage()) for r in caplog.records] == [(
            "WARNING", "model 'm': the thread that notices warm parents exiting while idle could not start (can't "
            "start new thread: a process or thread limit, such as ulimit -u or a container's pids limit, is "
            "reached); it is started again at the next parent's start, and until then a parent that dies while its "
            "model is idle is reaped at the model's next batch")]
        second.parent.start()
        assert warm._EXITS._thread is not None
        pid = first.parent.pid
        os.kill(pid, signal.SIGKILL)  # the first parent, watched since its start, dies while its model is idle
        assert wait_until(lambda: first.parent.pid is None and pid not in zombie_children(), timeout_s=10), \
            f"warm parent {pid} left a zombie: {zombie_children()}"
    finally:
        first.stop()
        second.stop()


def test_a_load_failing_after_its_parent_started_stops_that_parent(tmp_path, monkeypatch, no_zombies):
    """Found by the resource-limits hunt: a load that failed once its warm parent had started (its exit watcher's
    thread could not start) removed the parent's folder but left the parent running, for the server's life."""
    switches = Model(tmp_path)
    model = switches.python_model(tmp_path)
    started = []

    def failing_watch(parent: WarmParent, process) -> None:
        started.append(process)
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(warm._EXITS, "watch", failing_watch)
    try:
        with pytest.raises(RuntimeError, match="can't start new thread"):
            model.load()
        [process] = started
        assert process.poll() is not None and not process_alive(process.pid)  # stopped and reaped
        assert list((tmp_path / "server_scratch").iterdir()) == []  # (no parent's folder left)
    finally:
        model.unload()
        switches.stop()


def test_a_parent_killed_while_its_model_loads_is_started_again_and_the_model_loads_warm(tmp_path, caplog,
                                                                                          no_zombies):
    """Defect: a warm parent killed once while its model loaded (an out-of-memory killer during a big import) was
    taken for one that cannot preload: the model ran cold until reloaded, its reason "the warm parent was killed by
    signal SIGKILL while starting"."""
    switches = Model(tmp_path)  # its site, its stall switch, and its folder: loaded here as a python model
    model = switches.python_model(tmp_path)
    switches.stall.write_text("")
    loading = threading.Thread(target=model.load)
    try:
        with caplog.at_level(logging.WARNING, logger="nereid.backends.python.plugin"):
            loading.start()
            [killed] = kill_the_restarting_parents(switches, 1)
            loading.join(30)
        assert not loading.is_alive()
        assert model.runtime_report().summary == "warm_start=on"
        parent = model._parent
        assert parent is not None and parent.cold_reason is None and parent.pid != killed
        assert parent.modules == Preloads(imports=("sys",), extra=("stalls_if_asked",))  # preloaded: warm
        assert [record.getMessage() for record in caplog.records] == [
            "model 'm': the warm parent was killed by signal SIGKILL while starting; starting another for the load"]
        assert model.launch(env=model.base_environment(), stdin=b"x").returncode == 0  # forked, warm
        assert parent.cold_reason is None and process_alive(parent.pid)
    finally:
        loading.join(30)
        model.unload()
        switches.stop()


def test_a_parent_that_cannot_be_restarted_for_a_while_leaves_the_model_warm_once_it_can(model, caplog, no_zombies):
    """Defect (carried for several releases): a dead parent whose restart met a folder it could not prepare (a
    full disk) turned warm start off: once the disk had room again, every batch started a fresh interpreter until
    the model was reloaded, logging "its restarted warm parent cannot preload"."""
    folder = model.parent.log_path.parent
    first = model.parent.pid
    shutil.rmtree(folder)
    folder.write_text("")  # a file where its folder must be (root ignores permission bits): mkdir fails
    os.kill(first, signal.SIGKILL)
    assert wait_until(lambda: model.parent.pid is None)
    with caplog.at_level(logging.INFO, logger="nereid.backends.python.warm"):
        failures = []
        for _ in range(2):  # a parent that preloads nothing could not start either: each batch fails, tries again
            with pytest.raises(ModelFailure) as failure:
                model.run()
            failures.append(str(failure.value))
        folder.unlink()
        assert model.run() == 0
    assert model.parent.cold_reason is None
    assert model.parent.modules == Preloads(extra=("stalls_if_asked",))  # preloaded: warm again
    assert process_alive(model.parent.pid) and model.parent.pid != first
    assert failures == [f"model 'm': its warm parent process could not be restarted: cannot prepare its folder "
                        f"{folder}: File exists; the batch was not run, and the next batch tries again"] * 2
    said = [(record.levelname, record.getMessage()) for record in caplog.records if "restarted" in record.getMessage()
            or "started;" in record.getMessage()]
    assert said == [
        ("WARNING", f"model 'm': its warm parent process could not be restarted (cannot prepare its folder {folder}: "
                    "File exists); batches fail until one can be, each trying again"),
        ("INFO", f"model 'm': a new warm parent process (pid {model.parent.pid}) started; batches run again, warm "
                 "start is back")]


def test_a_restart_that_cannot_open_the_parent_s_log_names_the_log_once(model, no_zombies):
    """Defect (a closing note's carried item): a parent whose process could not be started said so twice, "its
    warm parent process could not be restarted: its process could not be started: Is a directory", and a log
    that could not be opened was not named."""
    log = model.parent.log_path
    first = model.parent.pid
    os.kill(first, signal.SIGKILL)
    assert wait_until(lambda: model.parent.pid is None)
    log.unlink()
    log.mkdir()  # something else where its log was
    with pytest.raises(ModelFailure) as failure:
        model.run()
    assert str(failure.value) == (f"model 'm': its warm parent process could not be restarted: cannot open its log "
                                  f"{log}: Is a directory; the batch was not run, and the next batch tries again")
    log.rmdir()
    assert model.run() == 0 and model.parent.pid != first


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_a_cold_model_s_parent_is_not_called_warm_in_its_faults(tmp_path, warm, no_zombies):
    """Found by a bug hunt: with warm_start off, a run that killed its parent failed with "its warm parent process
    was killed by signal SIGKILL", sending its reader to a setting that was off."""
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "model_inference.textproto").write_text(textproto_single())
    (folder / "main.py").write_text("import os, signal, sys\nsys.stdin.buffer.read()\n"
                                    "os.kill(os.getppid(), signal.SIGKILL)\n")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    settings = ModelSettings("m", runtime={"warm_start": warm})
    model = PythonModel(ModelContext("m", folder, settings, scratch, "nereid.yaml: models[0]"))
    model.load()
    try:
        assert model.runtime_report().summary == ("warm_start=on" if warm else "warm_start=off (runtime.warm_start "
                                                                               "is false)")
        with pytest.raises(ModelKilled) as killed:
            model.launch(env=model.base_environment(), stdin=b"x")
        called = "warm parent" if warm else "parent"
        assert str(killed.value).startswith(f"model 'm': its {called} process was killed by signal SIGKILL ("), \
            str(killed.value)
        assert "warm" not in str(killed.value) or warm
    finally:
        model.unload()


def test_a_batch_whose_parent_is_stopped_by_the_model_s_unload_fails_and_starts_no_parent(model, caplog, monkeypatch,
                                                                                          no_zombies):
    """Defect (the warm-parent kill hunt): a batch sent to a parent that could not answer (SIGSTOPped) while its
    model was unloaded found the parent gone and, as for a parent that died, started a new one for a model that
    was unloaded (a parent left running), or logged `its warm parent process could not be restarted (its process
    could not be started: No such file or directory); batches fail until one can be`. It fails saying the model
    was unloaded, and no parent is started, for it or for a batch after it."""
    from nereid.backends.python import warm
    from nereid.errors import Unavailable

    sent = threading.Event()
    receive = warm._receive

    def receive_once_sent(reply):  # the run's request is with the parent: it waits for the parent's answer
        sent.set()
        return receive(reply)

    monkeypatch.setattr(warm, "_receive", receive_once_sent)
    parent = model.parent.pid
    os.kill(parent, signal.SIGSTOP)
    with caplog.at_level(logging.INFO, logger="nereid.backends.python.warm"):
        outcome, thread = run_in_background(model)
        assert sent.wait(30)
        model.parent.stop()  # (kills the stopped parent past its grace, as the model's unload does)
        thread.join(60)
        assert not thread.is_alive()
        with pytest.raises(Unavailable) as later:
            model.run()
    unloaded = ("model 'm' was unloaded (removed, replaced by a new version, or the server stopping) before this batch "
                "could run: its warm parent process was stopped; the batch was not run")
    assert [type(failure) for failure in outcome] == [Unavailable], outcome
    assert [str(outcome[0]), str(later.value)] == [unloaded] * 2
    assert model.parent.pid is None and not process_alive(parent)
    assert [record.getMessage() for record in caplog.records] == []


# -- trying warm start again, once a restart made the model cold ----------------------------------------------------
def go_cold(model: Model) -> int:
    """Make ``model`` cold as parents that keep dying as they start do (its die switch is left on); the pid of the
    parent its cold runs go to."""
    model.die.write_text("")
    first = model.parent.pid
    os.kill(first, signal.SIGKILL)
    assert wait_until(lambda: not process_alive(first))
    with pytest.raises(ModelKilled):
        model.parent.run(env={}, stdin=b"x", timeout_s=60, groups=ProcessGroups())
    assert model.how_it_ran() == "cold"  # the third death: cold
    assert model.parent.cold_reason == ("3 warm parents in a row ended while starting, the last one was killed by "
                                        "signal SIGKILL")
    return model.parent.pid


@pytest.fixture
def telling_model(tmp_path, monkeypatch):
    """A Model whose main.py tells how it ran, started; a retry waits 10 minutes unless the test shortens it."""
    monkeypatch.setattr(warm, "WARM_RETRY_FIRST_S", 600.0)
    model = Model(tmp_path, main=TELLS_HOW_IT_RAN)
    model.parent.start()
    yield model
    model.stop()


def retries_running() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith("nereid-warm-retry-")]


def test_a_model_whose_parents_are_killed_as_it_loads_loads_cold_and_is_warm_again_after_the_back_off(
        tmp_path, monkeypatch, caplog, no_zombies):
    """The warm-retry hunt: both warm parents killed as the model loaded (an out-of-memory killer at a busy start)
    loaded it cold until its next load; it is cold for now, and warm once a try after the back-off works."""
    monkeypatch.setattr(warm, "WARM_RETRY_FIRST_S", 600.0)
    switches = Model(tmp_path, main=TELLS_HOW_IT_RAN)
    model = switches.python_model(tmp_path)
    switches.stall.write_text("")
    loading = threading.Thread(target=model.load)
    try:
        with caplog.at_level(logging.WARNING, logger="nereid.backends.python.warm"):
            loading.start()
            kill_the_restarting_parents(switches, 2)
            loading.join(30)
            assert not loading.is_alive()
            switches.parent = model._parent
            off = "warm_start=off (the warm parent was killed by signal SIGKILL while starting), tried again at "
            assert re.fullmatch(re.escape(off) + r"the first batch in (600|599) s", model.runtime_report().summary)
            assert switches.how_it_ran() == "cold"
            monkeypatch.setattr(warm, "WARM_RETRY_FIRST_S", 0.0)
            assert switches.how_it_ran() == "cold"  # starts the try
            assert wait_until(lambda: model.runtime_report().summary == "warm_start=on", timeout_s=60)
            assert switches.how_it_ran() == "warm"
        assert [record.getMessage() for record in caplog.records if record.name.endswith(".warm")][0] == (
            "model 'm': its warm parents ended as they started while it loaded (the warm parent was killed by "
            "signal SIGKILL while starting); every batch starts a fresh interpreter until warm start is back: a warm "
            "parent is tried again at the first batch after 600 s")
    finally:
        loading.join(30)
        model.unload()
        switches.stop()
    assert not retries_running()


def test_a_model_made_cold_by_dying_parents_is_warm_again_after_the_back_off(tmp_path, monkeypatch, caplog, no_zombies):
    """Defect (carried since stop 43): 3 parents in a row that died as they started (an out-of-memory killer on a
    busy machine) made the model cold for good: every batch started a fresh interpreter until the model was loaded
    again, though the next parent would have started. A batch after the back-off tries a warm parent again, beside
    the cold one, and the batches after it are forked from it."""
    monkeypatch.setattr(warm, "WARM_RETRY_FIRST_S", 600.0)
    switches = Model(tmp_path, main=TELLS_HOW_IT_RAN)  # its site, its switches, and its folder, loaded as a model
    model = switches.python_model(tmp_path)
    try:
        model.load()
        switches.parent = model._parent  # (the switches' own parent never started)
        with caplog.at_level(logging.WARNING, logger="nereid.backends.python.warm"):
            cold = go_cold(switches)
            off = ("warm_start=off since a restart (3 warm parents in a row ended while starting, the last one was "
                   "killed by signal SIGKILL), tried again at ")
            assert re.fullmatch(re.escape(off) + r"the first batch in (600|599) s", model.runtime_report().summary)
            assert model.runtime_report().warm_start is False  # (the nereid_warm_start gauge)
            switches.die.unlink()  # what killed them has passed
            assert switches.how_it_ran() == "cold" and not retries_running()  # not tried before the back-off
            monkeypatch.setattr(warm, "WARM_RETRY_FIRST_S", 0.0)  # the back-off is over
            assert model.runtime_report().summary == off + "the next batch"
            assert switches.how_it_ran() == "cold"  # this batch starts the try, and does not wait for it
            assert wait_until(lambda: model.runtime_report().summary == "warm_start=on", timeout_s=60)
            assert model.runtime_report().warm_start is True
            assert switches.how_it_ran() == "warm"
            assert wait_until(lambda: not process_alive(cold))  # the cold parent was ended, and reaped
            back = model._parent.pid
        said = [record.getMessage() for record in caplog.records]
        assert said[-1] == (f"model 'm': warm start is back: a new warm parent (pid {back}) started; batches are "
                            "forked from it, and the cold parent ends once its runs in progress are over")
        assert said[-2] == ("model 'm': its warm parents keep ending while they start (3 warm parents in a row ended "
                            "while starting, the last one was killed by signal SIGKILL); every batch starts a fresh "
                            "interpreter until warm start is back: a warm parent is tried again at the first batch "
                            "after 600 s")
        assert model._parent.modules == Preloads(imports=("os", "sys", "time"), extra=("stalls_if_asked",))
    finally:
        model.unload()
        switches.stop()
    assert not retries_running()


def test_a_try_at_warm_start_again_that_fails_stays_cold_and_waits_twice_as_long(telling_model, monkeypatch, caplog,
                                                                                  no_zombies):
    model = telling_model
    go_cold(model)  # its die switch left on: each try's parent dies as it starts
    monkeypatch.setattr(warm, "WARM_RETRY_FIRST_S", 0.2)
    monkeypatch.setattr(warm, "WARM_RETRY_MAX_S", 0.8)

    def failed_tries() -> list[str]:
        return [record.getMessage() for record in caplog.records if "a try at warm start again failed" in
                record.getMessage()]

    with caplog.at_level(logging.WARNING, logger="nereid.backends.python.warm"):
        # Batches go on, cold, and answered, until three tries failed: each batch after a try's wait starts one.
        assert wait_until(lambda: model.how_it_ran() == "cold" and len(failed_tries()) >= 3, timeout_s=60)
        assert model.parent.cold_reason is not None and model.parent.modules == Preloads()
    failed = ("model 'm': a try at warm start again failed (the warm parent was killed by signal SIGKILL while "
              "starting); runs stay cold, the next try at the first batch after {} s")
    assert failed_tries()[:3] == [failed.format(0.4), failed.format(0.8), failed.format(0.8)]  # doubled, up to 0.8 s
    assert re.fullmatch(r"tried again at (the next batch|the first batch in 1 s) \((\d+) tries failed so far\)|"
                        r"being tried again: a warm parent is starting \((\d+) tries failed so far\)",
                        model.parent.retry_state())
    model.die.unlink()
    assert wait_until(lambda: model.how_it_ran() == "warm", timeout_s=60)  # a later try, once it can start, is warm
    assert model.parent.cold_reason is None and model.parent.retry_state() is None


@pytest.mark.parametrize("when", ["pending", "starting"])
def test_an_unload_while_warm_start_is_to_be_tried_again_leaves_no_process_and_tries_no_more(telling_model, when,
                                                                                              monkeypatch, no_zombies):
    model = telling_model
    cold = go_cold(model)
    model.die.unlink()
    assert re.fullmatch(r"tried again at the first batch in (600|599) s", model.parent.retry_state())
    group_kills: list[tuple[int, bool]] = []  # each pid whose group was killed, and whether it was still unreaped
    kill_group = warm.kill_group
    monkeypatch.setattr(warm, "kill_group", lambda pid: (group_kills.append((pid, os.path.exists(f"/proc/{pid}"))),
                                                         kill_group(pid)))
    model.stall.write_text("")  # a try's parent stalls in its imports until killed
    trying = []
    if when == "starting":
        monkeypatch.setattr(warm, "WARM_RETRY_FIRST_S", 0.0)
        assert model.how_it_ran() == "cold"
        trying = [wait_until(lambda: next(iter(model.stalled_parents()), None), timeout_s=60)]
        assert trying[0] and process_alive(trying[0])
        assert model.parent.retry_state() == "being tried again: a warm parent is starting"
    model.parent.stop()
    assert not retries_running()  # its thread ended with the stop: nothing left to start a parent
    assert not process_alive(cold) and not any(process_alive(pid) for pid in trying)
    assert model.parent.retry_state() is None and model.parent.pid is None
    monkeypatch.setattr(warm, "WARM_RETRY_FIRST_S", 0.0)
    with pytest.raises(Unavailable, match="was unloaded"):
        model.how_it_ran()
    assert not retries_running() and model.stalled_parents() == trying  # no try after the unload
    # A group is killed only while its leader's pid is its own (the warm-retry hunt: the try's thread killed the
    # group of the parent it had reaped already, after the stop had killed it).
    assert all(unreaped for _, unreaped in group_kills), group_kills


def test_batches_running_cold_as_warm_start_comes_back_are_each_answered_once(telling_model, monkeypatch, no_zombies):
    model = telling_model
    cold = go_cold(model)
    model.die.unlink()
    runs, hold = model.folder.parent / "runs", model.folder.parent / "hold"
    hold.write_text("")
    held: list[tuple[list, threading.Thread]] = []
    for _ in range(2):  # two batches running cold, each until the test lets it go on
        outcome: list = []
        thread = threading.Thread(target=lambda outcome=outcome: outcome.append(
            model.how_it_ran({"NEREID_TEST_RUNS": str(runs), "NEREID_TEST_HOLD": str(hold)})))
        thread.start()
        held.append((outcome, thread))
    assert wait_until(lambda: len(list(hold.parent.glob("hold.*"))) == 2, timeout_s=60)
    monkeypatch.setattr(warm, "WARM_RETRY_FIRST_S", 0.0)
    assert model.how_it_ran({"NEREID_TEST_RUNS": str(runs)}) == "cold"  # starts the try
    assert wait_until(lambda: model.parent.cold_reason is None, timeout_s=60)  # swapped in
    assert process_alive(cold)  # still running the two held batches
    assert model.how_it_ran({"NEREID_TEST_RUNS": str(runs)}) == "warm"
    hold.unlink()
    for outcome, thread in held:
        thread.join(60)
        assert outcome == ["cold"]  # answered, by the parent they ran on
    assert wait_until(lambda: not process_alive(cold))  # ended with the last of its runs
    assert len(runs.read_text().split()) == 4  # each batch ran once: the two held, the cold one, the warm one


def test_runs_on_the_cold_parent_warm_start_replaced_that_is_then_killed_are_told_so(telling_model, monkeypatch,
                                                                                    no_zombies):
    """The warm-retry hunt: such a run was told that its "warm parent" was killed and "is restarted for the next
    request", but it ran on the cold parent, which is not restarted: the next request goes to the new warm one."""
    model = telling_model
    cold = go_cold(model)
    model.die.unlink()
    hold = model.folder.parent / "hold"
    hold.write_text("")
    outcome: list = []

    def held_run() -> None:
        try:
            outcome.append(model.how_it_ran({"NEREID_TEST_HOLD": str(hold)}))
        except Exception as err:  # the test looks at it
            outcome.append(err)

    thread = threading.Thread(target=held_run)
    thread.start()
    assert wait_until(lambda: len(list(hold.parent.glob("hold.*"))) == 1, timeout_s=60)
    monkeypatch.setattr(warm, "WARM_RETRY_FIRST_S", 0.0)
    assert model.how_it_ran() == "cold"  # starts the try
    assert wait_until(lambda: model.parent.cold_reason is None, timeout_s=60)  # swapped in; the held run goes on
    os.kill(cold, signal.SIGKILL)
    thread.join(60)
    hold.unlink()
    [failure] = outcome
    assert isinstance(failure, ModelKilled) and str(failure).startswith(
        "model 'm': its parent process was killed by signal SIGKILL ("), failure
    assert str(failure).endswith("), as warm start came back; the next request goes to its new warm parent")
    assert model.how_it_ran() == "warm"


def test_a_model_cold_again_soon_after_warm_start_came_back_waits_longer_than_the_last_time(telling_model, monkeypatch,
                                                                                           caplog, no_zombies):
    # Parents that die again and again, warm start coming back between: not a try every WARM_RETRY_FIRST_S.
    model = telling_model
    go_cold(model)
    model.die.unlink()
    monkeypatch.setattr(warm, "WARM_RETRY_FIRST_S", 0.0)
    assert model.how_it_ran() == "cold"
    assert wait_until(lambda: model.parent.cold_reason is None, timeout_s=60)
    monkeypatch.setattr(warm, "WARM_RETRY_FIRST_S", 600.0)
    with caplog.at_level(logging.WARNING, logger="nereid.backends.python.warm"):
        go_cold(model)
    went_cold = [record.getMessage() for record in caplog.records if "keep ending" in record.getMessage()]
    assert [said.rpartition(": ")[2] for said in went_cold] == [
        "a warm parent is tried again at the first batch after 600 s",
        "a warm parent is tried again at the first batch after 1200 s"]  # the second time, twice as long
    assert re.fullmatch(r"tried again at the first batch in (1200|1199) s", model.parent.retry_state())
