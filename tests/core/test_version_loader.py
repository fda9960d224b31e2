"""One version of a folder loaded: built on its daemon thread, wired to a queue that answers, or refused whole."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from nereid.backend import BackendClaim
from nereid.dtypes import DType
from nereid.errors import ConfigError
from nereid.folder_states import folder_stamp
from nereid.hookspecs import hookimpl
from nereid.model_entry import LoadAbandoned, LoadedVersion, ModelEntry
from nereid.plugins import make_plugin_manager
from nereid.settings import Settings, load_settings
from nereid.stats import ModelStats
from nereid.tensors import NamedTensor
from nereid.version_loader import VersionLoader
from tests import toy_backends
from tests.toy_backends import LOADS, UNLOADS, FaultyToys, write_faulty, write_toy
from tests.support import until


def setup(tmp_path: Path, server_yaml: str = "", load_threads: int = 4,
          toys: tuple[str, ...] = ()) -> tuple[VersionLoader, Settings]:
    """A loader of ``load_threads`` builds at once over ``tmp_path/ml-backends``, holding the toy models ``toys``."""
    (tmp_path / "ml-backends").mkdir()
    (tmp_path / "nereid.yaml").write_text(f'server:\n  ml_backends_path: "ml-backends"\n{server_yaml}')
    manager = make_plugin_manager(load_entry_points=False, extra_plugins=(toy_backends, FaultyToys()))
    settings = load_settings(tmp_path / "nereid.yaml")
    for name in toys:
        write_toy(settings.server.ml_backends_path, name)
    return VersionLoader(manager, tmp_path / "scratch", load_threads=load_threads), settings


def entry_for(settings: Settings, name: str) -> ModelEntry:
    model_settings, origin = settings.model_or_default(name)
    return ModelEntry(name, settings.server.ml_backends_path / name, model_settings, origin)


async def released(loaded: LoadedVersion) -> None:
    await loaded.scheduler.drain(0)
    loaded.hook_threads.release()
    loaded.backend.unload()


def test_a_folder_loads_into_a_version_that_answers(tmp_path):
    loader, settings = setup(tmp_path)
    write_toy(settings.server.ml_backends_path, "adder")
    entry = entry_for(settings, "adder")

    async def scenario() -> None:
        stats = ModelStats()
        loaded = await loader.load(entry, stats, settings)
        try:
            x = NamedTensor("input", DType.FP32, np.zeros((1, 4), np.float32))
            (out,) = await loaded.run([x], 1, 0)
            assert out.data.tolist() == [[1.0, 1.0, 1.0, 1.0]]
            assert loaded.stats is stats and stats.snapshot().execution_count == 1  # counted where its queue ran it
        finally:
            await released(loaded)
        assert (loaded.backend_name, loaded.settings) == ("toy", entry.settings)
        assert loaded.load_seconds >= 0  # (the repository counts it once the version serves)
    asyncio.run(scenario())
    assert entry.generation == 1 and entry.building is None
    assert entry.scratch_names == {"adder"} and (tmp_path / "scratch" / "adder").is_dir()


@pytest.mark.parametrize("watch", [True, False], ids=["dynamic mode", "no watch"])
def test_a_version_keeps_the_stamp_of_the_local_files_it_was_built_from(tmp_path, watch):
    # (Without a watch too: a client's load that waited behind another compares them; the races hunt.)
    loader, settings = setup(tmp_path, "  watch: true\n" if watch else "")
    folder = write_toy(settings.server.ml_backends_path, "adder")

    async def scenario() -> LoadedVersion:
        loaded = await loader.load(entry_for(settings, "adder"), ModelStats(), settings)
        await released(loaded)
        return loaded
    stamp = asyncio.run(scenario()).stamp
    assert stamp is not None and stamp == folder_stamp(folder)[0]  # the files as they are, unchanged since
    (folder / "toy.txt").write_text("edited")
    assert folder_stamp(folder)[0] != stamp  # (an edit since the build is told apart)


def test_an_unload_waiting_for_its_turn_wins_and_nothing_is_built(tmp_path):
    """Found by a bug hunt: the message said the unload "came first", though it was most often sent after the
    load (which waited for its turn behind another load): it sent a client looking for an unload that never was."""
    loader, settings = setup(tmp_path)
    write_toy(settings.server.ml_backends_path, "waited")
    entry = entry_for(settings, "waited")
    entry.unloads_waiting = 1
    loads = LOADS["waited"]
    with pytest.raises(LoadAbandoned, match="an unload or removal of it is waiting for its turn, and wins over a load"):
        asyncio.run(loader.load(entry, ModelStats(), settings))
    assert LOADS["waited"] == loads and entry.generation == 0


def test_a_model_that_loads_but_cannot_be_wired_is_unloaded_before_its_reason_is_raised(tmp_path):
    loader, settings = setup(tmp_path)
    write_faulty(settings.server.ml_backends_path, "unwired", "dependencies_fail")
    entry = entry_for(settings, "unwired")
    loads, unloads = LOADS["unwired"], UNLOADS["unwired"]
    with pytest.raises(ConfigError, match="^model 'unwired': its backend's dependencies\\(\\) raised RuntimeError: "
                                          "dependencies unknown$") as refused:  # (named: e819604)
        asyncio.run(loader.load(entry, ModelStats(), settings))
    assert isinstance(refused.value.__cause__, RuntimeError)  # (the backend's own, as it raised it)
    assert (LOADS["unwired"], UNLOADS["unwired"]) == (loads + 1, unloads + 1)  # what load() acquired was released
    assert entry.generation == 0


def test_a_folder_leading_outside_the_repository_is_refused_before_its_backend_sees_it(tmp_path):
    loader, settings = setup(tmp_path)
    outside = write_toy(tmp_path / "elsewhere", "escape")
    (settings.server.ml_backends_path / "escape").symlink_to(outside)
    loads = LOADS["escape"]
    with pytest.raises(ConfigError, match="symlink to a path outside ml_backends_path"):
        asyncio.run(loader.load(entry_for(settings, "escape"), ModelStats(), settings))
    assert LOADS["escape"] == loads



def counting_loads(monkeypatch, hangs: str = "") -> tuple[list[int], threading.Event]:
    """Have the toy backend's load() take 0.2 s (model ``hangs``: until the event is set, at most 10 s), and
    count the most load() calls running at once (the list's one item)."""
    running, most, lock, release = set(), [0], threading.Lock(), threading.Event()
    load = toy_backends.ToyModel.load

    def counted(self) -> None:
        with lock:
            running.add(self.context.name)
            most[0] = max(most[0], len(running))
        release.wait(10 if self.context.name == hangs else 0.2)
        with lock:
            running.discard(self.context.name)
        load(self)

    monkeypatch.setattr(toy_backends.ToyModel, "load", counted)
    return most, release


def test_at_most_model_load_threads_builds_run_at_once(tmp_path, monkeypatch):
    """Found by a scale hunt: every folder's build started at once (300-500 at start), their threads kept the
    event loop from the GIL, and liveness went unanswered for 10-30 s (a liveness probe kills such a server)."""
    names = [f"m{i}" for i in range(5)]
    loader, settings = setup(tmp_path, load_threads=2, toys=tuple(names))
    most, _ = counting_loads(monkeypatch)

    async def scenario() -> None:
        versions = await asyncio.gather(*(loader.load(entry_for(settings, n), ModelStats(), settings) for n in names))
        for loaded in versions:
            await released(loaded)
    asyncio.run(scenario())
    assert most[0] == 2  # five asked for at once


def test_a_build_running_long_gives_its_turn_up(tmp_path, monkeypatch):
    """A load() still running after LONG_LOAD_NOTE_S lets the next build start: one that never returns must not
    keep every other folder from loading."""
    from nereid import backend_calls

    loader, settings = setup(tmp_path, load_threads=1, toys=("hung", "next"))
    most, release = counting_loads(monkeypatch, hangs="hung")
    monkeypatch.setattr(backend_calls, "LONG_LOAD_NOTE_S", 0.3)

    async def scenario() -> None:
        hung = asyncio.ensure_future(loader.load(entry_for(settings, "hung"), ModelStats(), settings))
        await asyncio.sleep(0.05)
        following = await asyncio.wait_for(loader.load(entry_for(settings, "next"), ModelStats(), settings), 8)
        assert not hung.done() and most[0] == 2  # (one slot: the second started once the first gave it up)
        release.set()
        for loaded in (following, await hung):
            await released(loaded)
    try:
        asyncio.run(scenario())
    finally:
        release.set()


def test_an_unload_does_not_wait_for_a_load_waiting_for_its_turn(tmp_path, monkeypatch):
    """Found by the session's review: a load waiting for a build's place held its model, and an unload of it
    (which can give up only on a build under way) waited for every build before it (16.7 s in its run)."""
    loader, settings = setup(tmp_path, load_threads=1, toys=("slow", "quick"))
    most, release = counting_loads(monkeypatch, hangs="slow")
    quick = entry_for(settings, "quick")

    async def scenario() -> None:
        slow = asyncio.ensure_future(loader.load(entry_for(settings, "slow"), ModelStats(), settings))
        # (Waited for, not slept: 0.05 s once left 'quick' stamping its folder, not yet waiting, so the unload had
        # nothing to give up and waited 5 s; a full run on a quiet machine.)
        await until(lambda: most[0] == 1, what="the slow load holding the one place")
        waiting = asyncio.ensure_future(loader.load(quick, ModelStats(), settings))
        await until(lambda: quick.building is not None, what="the quick load waiting for its turn")
        assert not waiting.done()

        async def unload() -> None:
            async with quick.held_for_unload():
                pass
        started = asyncio.get_running_loop().time()
        await asyncio.gather(unload(), asyncio.wait_for(asyncio.shield(waiting), 5), return_exceptions=True)
        assert asyncio.get_running_loop().time() - started < 2
        with pytest.raises(LoadAbandoned, match="came while it waited for its turn to load"):
            waiting.result()
        release.set()
        await released(await slow)
        loaded = await asyncio.wait_for(loader.load(quick, ModelStats(), settings), 5)  # the place was given back
        await released(loaded)
    try:
        asyncio.run(scenario())
    finally:
        release.set()


class StuckBackend:
    """The ``stuck`` backend plugin: it claims folders holding ``stuck.txt`` as a toy model that counts its unloads
    (toy_backends.FaultyModel), its claim hook (``stuck.txt`` says "claim") or its create() ("create") blocking
    until ``release`` is set (10 s at most)."""

    BACKEND_NAME = "stuck"

    def __init__(self) -> None:
        self.release, self.entered = threading.Event(), threading.Event()

    def _held(self) -> None:
        self.entered.set()
        self.release.wait(10)

    def _create(self, context):
        self.context = context
        self._held()
        return toy_backends.FaultyModel(context)

    @hookimpl
    def nereid_claim_model(self, folder: Path, declared: bool) -> BackendClaim | None:
        marker = folder / "stuck.txt"
        if not marker.is_file():
            return None
        if marker.read_text() == "claim":
            self._held()
            return BackendClaim(toy_backends.FaultyModel)
        return BackendClaim(self._create)


def stuck_loader(tmp_path: Path, step: str) -> tuple[VersionLoader, Settings, StuckBackend, ModelEntry]:
    """A loader whose plugins include a :class:`StuckBackend`, and the entry of a folder it hangs on at ``step``."""
    _, settings = setup(tmp_path)
    stuck = StuckBackend()
    folder = write_toy(settings.server.ml_backends_path, "held")
    (folder / "toy.txt").unlink()  # the stuck backend's alone
    (folder / "stuck.txt").write_text(step)
    manager = make_plugin_manager(load_entry_points=False, extra_plugins=(toy_backends, stuck))
    return VersionLoader(manager, tmp_path / "scratch"), settings, stuck, entry_for(settings, "held")


@pytest.mark.parametrize("step, held_by", [("claim", "the nereid_claim_model hook of plugin 'stuck'"),
                                           ("create", "the create() of plugin 'stuck'")])
def test_the_note_of_a_load_running_long_names_the_plugin_step_that_holds_it(tmp_path, monkeypatch, caplog,
                                                                             step, held_by):
    """Found by a bug hunt: a plugin's claim hook (or its create()) that hung was said, every minute, to be the
    backend's load(), which had never been called: the operator looked in the wrong code."""
    from nereid import backend_calls

    loader, settings, stuck, entry = stuck_loader(tmp_path, step)
    monkeypatch.setattr(backend_calls, "LONG_LOAD_NOTE_S", 0.1)
    caplog.set_level(logging.WARNING, "nereid.backend_calls")

    def notes() -> list[str]:
        return [r.getMessage() for r in caplog.records if "still loading" in r.getMessage()]

    async def scenario() -> None:
        loading = asyncio.ensure_future(loader.load(entry, ModelStats(), settings))
        for _ in range(100):
            if notes():
                break
            await asyncio.sleep(0.05)
        stuck.release.set()
        await released(await asyncio.wait_for(loading, 5))  # (its load goes on once the step returns)
    try:
        asyncio.run(scenario())
    finally:
        stuck.release.set()
    assert notes() and notes()[0] == (f"model 'held' is still loading after 0 s: {held_by} has not returned (a "
                                      "RepositoryModelUnload of it gives up on the load)")


def test_a_build_given_up_on_is_told_through_its_context(tmp_path):
    """The native hunt: a compile went on for up to 600 s after its load was abandoned, holding a compile slot.
    The context's ``abandoned`` is set as the load is given up on, so a build can stop early."""
    loader, settings, stuck, entry = stuck_loader(tmp_path, "create")

    async def scenario() -> None:
        loading = asyncio.ensure_future(loader.load(entry, ModelStats(), settings))
        assert await asyncio.to_thread(stuck.entered.wait, 5)
        assert not stuck.context.abandoned.is_set()
        async with entry.held_for_unload():
            pass
        with pytest.raises(LoadAbandoned):
            await asyncio.wait_for(loading, 5)
        assert stuck.context.abandoned.is_set()
    try:
        asyncio.run(scenario())
    finally:
        stuck.release.set()


def test_a_load_abandoned_while_a_claim_hook_hangs_says_the_claim_held_it(tmp_path):
    """Found by a bug hunt: an unload giving up on a load held by a plugin's claim hook said the load was
    abandoned "while its backend's load() was still running", a load() never called."""
    loader, settings, stuck, entry = stuck_loader(tmp_path, "claim")

    async def scenario() -> None:
        loading = asyncio.ensure_future(loader.load(entry, ModelStats(), settings))
        assert await asyncio.to_thread(stuck.entered.wait, 5)

        async def unload() -> None:
            async with entry.held_for_unload():
                pass
        await unload()
        with pytest.raises(LoadAbandoned) as abandoned:
            await asyncio.wait_for(loading, 5)
        assert re.fullmatch(r"model 'held': load abandoned after \d+\.\d s: an unload or removal of it came while "
                            r"the nereid_claim_model hook of plugin 'stuck' was still running \(if that ever "
                            r"returns, what it built is unloaded\)", str(abandoned.value)), abandoned.value
    unloads = UNLOADS["held"]
    try:
        asyncio.run(scenario())
    finally:
        stuck.release.set()
    deadline = time.monotonic() + 5  # what the claim let the build load once released is unloaded, not leaked
    while UNLOADS["held"] == unloads and time.monotonic() < deadline:
        time.sleep(0.01)
    assert UNLOADS["held"] == unloads + 1


def test_a_folder_that_keeps_triton_s_files_is_warned_of_once_per_load(tmp_path, caplog):
    """The migration hunt: a folder that kept its config.pbtxt and version folders loaded READY without a word,
    its instances, batching window and version policy dropped."""
    loader, settings = setup(tmp_path, toys=("kept",))
    folder = settings.server.ml_backends_path / "kept"
    (folder / "config.pbtxt").write_text('name: "kept"\ninstance_group [ { count: 3 } ]\n')
    (folder / "1").mkdir()
    (folder / "1" / "model.py").write_text("")
    entry = entry_for(settings, "kept")
    caplog.set_level(logging.WARNING, "nereid.repository")

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]

    async def scenario() -> None:
        for load in (1, 2):
            await released(await loader.load(entry, ModelStats(), settings))
            assert len(warnings()) == load, warnings()
    asyncio.run(scenario())
    assert warnings()[0] == ("model 'kept': its config.pbtxt and version folder 1/ are not read: its instance_group "
                             "(instances are nereid.yaml's instances: and device:) does not apply, and 1/model.py does "
                             "not run (the model is the files at the top of its folder, its one version 1); remove "
                             "them (the README's 'Coming from Triton' maps each part)")



async def holding_a_turn(turns, until_set: asyncio.Event, inside: list[int] | None = None, index: int = 0) -> None:
    """Hold a turn of ``turns`` until ``until_set`` is set, listed in ``inside`` meanwhile."""
    async with turns.turn():
        inside = inside if inside is not None else []
        inside.append(index)
        await until_set.wait()
        inside.remove(index)


def released_event() -> asyncio.Event:
    event = asyncio.Event()
    event.set()
    return event


def test_releases_take_turns_and_one_that_hangs_gives_its_turn_up():
    """The scale hunt: every unload's release took a thread at once (250 of them held liveness for 2.1 s). At most
    ``count`` at once, the others waiting; one still running after ``longest_s`` lets the next go."""
    from nereid.version_loader import UnloadTurns

    async def scenario() -> None:
        turns, go, inside = UnloadTurns(2, longest_s=600), asyncio.Event(), []
        tasks = [asyncio.ensure_future(holding_a_turn(turns, go, inside, index)) for index in range(5)]
        await until(lambda: turns.waiting == 3, what="three waiting")
        assert sorted(inside) == [0, 1]  # (in order: the first two came first)
        go.set()
        await asyncio.gather(*tasks)
        assert turns.waiting == 0 and inside == []

        # One that hangs (its backend's unload never returns) holds its turn for longest_s only.
        turns, hang = UnloadTurns(1, longest_s=0.05), asyncio.Event()
        stuck = asyncio.ensure_future(holding_a_turn(turns, hang))
        await until(lambda: turns.waiting == 0 and not stuck.done(), what="the first holding its turn")
        await asyncio.wait_for(holding_a_turn(turns, released_event()), 30)
        assert not stuck.done()
        hang.set()
        await stuck

        # The server stopping: those waiting go at once, and later ones never wait.
        turns, hold = UnloadTurns(1), asyncio.Event()
        first = asyncio.ensure_future(holding_a_turn(turns, hold))
        waiting = [asyncio.ensure_future(holding_a_turn(turns, released_event())) for _ in range(3)]
        await until(lambda: turns.waiting == 3, what="three waiting behind the first")
        turns.open()
        await asyncio.wait_for(asyncio.gather(*waiting), 30)
        await asyncio.wait_for(holding_a_turn(turns, released_event()), 30)
        assert not first.done()
        hold.set()
        await first
    asyncio.run(scenario())
