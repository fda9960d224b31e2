"""Dynamic mode without a server: what the watcher follows, and what it does (and leaves alone) on a change.

A toy repository and a RepositoryWatcher, driven either through ``apply()``
(with ``watch_settle_ms: 0`` the second apply after a change acts on it) or,
where the file watch itself matters, through ``run()`` with a short settle time.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import threading
import time
from collections import Counter
from pathlib import Path
from typing import AsyncIterator

import numpy as np
import pytest

import toy_backends
from nereid.backend import BackendClaim
from nereid.dtypes import DType
from nereid.folder_states import plan_changes, scan_repository
from nereid.hookspecs import hookimpl
from nereid.plugins import make_plugin_manager
from nereid.model_entry import NOT_LISTED_REASON, ModelState
from nereid.repository import ModelRepository
from nereid.runtime_options import RuntimeOptions
from nereid.settings import load_settings
from nereid.tensors import NamedTensor
from nereid.watch import RepositoryWatcher
from toy_backends import ToyModel, write_toy
from support import until


class SlowToy(ToyModel):
    """A toy whose every batch takes ``slow.txt``'s seconds, or, where it says ``gate``, until the test sets
    ``SlowToy.gate`` (a test that must tell a change that waited for the batch from one that did not, however slow
    the machine); ``started[name]`` counts the batches that have read it (a test waits for one to be running:
    nothing written into a folder the watcher follows)."""

    started: Counter[str] = Counter()
    gate = threading.Event()

    def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        text = (self.context.folder / "slow.txt").read_text()
        SlowToy.started[self.context.name] += 1
        if text == "gate":
            SlowToy.gate.wait(30)
        else:
            time.sleep(float(text))
        return super().infer(inputs)


def a_closed_gate() -> None:
    """Close ``SlowToy.gate`` for this test (a fresh Event: one a batch of an earlier test still waits on stays)."""
    SlowToy.gate = threading.Event()


async def running(name: str, before: int) -> None:
    """Until a slow toy's batch of model ``name`` beyond the first ``before`` has begun (a fixed sleep let the test
    go on before it had: the review of the tests)."""
    await until(lambda: SlowToy.started[name] > before, what=f"a batch of '{name}' running")


class PickyToy(ToyModel):
    """A toy whose runtime options (its own, or nereid.yaml's ``backends.picky``) may only be ``warm_start``."""

    def load(self) -> None:
        RuntimeOptions(self.context.settings.runtime, self.context.settings_origin, "picky", {"warm_start"})
        super().load()


class GatedToy(ToyModel):
    """The toy (whose load waits for the file ``gate.txt`` names: a load as long as the test wants, a large
    model compiling) under a backend name of its own, ``gated``."""


class Plugins:
    """``slow`` claims folders holding slow.txt; ``picky`` those holding picky.txt; ``gated`` gate.txt."""

    class Slow:
        BACKEND_NAME = "slow"

        @hookimpl
        def nereid_claim_model(self, folder: Path, declared: bool) -> BackendClaim | None:
            return BackendClaim(SlowToy) if (folder / "slow.txt").is_file() else None

    class Picky:
        BACKEND_NAME = "picky"

        @hookimpl
        def nereid_claim_model(self, folder: Path, declared: bool) -> BackendClaim | None:
            return BackendClaim(PickyToy) if (folder / "picky.txt").is_file() else None

    class Gated:
        BACKEND_NAME = "gated"

        @hookimpl
        def nereid_claim_model(self, folder: Path, declared: bool) -> BackendClaim | None:
            return BackendClaim(GatedToy) if (folder / "gate.txt").is_file() else None


def setup(tmp_path: Path, root: Path, models: str = "", settle_ms: int = 0, extra: str = "",
          config_dir: Path | None = None, tail: str = "", poll_s: float = 60) -> tuple[ModelRepository,
                                                                                      RepositoryWatcher]:
    """A toy repository over ``root`` (nereid.yaml in ``config_dir``, default tmp_path) and its watcher.

    ``extra`` goes into the ``server:`` section, ``tail`` after ``models:``.
    """
    config = (config_dir or tmp_path) / "nereid.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(f'server:\n  ml_backends_path: "{root}"\n  metrics_addr: ""\n  http_addr: ""\n'
                      f"  watch: true\n  watch_settle_ms: {settle_ms}\n  watch_poll_s: {poll_s}\n{extra}"
                      + (f"models:\n{models}" if models else "") + tail)
    settings = load_settings(config)
    manager = make_plugin_manager(load_entry_points=False,
                                  extra_plugins=(toy_backends, Plugins.Slow(), Plugins.Picky(),
                                                 Plugins.Gated()))
    (tmp_path / "scratch").mkdir(exist_ok=True)
    repository = ModelRepository(settings, manager, tmp_path / "scratch")
    return repository, RepositoryWatcher(repository, settings)


async def start(repository: ModelRepository, watcher: RepositoryWatcher) -> None:
    """What the server does at start in dynamic mode."""
    await watcher.prime()
    repository.watch_started()
    await asyncio.gather(*(repository.load(name) for name in repository.startup_models()))


@contextlib.asynccontextmanager
async def following(repository: ModelRepository, watcher: RepositoryWatcher) -> AsyncIterator[None]:
    """The server in dynamic mode, its watcher following the folder (its watches up) for the body's length; then
    stopped, and every model unloaded."""
    await start(repository, watcher)
    running = asyncio.create_task(watcher.run())
    try:
        await asyncio.sleep(0.2)  # the watches are up
        yield
    finally:
        watcher.stop()
        await running
        await repository.unload_all()


async def apply(watcher: RepositoryWatcher) -> None:
    """One scan, taking turns with the scans the watcher schedules itself (as its watches do), and the loads,
    reloads and unloads under way once it is done: its own, and those of a scan the watcher scheduled (with a
    settle time of 0, due at once) that went first."""
    await watcher._apply_serialized()
    await asyncio.gather(*watcher._changes)


async def settled(watcher: RepositoryWatcher) -> None:
    """With a settle time of 0: the first apply sees a change, the second acts on it."""
    await apply(watcher)
    await apply(watcher)


def generation(repository: ModelRepository, name: str) -> int:
    entry = repository._entries.get(name)
    return entry.generation if entry is not None and entry.state is ModelState.READY else 0


def write_other(root: Path, name: str, marker: str, text: str = "") -> Path:
    """A folder the ``slow`` or ``picky`` toy claims (``marker``: slow.txt or picky.txt), not the plain toy."""
    folder = write_toy(root, name)
    (folder / "toy.txt").unlink()
    (folder / marker).write_text(text)
    return folder


def edit(folder: Path, text: str) -> None:
    """Change a file of a toy model folder (toy.txt, which the toy does not read)."""
    (folder / "toy.txt").write_text(text)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "srv" / "ml-backends").mkdir(parents=True)
    return tmp_path / "srv" / "ml-backends"


# -- defect: a folder replaced by one with the same names, sizes and mtimes was never reloaded -----------------

def test_a_folder_replaced_by_one_with_the_same_names_sizes_and_mtimes_is_a_change(tmp_path):
    """tar, zip, OCI layers and reproducible builds fix every mtime (to 1980 here): (name, size, mtime) was the
    stamp, so `rm -rf m; mv m.new m` with other contents of the same sizes was never reloaded."""
    def unpack(folder: Path, factor: str) -> None:
        folder.mkdir(parents=True)
        (folder / "main.py").write_text(f"FACTOR = {factor}\n")
        os.utime(folder / "main.py", (315532800, 315532800))
    unpack(tmp_path / "repo" / "m", "1")
    before = scan_repository(tmp_path / "repo")
    unpack(tmp_path / "m.new", "2")
    shutil.rmtree(tmp_path / "repo" / "m")
    os.rename(tmp_path / "m.new", tmp_path / "repo" / "m")
    assert plan_changes(before, scan_repository(tmp_path / "repo")).changed == ("m",)
    os.utime(tmp_path / "repo" / "m" / "main.py", (315532800, 315532800))  # touched back: still the new file
    assert plan_changes(before, scan_repository(tmp_path / "repo")).changed == ("m",)


# -- defect: after ml-backends was replaced as a whole, nothing in the new one was acted on --------------------

@pytest.mark.parametrize("how", ["mv", "symlink", "recreate"])
def test_a_replaced_ml_backends_path_is_followed_anew(tmp_path, how):
    srv = tmp_path / "srv"
    (srv / "v1").mkdir(parents=True)
    write_toy(srv / "v1", "first")
    root = srv / "ml-backends"
    if how == "symlink":
        os.symlink("v1", root)
    else:
        os.rename(srv / "v1", root)
    # nereid.yaml elsewhere: only a watch of ml-backends' own folder sees it replaced.
    repository, watcher = setup(tmp_path, root, settle_ms=50, config_dir=tmp_path / "cfg")

    async def scenario() -> None:
        async with following(repository, watcher):
            shutil.copytree(root, srv / "v2")
            if how == "symlink":
                os.symlink("v2", srv / "new-link")
                os.rename(srv / "new-link", root)  # an atomic switch of the link
                shutil.rmtree(srv / "v1")
            elif how == "mv":
                os.rename(root, srv / "old")
                os.rename(srv / "v2", root)
                shutil.rmtree(srv / "old")
            else:
                shutil.rmtree(root)
                os.rename(srv / "v2", root)
            await until(lambda: generation(repository, "first") == 2, what="the new copy of 'first' reloaded")
            write_toy(root, "later")  # in the new ml-backends
            await until(lambda: generation(repository, "later") == 1, what="'later' in the new folder loaded")
            edit(root / "later", "edited")
            await until(lambda: generation(repository, "later") == 2, what="the edit of 'later' reloaded")
    asyncio.run(scenario())


# -- defect: edits inside symlinked model folders were not seen ----------------------------------------------

@pytest.mark.parametrize("where", ["inside", "added", "switched"])
def test_edits_in_a_symlinked_model_folder_reload_it(tmp_path, root, where):
    """inside: m -> .versions/m-v1 in ml-backends (the watch reported its files under the hidden path);
    added: the link made while serving; switched: the link re-pointed while serving (the watch kept the old)."""
    versions = root / ".versions" if where == "inside" else tmp_path / "ext"
    write_toy(versions, "m-v1")
    if where == "switched":
        write_toy(versions, "m-v0")
        os.symlink(versions / "m-v0", root / "m")
    elif where == "inside":
        os.symlink(".versions/m-v1", root / "m")
    repository, watcher = setup(tmp_path, root, settle_ms=50, extra="  follow_symlinks: true\n")

    async def scenario() -> None:
        async with following(repository, watcher):
            if where == "added":
                os.symlink(versions / "m-v1", root / "m")
            elif where == "switched":
                os.symlink(versions / "m-v1", root / ".switch")
                os.rename(root / ".switch", root / "m")
            expected = {"inside": 1, "added": 1, "switched": 2}[where]
            await until(lambda: generation(repository, "m") == expected, what=f"'m' at version {expected}")
            edit(root / "m", "edited through the link")
            await until(lambda: generation(repository, "m") == expected + 1, what="the edit reloaded 'm'")
    asyncio.run(scenario())


# -- defect: a symlinked model folder whose target was missing never loaded when the target came --------------

@pytest.mark.parametrize("where", ["outside, link made first", "inside, removed and deployed again"])
def test_a_model_folder_link_loads_when_its_missing_target_arrives(tmp_path, root, where):
    """A listing skips a link that leads nowhere and no watch can start on a folder that is not there: the
    target's arrival made no event that counted (one in .versions/ was hidden), so the model loaded only at some
    unrelated change."""
    inside = where.startswith("inside")
    versions = root / ".versions" if inside else tmp_path / "ext" / "deep"  # (ext/ itself not there yet)
    if inside:
        write_toy(versions, "m-v1")
    os.symlink(".versions/m-v1" if inside else versions / "m-v1", root / "m")
    repository, watcher = setup(tmp_path, root, settle_ms=50, extra="  follow_symlinks: true\n")

    async def scenario() -> None:
        async with following(repository, watcher):
            if inside:
                assert generation(repository, "m") == 1
                shutil.rmtree(versions / "m-v1")
                await until(lambda: "m" not in repository._entries, what="'m' unloaded once its target went")
                await asyncio.sleep(0.2)  # (the watches follow the link's way now)
            write_toy(versions, "m-v1")
            await until(lambda: generation(repository, "m") == 1, what="'m' loaded once its target arrived")
            edit(root / "m", "edited through the link")
            await until(lambda: generation(repository, "m") == 2, what="the edit reloaded 'm'")
    asyncio.run(scenario())


# -- defect: an edit loaded models deliberately not served ---------------------------------------------------

def test_an_edit_never_loads_a_model_that_is_not_served(tmp_path, root):
    for name in ("listed", "unlisted", "dropped", "broken"):
        write_toy(root, name)
    (root / "broken" / "fail.txt").write_text("half a copy")
    models = "  - name: listed\n  - name: dropped\n  - name: broken\n"
    repository, watcher = setup(tmp_path, root, models=models)
    config = Path(repository.settings.source)

    async def scenario() -> None:
        await start(repository, watcher)
        # Unlisted at start: an edit leaves it "not listed" (it loaded with defaults, and ServerReady
        # could turn false when that failed).
        (root / "unlisted" / "fail.txt").write_text("a bad edit")
        await settled(watcher)
        assert repository.entry("unlisted").loaded is None
        assert repository.entry("unlisted").reason == NOT_LISTED_REASON
        # Unloaded by RepositoryModelUnload: an edit leaves it unloaded.
        await repository.unload("listed")
        edit(root / "listed", "edited")
        await settled(watcher)
        assert (repository.entry("listed").loaded, repository.entry("listed").reason) == (None, "unloaded")
        # Its nereid.yaml entry removed: unloaded, and an edit leaves it so (it loaded with default settings).
        config.write_text(config.read_text().replace("  - name: dropped\n", ""))
        await apply(watcher)
        assert repository.entry("dropped").loaded is None
        edit(root / "dropped", "edited")
        await settled(watcher)
        assert (repository.entry("dropped").loaded, repository.entry("dropped").reason) == (None, NOT_LISTED_REASON)
        # A listed model whose load failed is still tried again when its files change.
        (root / "broken" / "fail.txt").unlink()
        await settled(watcher)
        assert repository.entry("broken").state is ModelState.READY
        assert repository.server_ready()  # the failed load of "unlisted" counts for nothing
        await repository.unload_all()
    asyncio.run(scenario())


# -- defect: a slow load held up every other change -----------------------------------------------------------

@pytest.mark.parametrize("started_by", ["folder", "nereid.yaml"])
def test_a_load_that_takes_long_holds_up_no_other_change(tmp_path, root, started_by):
    """A folder copied in did not appear until a load under way (25 s of a model.py's import, in the
    reproduction; a large model compiles for minutes) had ended: every scan waited for its loads."""
    release = tmp_path / "release"
    big = write_toy(root, "big")
    (big / "toy.txt").unlink()
    repository, watcher = setup(tmp_path, root, models="  - name: big\n    queue_capacity: 4\n")
    config = Path(repository.settings.source)

    async def scenario() -> None:
        await start(repository, watcher)
        assert repository.entry("big").state is ModelState.UNAVAILABLE  # (no backend claims it yet)
        (big / "gate.txt").write_text(str(release))
        if started_by == "nereid.yaml":  # its entry edited (loaded again: its last load failed) with its files
            config.write_text(config.read_text().replace("queue_capacity: 4", "queue_capacity: 8"))
        await watcher._apply_serialized()  # seen (settle time 0: acted on at the next look)
        loading = await watcher._apply_serialized()
        await until(lambda: repository.entry("big").state is ModelState.LOADING, what="big loading")
        write_toy(root, "small")
        started = time.monotonic()
        await watcher._apply_serialized()  # seen; loaded by the next scan (this test's, or one the watcher
        await watcher._apply_serialized()  # schedules), while big's load goes on
        await until(lambda: repository.entry("small").state is ModelState.READY, what="small loaded")
        assert time.monotonic() - started < 10
        assert repository.entry("big").state is ModelState.LOADING and not loading.done()
        release.touch()
        await loading
        assert repository.entry("big").state is ModelState.READY
        await repository.unload_all()
    asyncio.run(scenario())


def submitted(repository: ModelRepository, name: str) -> asyncio.Task:
    """A one-row request submitted to ``name``'s queue, as a task (a slow toy's runs until its slow.txt's time)."""
    x = NamedTensor("input", DType.FP32, np.zeros((1, 4), np.float32))
    return asyncio.create_task(repository.ready_model(name).scheduler.submit([x], 1, 0))


def write_gated(root: Path, name: str, release: Path) -> Path:
    """A folder the ``gated`` toy claims: its load waits until ``release`` exists."""
    folder = write_toy(root, name)
    (folder / "toy.txt").unlink()
    (folder / "gate.txt").write_text(str(release))
    return folder


def test_a_folder_edited_while_its_load_runs_is_loaded_as_edited(tmp_path, root):
    """Review of the change above: the edit's reload, queued behind the load under way, found the model
    "loaded meanwhile" and did nothing; the model served the files from before the edit for good."""
    release = tmp_path / "release"
    repository, watcher = setup(tmp_path, root)

    async def scenario() -> None:
        await start(repository, watcher)
        folder = write_gated(root, "a", release)
        await watcher._apply_serialized()  # seen
        await watcher._apply_serialized()  # its load starts
        await until(lambda: repository.entry("a").state is ModelState.LOADING, what="a loading")
        (folder / "extra.txt").write_text("an edit while it loads")
        await watcher._apply_serialized()  # seen
        await watcher._apply_serialized()  # its reload waits for the load
        release.touch()
        await asyncio.gather(*watcher._changes)
        assert repository.entry("a").state is ModelState.READY
        assert repository.loaded_stamp("a") == scan_repository(root)["a"].stamp
        await repository.unload_all()
    asyncio.run(scenario())


@pytest.mark.parametrize("edit, built_with", [
    # Its own entry: the load nereid.yaml asked for found the model loaded meanwhile and did nothing.
    ("models:\n  - name: b\n    queue_capacity: 3\n", lambda settings: settings.queue_capacity == 3),
    # A backends: default: only the entry and the files were compared (a second review's find).
    ("backends:\n  gated:\n    colour: blue\n", lambda settings: dict(settings.runtime) == {"colour": "blue"}),
])
def test_a_nereid_yaml_edit_while_the_folder_loads_is_loaded_with_it(tmp_path, root, edit, built_with):
    """Review of the change above: the model ran with the settings it had started loading with."""
    release = tmp_path / "release"
    repository, watcher = setup(tmp_path, root)
    config = Path(repository.settings.source)

    async def scenario() -> None:
        await start(repository, watcher)
        write_gated(root, "b", release)
        await watcher._apply_serialized()
        await watcher._apply_serialized()
        await until(lambda: repository.entry("b").state is ModelState.LOADING, what="b loading")
        config.write_text(config.read_text() + edit)
        await watcher._apply_serialized()  # applied (settle time 0): its load of b waits for the one under way
        release.touch()
        while watcher._changes:
            await asyncio.gather(*watcher._changes)
        loaded = repository.entry("b").loaded
        assert loaded is not None and built_with(loaded.backend.context.settings)  # (what it was built with)
        await repository.unload_all()
    asyncio.run(scenario())


def test_a_folder_renamed_while_its_model_reloads_is_moved_not_removed(tmp_path, root):
    """Review: the old name, no longer a folder the watcher knew, was taken for a model loaded by request whose
    folder had gone: removed (its reload abandoned), and the new name loaded anew."""
    release = tmp_path / "release"
    release.touch()
    repository, watcher = setup(tmp_path, root)

    async def scenario() -> None:
        await start(repository, watcher)
        folder = write_gated(root, "a", release)
        await apply(watcher)
        await apply(watcher)
        assert repository.entry("a").state is ModelState.READY
        release.unlink()
        (folder / "extra.txt").write_text("an edit")
        await watcher._apply_serialized()
        await watcher._apply_serialized()  # its reload starts and waits
        await until(lambda: repository.entry("a").building is not None, what="a reloading")
        folder.rename(root / "b")
        for _ in range(4):
            await watcher._apply_serialized()
            await asyncio.sleep(0.05)
        release.touch()
        while watcher._changes:
            await asyncio.gather(*watcher._changes)
        assert repository.entry("b").state is ModelState.READY
        assert repository.generation("b") == 2  # moved (version 1), then its edited files loaded: not loaded anew
        assert repository.loaded_stamp("b") == scan_repository(root)["b"].stamp
        await repository.unload_all()
    asyncio.run(scenario())


def test_a_stop_during_a_scan_leaves_nothing_loading_after_the_models_are_unloaded(tmp_path, root, monkeypatch):
    """Review of the change above: a scan stopped while it looked at the folders started its work after stop()
    had cancelled the work under way, and a model loaded after the server had unloaded every model."""
    release = tmp_path / "release"
    write_gated(root, "late", release)
    repository, watcher = setup(tmp_path, root, models="  - name: other\n")
    write_toy(root, "other")
    config = Path(repository.settings.source)
    looking = asyncio.Event()

    async def scenario() -> None:
        await start(repository, watcher)
        look = watcher._look

        def slow_look():  # (a store's listing can take seconds)
            looking_loop.call_soon_threadsafe(looking.set)
            time.sleep(0.5)
            return look()
        looking_loop = asyncio.get_running_loop()
        monkeypatch.setattr(watcher, "_look", slow_look)
        config.write_text(config.read_text() + "  - name: late\n")
        scan = asyncio.create_task(watcher._apply_serialized())
        await looking.wait()  # nereid.yaml applied, late's load started; the scan looks at the folders
        await until(lambda: repository.entry("late").state is ModelState.LOADING, what="late loading")
        watcher.stop()  # what the server's stop does
        scan.cancel()
        await asyncio.gather(scan, return_exceptions=True)
        await repository.unload_all(grace_s=0)
        release.touch()
        await asyncio.sleep(0.3)
        assert repository.entry("late").loaded is None and repository.entry("late").state is not ModelState.READY
    asyncio.run(scenario())


def test_a_load_that_takes_long_is_said_in_the_log_while_it_runs(tmp_path, root, monkeypatch, caplog):
    """A load of minutes was silent until it ended: nothing told an operator which model held readiness back."""
    import logging

    from nereid import backend_calls

    monkeypatch.setattr(backend_calls, "LONG_LOAD_NOTE_S", 0.2)
    caplog.set_level(logging.WARNING, "nereid.backend_calls")
    release = tmp_path / "release"
    repository, watcher = setup(tmp_path, root)

    async def scenario() -> None:
        await start(repository, watcher)
        write_gated(root, "slow_to_load", release)
        loading = asyncio.create_task(repository.load("slow_to_load"))
        await until(lambda: any("still loading" in r.getMessage() for r in caplog.records), what="the note")
        release.touch()
        assert (await loading).state is ModelState.READY
        await repository.unload_all()
    asyncio.run(scenario())
    note = next(r.getMessage() for r in caplog.records if "still loading" in r.getMessage())
    assert note.startswith("model 'slow_to_load' is still loading after 0 s: its backend's load() has not returned")


def toy_with_weights(root: Path, name: str) -> Path:
    """A toy model folder with a 192 KiB ``weights.bin``, whose middle an edit can change leaving the folder's
    content identity (names, sizes, the bytes at both ends of each file) as it was."""
    folder = write_toy(root, name)
    (folder / "weights.bin").write_bytes(bytes(192 * 1024))
    return folder


def edit_the_middle(folder: Path) -> None:
    """Rewrite the middle of ``folder``'s weights.bin in place: same size, same ends, same inode."""
    with open(folder / "weights.bin", "r+b") as weights:
        os.pwrite(weights.fileno(), b"edited" * 16, 96 * 1024)


def test_a_folder_copied_then_deleted_moves_its_model_and_loads_nothing(tmp_path, root):
    """A copy then the original deleted was moved, then loaded again from the copy (its new inodes matched no
    stamp), where the README says nothing is read again: the server's copy-then-delete test raced that reload."""
    folder = write_toy(root, "a")
    repository, watcher = setup(tmp_path, root)

    async def scenario() -> None:
        await start(repository, watcher)
        backend = repository.entry("a").loaded.backend
        shutil.copytree(folder, root / "b", copy_function=shutil.copy)
        shutil.rmtree(folder)
        await apply(watcher)
        while watcher._changes:
            await asyncio.gather(*watcher._changes)
        assert repository.entry("b").loaded.backend is backend and repository.generation("b") == 1
        await repository.unload_all()
    asyncio.run(scenario())


def test_a_folder_edited_then_copied_away_before_the_edit_settled_is_loaded_as_it_is(tmp_path, root):
    """The review of the copy fix above: an edit the watcher had seen but not yet acted on (same size, same ends:
    the copy is still paired with the folder) was taken for the files loaded, and the copy served the old bytes."""
    folder = toy_with_weights(root, "a")
    repository, watcher = setup(tmp_path, root)

    async def scenario() -> None:
        await start(repository, watcher)
        edit_the_middle(folder)
        await apply(watcher)  # seen, not yet settled
        shutil.copytree(folder, root / "b", copy_function=shutil.copy)
        shutil.rmtree(folder)
        # (Its weights are past two samples: the copy is no rename since the fix below, but a new folder.)
        await settled(watcher)
        while watcher._changes:
            await asyncio.gather(*watcher._changes)
        assert repository.entry("b").state is ModelState.READY
        assert repository.loaded_stamp("b") == scan_repository(root)["b"].stamp
        await repository.unload_all()
    asyncio.run(scenario())


def test_an_edit_undone_after_its_reload_failed_takes_the_failures_reason_away(tmp_path, root):
    """From the dynamic-mode hunt: a stray file whose reload failed, then removed, left READY with "reload failed,
    the running version keeps serving: ..." in RepositoryIndex for good (the log said it was loaded already)."""
    folder = write_toy(root, "a")
    repository, watcher = setup(tmp_path, root)

    async def scenario() -> None:
        await start(repository, watcher)
        (folder / "fail.txt").write_text("broken on purpose")
        await settled(watcher)
        assert repository.entry("a").reason.startswith("reload failed, the running version keeps serving: ")
        (folder / "fail.txt").unlink()
        await settled(watcher)
        entry = repository.entry("a")
        assert (entry.state, entry.reason, repository.generation("a")) == (ModelState.READY, "", 1)
        await repository.unload_all()
    asyncio.run(scenario())


def test_a_release_folder_above_ml_backends_path_swapped_with_mv_is_followed(tmp_path):
    """From the dynamic-mode hunt: `ml_backends_path: rel/current/repo`, then `mv rel/current rel/old && mv rel/new
    rel/current` (a blue/green release) sent no event to any watch, and the old tree served on for good."""
    root = tmp_path / "rel" / "current" / "repo"
    write_toy(root, "m")
    write_toy(tmp_path / "rel" / "new" / "repo", "m")
    (tmp_path / "rel" / "new" / "repo" / "m" / "toy.txt").write_text("release 2")
    repository, watcher = setup(tmp_path, root, settle_ms=50, poll_s=0.2)

    async def scenario() -> None:
        async with following(repository, watcher):
            assert repository.generation("m") == 1
            os.rename(tmp_path / "rel" / "current", tmp_path / "rel" / "old")
            os.rename(tmp_path / "rel" / "new", tmp_path / "rel" / "current")
            await until(lambda: repository.generation("m") == 2, what="the new release loaded")
            assert repository.loaded_stamp("m") == scan_repository(root)["m"].stamp
    asyncio.run(scenario())


def test_a_linked_model_whose_target_moves_with_a_folder_above_it_is_followed(tmp_path, root):
    """From the dynamic-mode hunt: `m -> .versions/m-v1` (the README's layout), then `mv .versions .versions-old`:
    `m` led nowhere, yet stayed READY serving the moved files until something else changed in the repository."""
    write_toy(root / ".versions", "m-v1")
    (root / "m").symlink_to(".versions/m-v1")
    repository, watcher = setup(tmp_path, root, settle_ms=50, poll_s=0.2)

    async def scenario() -> None:
        async with following(repository, watcher):
            assert repository.entry("m").state is ModelState.READY
            os.rename(root / ".versions", root / ".versions-old")
            await until(lambda: all(e.name != "m" or e.state is not ModelState.READY for e in repository.entries()),
                        what="m no longer served")
    asyncio.run(scenario())


def test_a_folder_edited_unseen_then_moved_is_loaded_as_it_is_under_its_new_name(tmp_path, root):
    """A fuzzing review: an edit the watcher never saw (same size, same ends: folders are paired by a sample of
    their files) made just before a move was taken as loaded, and the new name served the old bytes for good."""
    folder = toy_with_weights(root, "a")
    repository, watcher = setup(tmp_path, root)

    async def scenario() -> None:
        await start(repository, watcher)
        edit_the_middle(folder)
        os.rename(folder, root / "b")
        await apply(watcher)
        await apply(watcher)
        assert repository.entry("b").state is ModelState.READY
        assert repository.loaded_stamp("b") == scan_repository(root)["b"].stamp
        await repository.unload_all()
    asyncio.run(scenario())


def test_an_edit_of_nereid_yaml_adding_a_bad_backends_option_warns_once(tmp_path, root, caplog):
    """A bug hunt: the watcher checked the edited settings, then applied a copy of them (its server: section the
    running one's), which the repository checked again: the WARNING twice, the plugins' hooks asked twice."""
    import logging

    write_toy(root, "a")
    repository, watcher = setup(tmp_path, root, models="  - name: a\n")
    config = Path(repository.settings.source)

    async def scenario() -> None:
        await start(repository, watcher)
        caplog.set_level(logging.WARNING, logger="nereid")
        config.write_text(config.read_text() + "backends:\n  python: {warm_sart: true}\n")
        await settled(watcher)
        warned = [r.getMessage() for r in caplog.records if "warm_sart" in r.getMessage()]
        assert len(warned) == 1, warned
        await repository.unload_all()
    asyncio.run(scenario())


# The settle time of tests whose folder keeps changing, a write every 0.1 s and a scan after each: each pass must
# stay within it, which at 300 ms a starved machine's did not (the folder taken as settled; the flaky-test hunt).
SLOW_SETTLE_MS = 1000
# Passes of such a test's writes: past nereid.yaml's settle time (an edit of it is applied meanwhile).
PASSES = SLOW_SETTLE_MS // 100 + 4


def test_an_edit_listing_a_folder_still_changing_leaves_its_load_to_the_watcher(tmp_path, root):
    """Found by the dynamic-repository hunt: nereid.yaml edited to list a folder while it was still being copied
    loaded it at once, half-copied (its requests failing), then again once it had settled."""
    write_toy(root, "a")
    repository, watcher = setup(tmp_path, root, models="  - name: a\n", settle_ms=SLOW_SETTLE_MS)
    config = Path(repository.settings.source)

    async def scenario() -> None:
        await start(repository, watcher)
        folder = write_toy(root, "d")
        config.write_text(config.read_text().replace("  - name: a\n", "  - name: a\n  - name: d\n"))
        for part in range(PASSES):  # the copy goes on, a file every 0.1 s: past nereid.yaml's settle time
            await apply(watcher)
            await repository.refresh(join=True)  # (a RepositoryIndex meanwhile: the folder has an entry)
            assert repository.generation("d") == 0, "loaded while its folder was still changing"
            (folder / f"part{part}.txt").write_text("more")
            await asyncio.sleep(0.1)
        assert repository.settings.model("d") is not None  # (the edit applied meanwhile)
        await apply(watcher)  # (the last part seen)
        await asyncio.sleep(SLOW_SETTLE_MS / 1000 + 0.05)
        await apply(watcher)
        while watcher._changes:
            await asyncio.gather(*watcher._changes)
        assert repository.entry("d").state is ModelState.READY and repository.generation("d") == 1
        await repository.unload_all()
    asyncio.run(scenario())


def served_a_and_fresh(tmp_path: Path, root: Path) -> tuple[Path, ModelRepository, RepositoryWatcher, Path]:
    """Folders 'a' (listed) and 'fresh' (not), watched with SLOW_SETTLE_MS: (fresh's folder, the repository, its
    watcher, nereid.yaml)."""
    write_toy(root, "a")
    fresh = write_toy(root, "fresh")
    repository, watcher = setup(tmp_path, root, models="  - name: a\n", settle_ms=SLOW_SETTLE_MS)
    return fresh, repository, watcher, Path(repository.settings.source)


def test_an_edit_left_to_the_watcher_is_carried_out_when_the_folder_s_change_is_undone(tmp_path, root):
    """The hunt of the fix above: a folder whose change was undone before it settled (a scratch file written and
    removed) is never acted on, so the load an edit of nereid.yaml had left to the watcher never came."""
    fresh, repository, watcher, config = served_a_and_fresh(tmp_path, root)

    async def scenario() -> None:
        await start(repository, watcher)
        (fresh / "scratch.out").write_text("a file written and removed")
        config.write_text(config.read_text().replace("  - name: a\n", "  - name: a\n  - name: fresh\n"))
        await apply(watcher)  # both seen, neither settled
        await asyncio.sleep(SLOW_SETTLE_MS / 1000 + 0.05)
        (fresh / "scratch.out").unlink()
        await apply(watcher)  # nereid.yaml applied, its load left to the watcher; the folder as it was
        for _ in range(30):  # (the watcher's own scans run meanwhile: within a few settle times)
            while watcher._changes:
                await asyncio.gather(*watcher._changes)
            if repository.entry("fresh").state is ModelState.READY:
                break
            await asyncio.sleep(0.1)
            await apply(watcher)
        assert repository.entry("fresh").state is ModelState.READY, repository.entry("fresh").reason
        await repository.unload_all()
    asyncio.run(scenario())


async def changing(watcher: RepositoryWatcher, path: Path, times: int) -> None:
    """Write ``path`` every 0.1 s, ``times`` times, the watcher scanning after each (its folder keeps changing)."""
    for index in range(times):
        path.write_text(f"version {index}")
        await apply(watcher)
        await asyncio.sleep(0.1)


def test_a_step_left_to_the_watcher_never_loads_what_a_client_unloaded_nor_outlives_a_rename(tmp_path, root):
    """The hunt of the deferred steps: a reload an edit left to the watcher reloaded a model a client had unloaded
    meanwhile; and one left for a folder renamed since was taken for a new folder of the old name, never loaded."""
    folder = write_toy(root, "a")
    repository, watcher = setup(tmp_path, root, models="  - name: a\n", settle_ms=300)
    config = Path(repository.settings.source)

    async def scenario() -> None:
        await start(repository, watcher)
        config.write_text(config.read_text().replace("  - name: a\n", "  - name: a\n    queue_capacity: 7\n"))
        await changing(watcher, folder / "toy.txt", 8)  # nereid.yaml applied meanwhile, its reload left over
        assert repository.deferred_step("a") == "reload"
        await repository.unload("a")  # (RepositoryModelUnload)
        assert repository.deferred_step("a") is None
        await asyncio.sleep(0.4)
        await settled(watcher)
        assert repository.entry("a").state is not ModelState.READY, "loaded again after a client unloaded it"
        await repository.unload_all()
    asyncio.run(scenario())

    renamed = tmp_path / "renamed"
    renamed.mkdir()
    root = renamed / "ml-backends"
    folder = write_toy(root, "b")
    repository, watcher = setup(renamed, root, settle_ms=300)  # (no models: key: every folder is served)
    config = Path(repository.settings.source)

    async def rename() -> None:
        await start(repository, watcher)
        config.write_text(config.read_text() + "backends:\n  toy: {}\n")
        await changing(watcher, folder / "toy.txt", 8)
        folder.rename(root / "b2")
        await asyncio.sleep(0.4)
        await settled(watcher)
        assert repository.deferred_step("b") is None
        write_toy(root, "b")  # a new folder of the old name
        for _ in range(10):
            await settled(watcher)
            if repository.entry("b").state is ModelState.READY:
                break
            await asyncio.sleep(0.1)
        assert repository.entry("b").state is ModelState.READY, repository.entry("b").reason
        await repository.unload_all()
    asyncio.run(rename())


def test_a_deferred_load_overrides_an_earlier_decline_and_an_unload_its_readiness_mark(tmp_path, root):
    """The hunt of the deferred steps: a name a client had unloaded while the store could not be listed stayed
    "declined" though an edit then listed it; and an unload left the name in ServerReady's once-counted set, which a
    later exposure that does not reset it (a load the store cannot tell of) would have trusted."""
    fresh, repository, watcher, config = served_a_and_fresh(tmp_path, root)

    async def scenario() -> None:
        await start(repository, watcher)
        repository._declined.add("fresh")  # (as a client's unload while the store could not be listed leaves it)
        config.write_text(config.read_text().replace("  - name: a\n", "  - name: a\n  - name: fresh\n"))
        await changing(watcher, fresh / "toy.txt", PASSES)
        assert repository.deferred_step("fresh") == "load" and not repository.declined("fresh")
        assert "fresh" in repository._counted_once_ready
        await repository.unload("fresh")
        assert "fresh" not in repository._counted_once_ready and repository.deferred_step("fresh") is None
        await repository.unload_all()
    asyncio.run(scenario())


def test_an_edit_of_nereid_yaml_is_checked_off_the_event_loop(tmp_path, root, monkeypatch):
    """Found by the config hunt: the plugins' defaults hooks ran on the event loop at each edit of nereid.yaml, so a
    slow one (5 s) held every request, liveness included, for as long."""
    write_toy(root, "a")
    repository, watcher = setup(tmp_path, root, models="  - name: a\n")
    config = Path(repository.settings.source)
    checked = repository.check_settings

    threads: list[threading.Thread] = []

    def slow_check(settings) -> None:
        if repository._settings_checked is not settings:  # (the hooks run: once per settings)
            threads.append(threading.current_thread())
            time.sleep(1.5)  # (a plugin's hook taking its time: longer than a loaded machine's stalls)
        checked(settings)

    async def scenario() -> None:
        await start(repository, watcher)
        monkeypatch.setattr(repository, "check_settings", slow_check)
        config.write_text(config.read_text().replace("  - name: a\n", "  - name: a\n    queue_capacity: 5\n"))
        gaps, ticking = [], True

        async def tick() -> None:
            last = time.monotonic()
            while ticking:
                await asyncio.sleep(0.02)
                now = time.monotonic()
                gaps.append(now - last)
                last = now
        ticker = asyncio.ensure_future(tick())
        await settled(watcher)
        ticking = False
        await ticker
        assert repository.settings.model("a").queue_capacity == 5
        assert max(gaps) < 1.2, f"the event loop was held {max(gaps):.2f} s"
        # On a daemon thread: one held by a hook that never returns kept a stopped server from exiting (asyncio's
        # threads are joined at exit; the hunt of this fix).
        assert threads and all(thread.daemon for thread in threads), threads
        await repository.unload_all()
    asyncio.run(scenario())


def test_after_stop_a_scan_applies_no_nereid_yaml_edit(tmp_path, root):
    """A fuzzing review: a scan after stop() still applied nereid.yaml, and its unloads then met the shutdown's
    own (a backend unloaded twice)."""
    write_toy(root, "a")
    repository, watcher = setup(tmp_path, root, models="  - name: a\n")
    config = Path(repository.settings.source)

    async def scenario() -> None:
        await start(repository, watcher)
        config.write_text(config.read_text().replace("  - name: a\n", "  - name: a\n    queue_capacity: 5\n"))
        watcher.stop()
        await apply(watcher)
        assert repository.settings.model("a").queue_capacity != 5 and repository.generation("a") == 1
        await repository.unload_all()
    asyncio.run(scenario())


def test_an_unload_cancelled_once_begun_is_seen_to_its_end_and_unloads_the_model_once(tmp_path, root, monkeypatch):
    """A fuzzing review: the stop cancelled nereid.yaml's unload of a model while it drained; the entry kept the
    model, and the shutdown's own unload_all unloaded its backend a second time."""
    unloads: list[str] = []
    monkeypatch.setattr(SlowToy, "unload", lambda self: unloads.append(self.context.name), raising=False)
    write_other(root, "slow", "slow.txt", "0.4")
    repository, watcher = setup(tmp_path, root)

    async def scenario() -> None:
        await start(repository, watcher)
        before = SlowToy.started["slow"]
        request = submitted(repository, "slow")
        await running("slow", before)
        unload = asyncio.create_task(repository.unload("slow"))
        await until(lambda: repository.entry("slow").state is ModelState.UNLOADING, what="draining")
        unload.cancel()
        with pytest.raises(asyncio.CancelledError):
            await unload
        await request
        assert repository.entry("slow").loaded is None
        await repository.unload_all()
    asyncio.run(scenario())
    assert unloads == ["slow"]


# -- defect: a model draining its old version held up every other change ----------------------------------------

@pytest.mark.parametrize("change", ["reload", "remove"])
def test_a_draining_model_holds_up_no_other_change(tmp_path, root, change):
    # The old version's request runs until the test lets it end: a change that waited for it would never end
    # (the bounds of 0.3-0.4 s against a request of 0.8 s failed on a starved machine, the apply alone taking 0.6 s).
    a_closed_gate()
    slow = write_other(root, "slow", "slow.txt", "gate")
    write_toy(root, "renA")
    repository, watcher = setup(tmp_path, root)

    async def scenario() -> None:
        await start(repository, watcher)
        before = SlowToy.started["slow"]
        request = submitted(repository, "slow")
        await running("slow", before)
        if change == "remove":
            shutil.rmtree(slow)
        else:
            (slow / "slow.txt").write_text("0.0")
        await apply(watcher)
        await asyncio.wait_for(apply(watcher), 10)  # acts on it, without waiting for the old version's request
        assert not request.done()
        os.rename(root / "renA", root / "renB")
        await asyncio.wait_for(apply(watcher), 10)
        assert repository.entry("renB").state is ModelState.READY and not request.done()
        SlowToy.gate.set()
        (out,) = await asyncio.wait_for(request, 5)  # the request in flight gets its answer
        assert out.data.tolist() == [[1.0] * 4]
        if change == "reload":
            assert generation(repository, "slow") == 2
        await repository.unload_all()  # waits for what drains in the background
        if change == "remove":
            assert "slow" not in {entry.name for entry in repository.entries()}
    asyncio.run(scenario())


# -- defect: a fixed backends: default did not load the models it broke -----------------------------------------

def test_fixing_a_backend_default_loads_the_models_it_broke(tmp_path, root):
    write_other(root, "p", "picky.txt")
    repository, _ = setup(tmp_path, root, models="  - name: p\n", tail="backends:\n  picky: {warm_sart: true}\n")
    config = Path(repository.settings.source)

    async def scenario() -> None:
        await repository.load("p")
        assert repository.entry("p").state is ModelState.UNAVAILABLE
        assert "backends.picky.warm_sart: unknown option" in repository.entry("p").reason
        config.write_text(config.read_text().replace("warm_sart", "warm_start"))
        await repository.apply_settings(load_settings(config))
        assert repository.entry("p").state is ModelState.READY and repository.server_ready()
        await repository.unload_all()
    asyncio.run(scenario())


# -- defect: a RepositoryModelLoad of a folder just copied was followed by a reload of the same files -----------

def test_a_folder_loaded_by_hand_before_it_settled_is_not_loaded_again(tmp_path, root):
    repository, watcher = setup(tmp_path, root)
    # Only this test's scans: with a settle time of 0 the watcher's own scheduled scan could load the folder first
    # while the RepositoryModelLoad below waited on a thread (a loaded machine), and that explicit load of a
    # loaded model then reloaded it, as documented (a flake: 1 run in 8 under two busy loops).
    watcher._schedule_settled_scan = lambda: None

    async def scenario() -> None:
        await start(repository, watcher)
        write_toy(root, "copied")
        await apply(watcher)  # seen, not settled
        assert (await repository.load("copied")).generation == 1  # RepositoryModelLoad
        await apply(watcher)
        assert generation(repository, "copied") == 1
        edit(root / "copied", "edited")  # a change after that load is still one
        await settled(watcher)
        assert generation(repository, "copied") == 2
        await repository.unload_all()
    asyncio.run(scenario())


# -- defect: rsync-style transfers (hidden temporary files) were loaded half copied -----------------------------

def test_a_folder_whose_hidden_temporary_file_is_being_written_waits(tmp_path, root):
    repository, watcher = setup(tmp_path, root, settle_ms=100)

    async def scenario() -> None:
        await start(repository, watcher)
        folder = write_toy(root, "synced")
        temporary = folder / ".weights.safetensors.Xy12ab"  # rsync fills this, then renames it into place
        temporary.write_bytes(b"x" * 100)
        await apply(watcher)
        for _ in range(6):  # three settle times: the scans it schedules find the transfer going on
            await asyncio.sleep(0.05)
            with temporary.open("ab") as f:
                f.write(b"y" * 100)
        assert repository.entry("synced").loaded is None
        temporary.rename(folder / "weights.safetensors")
        await until(lambda: generation(repository, "synced") == 1, what="'synced' loaded once complete")
        # A hidden file alone is never a change (waited out past the settle time, which settled() is not:
        # the review of the tests found this check could not fail).
        (folder / ".notes").write_text("x")
        await apply(watcher)
        await asyncio.sleep(0.3)
        await apply(watcher)
        assert generation(repository, "synced") == 1
        edit(folder, "x")  # while a visible file's change is one
        await apply(watcher)
        await until(lambda: generation(repository, "synced") == 2, what="'synced' reloaded after its edit")
        await repository.unload_all()
    asyncio.run(scenario())


def test_a_load_waiting_on_a_removal_that_drains_loads_once_it_is_done(tmp_path, root):
    """With removals draining in the background, a folder can come back (and be loaded) before its model's
    unload finished: that load waited for it as a reload and then found nothing to reload."""
    folder = write_other(root, "m", "slow.txt", "0.4")
    repository, _ = setup(tmp_path, root)

    async def scenario() -> None:
        await repository.load("m")
        x = NamedTensor("input", DType.FP32, np.zeros((1, 4), np.float32))
        before = SlowToy.started["m"]
        request = asyncio.create_task(repository.ready_model("m").scheduler.submit([x], 1, 0))
        await running("m", before)
        shutil.rmtree(folder)
        removal = asyncio.create_task(repository.remove("m"))
        await asyncio.sleep(0.05)
        write_other(root, "m", "slow.txt", "0")  # back while the old model drains
        entry = await repository.load("m")
        assert (entry.state, entry.generation) == (ModelState.READY, 2)
        assert (await request)[0].data.tolist() == [[1.0] * 4]
        await removal
        assert repository.entry("m").state is ModelState.READY
        await repository.unload_all()
    asyncio.run(scenario())


def test_a_rename_that_loads_anew_holds_up_nothing_and_a_load_after_it_never_holds_up_shutdown(tmp_path, root):
    """Defects of the background drains: a rename onto a name with its own nereid.yaml settings still removed the
    old model in the foreground (the new name and every other change waited for its requests); a folder re-made
    under the old name then waited on that removal inside the loop of changes; and such a load, deferred until
    the removal was done, ran at shutdown and held it for as long as it took."""
    a_closed_gate()  # (the old model's request runs until the test lets it end: see the test above)
    write_other(root, "a", "slow.txt", "gate")
    repository, watcher = setup(tmp_path, root, models="  - name: a\n  - name: b\n    instances: 2\n")

    async def scenario() -> None:
        await start(repository, watcher)
        x = NamedTensor("input", DType.FP32, np.zeros((1, 4), np.float32))
        before = SlowToy.started["a"]
        request = asyncio.create_task(repository.ready_model("a").scheduler.submit([x], 1, 0))
        await running("a", before)
        os.rename(root / "a", root / "b")
        await asyncio.wait_for(apply(watcher), 10)  # (the rename did not wait for the old model's request)
        assert repository.entry("b").state is ModelState.READY and not request.done()
        write_other(root, "a", "slow.txt", "0")  # the old name back, while its old model still drains
        await asyncio.wait_for(settled(watcher), 10)  # (the loop of changes did not wait for the old model's removal)
        assert not request.done()
        watcher.stop()  # as the server's stop: the load deferred until the removal is done never starts
        SlowToy.gate.set()
        await repository.unload_all()
        assert (await request)[0].data.tolist() == [[1.0] * 4]
        assert repository.entry("a") is None or repository.entry("a").loaded is None
    asyncio.run(scenario())
