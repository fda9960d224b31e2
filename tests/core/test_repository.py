"""The model repository without any protocol: loads, failures, zero-downtime reloads, renames, removals."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

import numpy as np
import pytest

import toy_backends
from nereid.plugins import make_plugin_manager
from nereid.model_entry import ModelState
from nereid.repository import SUGGESTED_AMONG, ModelRepository, _no_folder
from nereid.settings import load_settings
from nereid.tensors import NamedTensor
from nereid.dtypes import DType
from moto_s3 import upload_folder
from toy_backends import LOADS, write_toy
from support import until


class Events:
    """A RepositoryEvents observer that keeps what it heard."""

    def __init__(self) -> None:
        self.heard: list[tuple[str, str]] = []

    def model_loaded(self, model: str, seconds: float) -> None:
        self.heard.append((model, "loaded"))

    def repository_event(self, model: str, event: str) -> None:
        self.heard.append((model, event))

    def model_renamed(self, old: str, new: str) -> None:
        self.heard.append((old, f"renamed to {new}"))

    def model_forgotten(self, model: str) -> None:
        self.heard.append((model, "forgotten"))


def repository(tmp_path: Path, models_yaml: str = "", events: Events | None = None,
               extra_plugins: tuple[object, ...] = (), server_extra: str = "") -> ModelRepository:
    config = tmp_path / "nereid.yaml"
    config.write_text('server:\n  ml_backends_path: "ml-backends"\n  metrics_addr: ""\n  http_addr: ""\n'
                      + server_extra + (f"models:\n{models_yaml}" if models_yaml else ""))
    manager = make_plugin_manager(load_entry_points=False, extra_plugins=(toy_backends, *extra_plugins))
    scratch = tmp_path / "scratch"
    scratch.mkdir(exist_ok=True)
    return ModelRepository(load_settings(config), manager, scratch, events=events)


async def run_one(repo: ModelRepository, name: str) -> list[int]:
    model = repo.ready_model(name)
    x = NamedTensor("input", DType.FP32, np.zeros((1, 4), np.float32))
    (out,) = await model.scheduler.submit([x], 1, 0)
    return out.data.tolist()[0]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "ml-backends").mkdir()
    return tmp_path / "ml-backends"


def test_load_failure_reload_and_its_failure(tmp_path, root):
    folder = write_toy(root, "m")
    events = Events()
    repo = repository(tmp_path, events=events)

    async def scenario():
        entry = await repo.load("m")
        assert entry.state is ModelState.READY and entry.generation == 1 and await run_one(repo, "m") == [1] * 4
        (folder / "fail.txt").write_text("weights are corrupt")
        entry = await repo.reload("m")
        assert entry.state is ModelState.READY and entry.generation == 1  # the running version keeps serving
        assert "reload failed, the running version keeps serving" in entry.reason and "weights are corrupt" in entry.reason
        assert await run_one(repo, "m") == [1] * 4
        (folder / "fail.txt").unlink()
        entry = await repo.reload("m")
        assert (entry.state, entry.generation, entry.reason) == (ModelState.READY, 2, "")
        await repo.unload_all()
    asyncio.run(scenario())
    assert ("m", "reload_failed") in events.heard and ("m", "reload") in events.heard


def test_a_first_load_failure_is_unavailable_with_the_reason(tmp_path, root):
    folder = write_toy(root, "bad")
    (folder / "fail.txt").write_text("cannot read")
    entry = asyncio.run(repository(tmp_path).load("bad"))  # one call: the repository lives on one loop
    assert entry.state is ModelState.UNAVAILABLE and entry.reason.endswith("fail.txt: cannot read")


def test_a_client_s_load_failing_again_for_the_same_reason_is_no_new_error(tmp_path, root, caplog):
    """Found by the log hunt: each RepositoryModelLoad of a broken folder wrote the same ERROR, with no limit (20
    calls, 20 lines in 40 ms). Failing as it did is DEBUG; failing otherwise is news again."""
    folder = write_toy(root, "bad")
    (folder / "fail.txt").write_text("cannot read")
    repo = repository(tmp_path)

    async def scenario() -> None:
        for _ in range(3):
            await repo.load("bad", requested=True)
        (folder / "fail.txt").write_text("cannot read either")
        await repo.load("bad", requested=True)
    with caplog.at_level(logging.DEBUG, logger="nereid.repository"):
        asyncio.run(scenario())
    levels = [(r.levelname, r.getMessage().rsplit(": ", 1)[1]) for r in caplog.records
              if "is UNAVAILABLE" in r.getMessage()]
    assert levels == [("ERROR", "cannot read"), ("DEBUG", "cannot read"), ("DEBUG", "cannot read"),
                      ("ERROR", "cannot read either")]


def test_a_client_s_reload_failing_again_for_the_same_reason_is_no_new_error(tmp_path, root, caplog):
    """Found by the review of the above: a client's load of a loaded model whose folder broke reloads it, and each
    such reload failing as the last one did wrote the same ERROR again."""
    folder = write_toy(root, "m")
    repo = repository(tmp_path)

    async def scenario() -> None:
        await repo.load("m")
        (folder / "fail.txt").write_text("weights are corrupt")
        for _ in range(3):
            await repo.load("m", requested=True)
        await repo.unload_all()
    with caplog.at_level(logging.DEBUG, logger="nereid.repository"):
        asyncio.run(scenario())
    assert [r.levelname for r in caplog.records if "reload failed" in r.getMessage()] == ["ERROR", "DEBUG", "DEBUG"]


def test_a_load_or_reload_the_store_failed_says_so_and_one_that_failed_for_its_own_reasons_does_not(tmp_path,
                                                                                                     root):
    """Defect (a review of the watcher's retry): a bundle whose weights stream failed (a StorageError under the
    backend's error) was taken for a model at fault, since the watcher only fetched its small files again."""
    folder = write_toy(root, "m")
    (folder / "store_fail.txt").write_text("s3://models/m/weights.safetensors: read failed after 4 attempt(s)")

    async def scenario():
        repo = repository(tmp_path)
        entry = await repo.load("m")
        assert entry.state is ModelState.UNAVAILABLE and entry.store_fault.endswith("cannot read the weights")
        (folder / "store_fail.txt").unlink()
        (folder / "fail.txt").write_text("a bad textproto")  # the model's own fault
        assert (await repo.load("m")).store_fault == ""
        (folder / "fail.txt").unlink()
        entry = await repo.load("m")
        assert entry.state is ModelState.READY and entry.store_fault == ""
        (folder / "store_fail.txt").write_text("HTTP 503")
        entry = await repo.reload("m")
        assert entry.generation == 1 and entry.store_fault.endswith("cannot read the weights")  # version 1 serves
        (folder / "store_fail.txt").unlink()
        assert (await repo.reload("m")).store_fault == ""
        await repo.unload_all()
    asyncio.run(scenario())


def test_a_listing_lets_go_of_a_wanted_name_that_has_no_folder(tmp_path, root):
    """A name asked for while the store could not be listed stays wanted (ServerReady waits for it) until a
    listing says no folder has it; a review of this session's diff found that step run only when the listing
    also added an entry while a model calling others was loaded."""
    write_toy(root, "a")
    repo = repository(tmp_path)
    repo._exposed.add("typo")  # (as ModelRepository.load leaves a name during a store outage under watch)
    repo.rescan()
    assert "typo" not in repo._exposed


def test_rename_moves_the_loaded_model_without_loading_again(tmp_path, root):
    write_toy(root, "before")
    repo = repository(tmp_path)

    async def scenario():
        await repo.load("before")
        loads = LOADS["before"]
        backend = repo.ready_model("before").backend
        (root / "before").rename(root / "after")
        await repo.rename("before", "after")
        assert not (tmp_path / "scratch" / "before").exists()  # nothing kept there: not left behind
        assert repo.ready_model("after").backend is backend and backend.context.name == "after"
        assert LOADS["before"] == loads and LOADS["after"] == 0
        assert "before" not in [e.name for e in repo.entries()]
        assert await run_one(repo, "after") == [1] * 4
        await repo.unload_all()
    asyncio.run(scenario())


def test_a_folder_renamed_away_from_a_name_nereid_yaml_lists_leaves_that_name_waiting_for_its_folder(tmp_path,
                                                                                                       root):
    """Found by a bug hunt: `mv a d` with both listed moved the model to 'd' and forgot 'a' altogether: NOT_FOUND
    "no folder 'a'", gone from /metrics' model states and from ServerReady's count, until a rescan made it anew.
    A listed model whose folder is removed waits for it, UNAVAILABLE; so must one whose folder is renamed."""
    write_toy(root, "a")
    repo = repository(tmp_path, "  - name: a\n  - name: d\n", server_extra="  watch: true\n")

    async def scenario():
        await repo.load("a")
        (root / "a").rename(root / "d")
        await repo.rename("a", "d")
        assert repo.ready_model("d") is not None
        waiting = repo.entry("a")
        assert (waiting.state, waiting.reason) == (ModelState.UNAVAILABLE, "waiting for its folder 'a' in "
                                                                          "ml_backends_path")
        assert waiting.loaded is None and waiting.settings.name == "a"
        await repo.unload_all()
    asyncio.run(scenario())


@pytest.mark.parametrize("marker, logged", [
    # Found by a bug hunt: a relocate() calling sys.exit() ended the server, with the plugin's exit status and
    # nothing logged.
    ("relocate_exit.txt", "its backend raised SystemExit: 8 while moving it"),
    # The plugin hunt: the WARNING gave a plugin's own exception as its bare message ('weights').
    ("relocate_raises.txt", "model 'before': cannot be renamed in place (relocate() of backend 'toy' raised KeyError: "
                            "'weights'); loading 'after' anew"),
], ids=["sys.exit", "an exception"])
def test_a_plugins_relocate_that_fails_is_its_failure_named_and_the_model_is_loaded_anew(tmp_path, root, caplog,
                                                                                         marker: str, logged: str):
    write_toy(root, "before")
    repo = repository(tmp_path)

    async def scenario():
        await repo.load("before")
        (root / "before" / marker).touch()
        (root / "before").rename(root / "after")
        await repo.rename("before", "after")  # moved it cannot be: loaded anew under its new name
        assert await run_one(repo, "after") == [1] * 4
        await repo.unload_all()
    asyncio.run(scenario())
    assert logged in caplog.text, caplog.text


class UnmovableToys:
    """Claims folders holding ``unmovable.txt``: toy models whose backend has no ``relocate`` (as meta's)."""

    BACKEND_NAME = "unmovable"

    class Model:
        platform = "toy_platform"

        def __init__(self, context) -> None:
            self._toy = toy_backends.ToyModel(context)

        def load(self) -> None:
            self._toy.load()

        def signature(self):
            return self._toy.signature()

        def infer(self, inputs):
            return self._toy.infer(inputs)

        def unload(self) -> None:
            pass

    @toy_backends.hookimpl
    def nereid_claim_model(self, folder: Path, declared: bool):
        return toy_backends.BackendClaim(self.Model) if (folder / "unmovable.txt").is_file() else None


def test_a_backend_that_never_moves_models_is_loaded_anew_at_a_rename_without_a_warning(tmp_path, root, caplog):
    """The races hunt: every rename of a meta model logged a WARNING that it cannot be renamed in place; loading
    anew is what such a backend always gets, so it is said at INFO (a relocate() that fails stays a WARNING)."""
    import logging

    folder = write_toy(root, "before")
    (folder / "toy.txt").rename(folder / "unmovable.txt")
    repo = repository(tmp_path, extra_plugins=(UnmovableToys(),))
    caplog.set_level(logging.INFO)

    async def scenario():
        await repo.load("before")
        (root / "before").rename(root / "after")
        assert not await repo.rename("before", "after")
        assert await run_one(repo, "after") == [1] * 4
        await repo.unload_all()
    asyncio.run(scenario())
    said = [r for r in caplog.records if "cannot be renamed in place" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in said] == [
        (logging.INFO, "model 'before': cannot be renamed in place (backend 'unmovable' cannot move a loaded "
                       "model); loading 'after' anew")]


def test_a_rename_onto_an_entry_whose_settings_differ_only_in_type_loads_it_anew(tmp_path, root):
    """The review hunt of 4c89b46: a rename compared settings with ==, so a folder moved onto an entry whose
    runtime said warm_start: 1 (the old one's: true) was moved in place, serving under settings the next start
    refuses."""
    write_toy(root, "before")
    repo = repository(tmp_path, "  - name: before\n    runtime: {flag: true}\n"
                                "  - name: after\n    runtime: {flag: 1}\n", server_extra="  watch: true\n")

    async def scenario():
        await repo.load("before")
        (root / "before").rename(root / "after")
        assert await repo.rename("before", "after") is False  # loaded anew, with its own settings
        assert repo.ready_model("after").settings.runtime == {"flag": 1}
        await repo.unload_all()
    asyncio.run(scenario())


def test_a_rename_onto_a_name_a_request_loaded_first_reloads_it_and_leaks_no_version(tmp_path, root):
    """Defect (found by the repository's state tests): `mv before after`, then a RepositoryModelLoad of 'after'
    before the watcher's rename: the rename replaced the loaded 'after' in place, and that version was never
    unloaded (its batcher task left pending at unload_all)."""
    write_toy(root, "before")
    repo = repository(tmp_path)
    unloaded: list[str] = []

    async def scenario():
        await repo.load("before")
        moved = repo.ready_model("before").backend
        (root / "before").rename(root / "after")
        await repo.load("after")  # the client's load, before the watcher looks
        first = repo.ready_model("after").backend
        moved.unload = lambda: unloaded.append("moved")
        first.unload = lambda: unloaded.append("first")
        await repo.rename("before", "after")  # the watcher's: 'after' is taken, so it is reloaded instead
        assert repo.ready_model("after").backend not in (moved, first)
        await repo.unload_all()
        assert not [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    asyncio.run(scenario())
    assert sorted(unloaded) == ["first", "moved"]


def test_a_rename_that_waited_for_an_unload_never_moves_the_unloaded_version(tmp_path, root):
    """Found by the repository read hunt: a rename looked at the serving version before it waited for the model's
    lock, held by an unload; it then moved the unloaded version, whose backend opened a folder descriptor that no
    unload would close, and said the model was renamed in place."""
    import threading

    write_toy(root, "before")
    repo = repository(tmp_path)
    unloading, release = threading.Event(), threading.Event()
    moved_after_unload: list[str] = []

    async def scenario():
        await repo.load("before")
        backend = repo.ready_model("before").backend

        def unload() -> None:  # (a thread of the server's: the unload holds the model's lock meanwhile)
            unloading.set()
            release.wait(10)
        backend.unload = unload
        backend.relocate = lambda context: moved_after_unload.append(context.name)
        unloaded = asyncio.create_task(repo.unload("before"))
        await until(unloading.is_set)
        (root / "before").rename(root / "after")
        renamed = asyncio.create_task(repo.rename("before", "after"))  # looks, then waits for the lock
        await asyncio.sleep(0.05)
        release.set()
        await unloaded
        assert await renamed is False  # nothing was serving to move: 'after' is loaded as a new folder
        assert moved_after_unload == []
        assert repo.ready_model("after").backend is not backend
        await repo.unload_all()
    asyncio.run(scenario())


def test_a_reload_failed_as_its_folder_was_renamed_leaves_no_reason_once_the_model_moved(tmp_path, root):
    """Found by the repository read hunt: a reload that failed as its folder was renamed ("the folder c is
    gone") kept that reason beside READY under the new name, after the rename moved the running version there."""
    folder = write_toy(root, "c")
    release = tmp_path / "release"
    release.touch()
    (folder / "gate.txt").write_text(str(release))
    repo = repository(tmp_path)

    async def scenario():
        await repo.load("c")
        release.unlink()
        reloading = asyncio.create_task(repo.reload("c"))
        await until(lambda: repo.entry("c").building is not None)
        folder.rename(root / "c2")
        release.touch()
        await reloading
        assert "is gone (deleted or moved while it was being loaded)" in repo.entry("c").reason
        assert await repo.rename("c", "c2") is True
        assert repo.entry("c2").state is ModelState.READY and repo.entry("c2").reason == ""
        await repo.unload_all()
    asyncio.run(scenario())


def test_remove_unloads_and_forgets_a_vanished_folder(tmp_path, root):
    folder = write_toy(root, "gone")
    repo = repository(tmp_path)

    async def scenario():
        await repo.load("gone")
        (tmp_path / "scratch" / "gone" / "built").write_text("what a backend kept")
        for path in folder.iterdir():
            path.unlink()
        folder.rmdir()
        await repo.remove("gone")
        assert [e.name for e in repo.entries()] == []
        # Defect: one scratch folder per name ever served stayed until the server stopped.
        assert not (tmp_path / "scratch" / "gone").exists()
    asyncio.run(scenario())


def test_a_removal_is_counted_even_after_a_rescan_forgot_the_folder(tmp_path, root):
    folder = write_toy(root, "broken")
    (folder / "fail.txt").write_text("no")
    events = Events()
    repo = repository(tmp_path, events=events)

    async def scenario():
        await repo.load("broken")
        for path in folder.iterdir():
            path.unlink()
        folder.rmdir()
        repo.rescan()  # say, a RepositoryIndex before the watcher's settle time: the entry goes
        assert repo.entries() == []
        await repo.remove("broken")  # the watcher, once the removal settled
    asyncio.run(scenario())
    assert ("broken", "remove") in events.heard


def test_settings_changes_reload_load_and_unload(tmp_path, root):
    for name in ("a", "b", "c"):
        write_toy(root, name)
    repo = repository(tmp_path, "  - name: a\n  - name: b\n")
    changed = tmp_path / "nereid.yaml"

    async def scenario():
        for name in ("a", "b"):
            await repo.load(name)
        changed.write_text(changed.read_text().replace("  - name: b\n", "  - name: c\n").replace(
            "  - name: a\n", "  - name: a\n    queue_capacity: 3\n"))
        await repo.apply_settings(load_settings(changed))
        states = {e.name: e.state for e in repo.entries()}
        assert states == {"a": ModelState.READY, "b": ModelState.UNAVAILABLE, "c": ModelState.READY}
        assert repo.ready_model("a").scheduler.capacity == 3 and repo.entry("a").generation == 2
        await repo.unload_all()
    asyncio.run(scenario())


def test_a_rescan_forgets_gone_folders_that_nothing_keeps(tmp_path, root):
    # Without a watcher: a deleted folder whose load failed, or whose model was unloaded, leaves the index
    # at the next rescan (RepositoryIndex); a loaded one keeps serving (and its entry) until unloaded.
    import shutil

    failed, served, listed = write_toy(root, "failed"), write_toy(root, "served"), write_toy(root, "listed")
    (failed / "fail.txt").write_text("broken")
    repo = repository(tmp_path, "  - name: listed\n")

    async def scenario():
        for name in ("failed", "served", "listed"):
            await repo.load(name)
        assert not repo.server_ready()  # 'failed' was asked for and is UNAVAILABLE
        for folder in (failed, served, listed):
            shutil.rmtree(folder)
        repo.rescan()
        assert [e.name for e in repo.entries()] == ["listed", "served"]
        assert repo.server_ready()  # the folder asked for is gone, and so is its entry
        assert await run_one(repo, "served") == [1] * 4
        await repo.unload("served")
        await repo.unload("listed")
        repo.rescan()
        # nereid.yaml still lists 'listed': it waits for its folder, as at start
        assert [(e.name, e.state) for e in repo.entries()] == [("listed", ModelState.UNAVAILABLE)]
    asyncio.run(scenario())


def test_a_rescan_never_forgets_an_entry_an_operation_waits_for(tmp_path, root):
    folder = write_toy(root, "m")
    repo = repository(tmp_path)

    async def scenario():
        entry = repo.entry("m")
        async with entry.held():  # say, a load in progress
            waiting = asyncio.create_task(repo.load("m"))  # queued behind it
            await asyncio.sleep(0)
            (folder / "toy.txt").unlink()
            (folder / "model_inference.textproto").unlink()
            folder.rmdir()
            repo.rescan()
            assert repo.entries() == [entry]
        # The lock is free, and the queued load has not run yet: it still counts.
        assert not entry.lock.locked()
        repo.rescan()
        assert repo.entries() == [entry]
        await waiting  # it found no folder, on the entry the index still has
        assert repo.entries() == [entry] and entry.state is ModelState.UNAVAILABLE
        repo.rescan()
        assert repo.entries() == []
    asyncio.run(scenario())


def test_refresh_lists_the_repository_off_the_event_loop(tmp_path, root, monkeypatch):
    # A store's listing can take a while: RepositoryIndex and loads of unknown names must not stall serving.
    import threading

    import nereid.repository as repository_module

    listed_on: list[threading.Thread] = []
    real_scan = repository_module.scan_model_folders

    def recording_scan(server):
        listed_on.append(threading.current_thread())
        return real_scan(server)

    monkeypatch.setattr(repository_module, "scan_model_folders", recording_scan)
    repo = repository(tmp_path)
    write_toy(root, "late")

    async def scenario():
        await repo.refresh()
        assert [e.name for e in repo.entries()] == ["late"]
        write_toy(root, "fresh")  # unknown to the repository until the load looks again
        await repo.load("fresh")
        assert repo.entry("fresh").state is ModelState.READY
        await repo.unload_all()
    asyncio.run(scenario())
    assert listed_on[0] is threading.main_thread()  # the constructor's own scan, before serving
    assert len(listed_on) == 3 and all(thread is not threading.main_thread() for thread in listed_on[1:])


def test_a_changed_entry_loads_a_model_that_is_not_loaded(tmp_path, root):
    # Fixing a failed model's nereid.yaml entry must load it: the edit used to be ignored for a model that was
    # not loaded, which stayed UNAVAILABLE with the stale reason (and ServerReady false).
    write_toy(root, "third")
    repo = repository(tmp_path, "  - name: third\n    backend: nosuch\n")
    config = tmp_path / "nereid.yaml"

    async def scenario():
        entry = await repo.load("third")
        assert entry.state is ModelState.UNAVAILABLE and "backend 'nosuch'" in entry.reason
        assert not repo.server_ready()
        config.write_text(config.read_text().replace("backend: nosuch", "queue_capacity: 7"))
        await repo.apply_settings(load_settings(config))
        assert (entry.state, entry.reason) == (ModelState.READY, "") and repo.server_ready()
        assert repo.ready_model("third").scheduler.capacity == 7
        await repo.unload_all()
    asyncio.run(scenario())


def test_a_listed_model_whose_folder_went_while_not_loaded_no_longer_holds_readiness(tmp_path, root):
    # README: ServerReady counts no model "since its folder went while it was not loaded", listed or not.
    import shutil

    write_toy(root, "good")
    bad = write_toy(root, "bad")
    (bad / "fail.txt").write_text("a bad textproto")
    repo = repository(tmp_path, "  - name: good\n  - name: bad\n")

    async def scenario():
        for name in repo.startup_models():
            await repo.load(name)
        assert not repo.server_ready()
        shutil.rmtree(bad)
        await repo.refresh()  # what RepositoryIndex does
        assert repo.server_ready()
        entry = repo.entry("bad")  # still listed: it waits for its folder, as at start
        assert (entry.state, entry.reason) == (ModelState.UNAVAILABLE,
                                               "waiting for its folder 'bad' in ml_backends_path")
        write_toy(root, "bad")  # back, fixed: a load asks for it again
        assert (await repo.load("bad")).state is ModelState.READY and repo.server_ready()
        await repo.unload_all()
    asyncio.run(scenario())


def test_a_model_the_watcher_found_counts_once_it_serves_even_when_the_models_it_calls_made_it_ready(tmp_path,
                                                                                                     root):
    """A caller the watcher loaded (``counted=False``) before the model it calls turned READY through the
    dependents' refresh, not its own load, and stayed uncounted: ServerReady ignored it when it failed later."""
    repo = repository(tmp_path, extra_plugins=(toy_backends.FaultyToys(),))
    write_toy(root, "callee")  # both dropped in after the start, as the watcher finds them
    caller = toy_backends.write_faulty(root, "caller", "caller")
    (caller / "calls.txt").write_text("callee")

    async def scenario():
        entry = await repo.load("caller", counted=False)  # as the watcher loads a folder it found
        assert entry.state is ModelState.UNAVAILABLE and repo.server_ready()  # never served: not counted yet
        await repo.load("callee", counted=False)
        assert entry.state is ModelState.READY and repo.server_ready()  # made READY by callee's load
        await repo.unload("callee")
        assert entry.state is ModelState.UNAVAILABLE
        assert not repo.server_ready()  # it served: counted, as the caller's own load would have made it
        await repo.unload_all()
    asyncio.run(scenario())


def _bucket_repository(tmp_path: Path, url: str, events: Events | None = None) -> ModelRepository:
    """A repository on the bucket ``url`` (an s3:// URL on the moto server), with the toy backends."""
    config = tmp_path / "nereid.yaml"
    config.write_text(f'server:\n  ml_backends_path: "{url}"\n  cache_dir: "{tmp_path / "cache"}"\n'
                      '  metrics_addr: ""\n  http_addr: ""\n')
    manager = make_plugin_manager(load_entry_points=False, extra_plugins=(toy_backends,))
    (tmp_path / "scratch").mkdir(exist_ok=True)
    return ModelRepository(load_settings(config), manager, tmp_path / "scratch", events=events)


def _lists(s3, bucket: str) -> int:
    """How many listings of ``bucket`` the moto server has answered so far."""
    with s3.lock:
        return sum(1 for method, path, _ in s3.requests if method == "GET" and path.rstrip("/") == f"/{bucket}")


def test_an_unknown_name_never_waits_for_the_store_listing(s3, tmp_path, monkeypatch):
    # A readiness, metadata or statistics call runs entry() on the event loop: with a slow store, listing
    # there stalled every other request for as long as the listing took.
    import time

    import nereid.storage
    from nereid.errors import NotFound

    write_toy(tmp_path / "source", "toy")
    upload_folder(s3.store, tmp_path / "source", s3.prefix)
    repo = _bucket_repository(tmp_path, s3.url())
    monkeypatch.setattr(nereid.storage, "_LISTING_TTL_S", 0.5)
    s3.get_latency_s = 3.0  # every GET, listings included (what the defect waited for, at least, per name)
    try:
        time.sleep(0.6)  # the listing made at start is stale: the next unknown name asks for another
        started = time.monotonic()
        for _ in range(5):
            with pytest.raises(NotFound, match="unknown model 'madeup'"):
                repo.entry("madeup")
        assert time.monotonic() - started < 1.5  # (0.6 s once, starved: the bound's room, far below 3 s)
        # Meanwhile a folder lands; the listing refreshed in the background finds it for a later call.
        write_toy(tmp_path / "late", "late")
        upload_folder(s3.store, tmp_path / "late", s3.prefix)
        deadline = time.monotonic() + 20
        while "late" not in {e.name for e in repo.entries()}:
            assert time.monotonic() < deadline, "the background listing never found 'late'"
            with contextlib.suppress(NotFound):
                repo.entry("late")
            time.sleep(0.1)
    finally:
        s3.get_latency_s = 0.0
    assert repo.entry("late").folder == repo.root / "late"


def test_a_failed_listing_is_kept_for_unknown_names_like_a_good_one(s3, tmp_path):
    # Unknown names against a missing bucket: one listing, not one per call.
    from nereid.errors import NotFound

    repo = _bucket_repository(tmp_path, f"s3://nereid-no-such-bucket/{s3.prefix}")
    before = _lists(s3, "nereid-no-such-bucket")
    assert before >= 1  # the listing at start, failed
    for _ in range(20):
        with pytest.raises(NotFound):
            repo.entry("madeup")
    assert _lists(s3, "nereid-no-such-bucket") == before


def test_a_model_object_lacking_part_of_the_protocol_is_unavailable_naming_its_backend(tmp_path, root):
    # Without platform it was READY, then every ModelMetadata failed INTERNAL; without infer it failed
    # after load() had acquired its resources, which nothing released.
    # (And a dependencies() calling sys.exit() or raising KeyboardInterrupt, on the event loop, ended the server.)
    names = {"nosig": "signature_none", "noplat": "no_platform", "noinfer": "no_infer", "nodeps": "dependencies_fail",
             "depsexit": "dependencies_exit", "depsint": "dependencies_interrupt", "platraises": "platform_raises"}
    for name, fault in names.items():
        toy_backends.write_faulty(root, name, fault)
    repo = repository(tmp_path, extra_plugins=(toy_backends.FaultyToys(),))
    # (Counted since the start of this process: other modules' tests run in it too, under the same names.)
    before = {name: toy_backends.UNLOADS[name] for name in names}

    async def scenario():
        entries = {name: await repo.load(name) for name in names}
        # No scheduler of a failed load is left running (its batcher was destroyed pending, logged as an ERROR).
        assert not [task for task in asyncio.all_tasks() if task.get_name().endswith("-batcher")]
        return entries
    entries = asyncio.run(scenario())
    assert {e.state for e in entries.values()} == {ModelState.UNAVAILABLE}
    assert entries["noplat"].reason == ("plugin 'faulty' made a model object (NoPlatformModel) without platform "
                                        "(a str): see the Model protocol in nereid.backend")
    assert "(NoInferModel) without infer()" in entries["noinfer"].reason
    # A platform property that raised gave its bare message ("no platform configured") as the reason.
    assert entries["platraises"].reason == (
        "plugin 'faulty' made a model object (PlatformRaisesModel) without platform (a str; reading it raised "
        "RuntimeError: no platform configured): see the Model protocol in nereid.backend")
    # It read "'NoneType' object has no attribute 'batches'", naming no plugin and no expectation.
    assert entries["nosig"].reason == ("plugin 'faulty': its model object (SignatureNoneModel) returned NoneType None "
                                       "from signature(), expected a nereid.signature.ModelSignature")
    # (It was the bare "dependencies unknown": the README walkthrough.)
    assert entries["nodeps"].reason == ("model 'nodeps': its backend's dependencies() raised RuntimeError: "
                                        "dependencies unknown")
    assert entries["depsexit"].reason == ("model 'depsexit': its backend raised SystemExit: 4 while asked what it "
                                          "calls (a backend refuses a model by raising an Exception with the reason)")
    assert entries["depsint"].reason.startswith("model 'depsint': its backend raised KeyboardInterrupt: no "
                                                "dependencies today while asked what it calls")
    # Each failed after its load() succeeded: what that acquired is released.
    assert [toy_backends.UNLOADS[name] - before[name] for name in names] == [1] * len(names)


def test_a_model_object_whose_methods_cannot_run_as_called_is_refused_with_the_real_reason(tmp_path, root, caplog):
    """Found by a plugin hunt: an unload() failing while it cleaned up after a refused load replaced the reason
    (the load's own, "returned NoneType None from signature()", was lost); an async def load() or unload() was
    accepted and never ran (READY with nothing loaded; an unload said done); an async input check checked nothing."""
    names = {"cleanup": "signature_none_unload_fails", "aload": "async_load", "aunload": "async_unload",
             "acheck": "input_check_async", "sigraise": "signature_raises", "ahooks": "async_hooks"}
    for name, fault in names.items():
        toy_backends.write_faulty(root, name, fault)
    repo = repository(tmp_path, extra_plugins=(toy_backends.FaultyToys(),))

    async def scenario():
        return {name: await repo.load(name) for name in names}
    entries = asyncio.run(scenario())
    assert {name: e.state for name, e in entries.items()} == dict.fromkeys(names, ModelState.UNAVAILABLE)
    assert entries["cleanup"].reason == ("plugin 'faulty': its model object (SignatureNoneUnloadFailsModel) "
                                         "returned NoneType None from signature(), expected a "
                                         "nereid.signature.ModelSignature")
    assert "model 'cleanup': unload failed (cleaning up after its load was refused)" in caplog.text
    assert entries["aload"].reason == ("plugin 'faulty' made a model object (AsyncLoadModel) whose load() is async "
                                       "def: they are called as plain functions (only infer() may be async def); "
                                       "make them plain def")
    # (The plugin hunt: async hooks were accepted, and failed every request, or a rename, later.)
    assert entries["ahooks"].reason.startswith("plugin 'faulty' made a model object (AsyncHooksModel) whose "
                                               "preprocess() and relocate() are async def")
    assert entries["aunload"].reason.startswith("plugin 'faulty' made a model object (AsyncUnloadModel) whose "
                                                "unload() is async def")
    # (A signature() raising was said as its bare message, "no sig", naming neither the plugin nor the method.)
    assert entries["sigraise"].reason == ("model 'sigraise': ValueError: no sig (raised by the signature() of plugin "
                                          "'faulty')")
    assert entries["acheck"].reason == ("model 'acheck': input_check() returned an async def function; the check is "
                                        "called as a plain function, before the request queues: make it plain def")


def test_model_objects_the_load_time_checks_must_not_refuse_load(tmp_path, root):
    """The hunt of this session's fixes: the check for async def methods read a wrapper's __getattr__ before its
    load() (recursion for ever: the model refused), and a uses_no_device() answering numpy's True was refused."""
    for name, fault in (("forwards", "forwarding"), ("numpy_true", "no_device_numpy")):
        toy_backends.write_faulty(root, name, fault)
    repo = repository(tmp_path, extra_plugins=(toy_backends.FaultyToys(),))

    async def scenario():
        entries = {name: await repo.load(name) for name in ("forwards", "numpy_true")}
        states = {name: (e.state, e.reason) for name, e in entries.items()}
        uses_device = entries["numpy_true"].loaded.uses_device if entries["numpy_true"].loaded else None
        await repo.unload_all()
        return states, uses_device
    states, uses_device = asyncio.run(scenario())
    assert states == dict.fromkeys(("forwards", "numpy_true"), (ModelState.READY, ""))
    assert uses_device is False


def test_at_a_stop_every_busy_model_is_asked_to_end_its_work_at_once(tmp_path, root):
    """Found by a bug hunt: asked one after another, one backend whose terminate_running hung held up the others
    (a SIGTERM with a 3 s grace took 65 s)."""
    import time

    for name in ("slow1", "slow2", "slow3"):
        toy_backends.write_faulty(root, name, "terminate_slow")
    repo = repository(tmp_path, extra_plugins=(toy_backends.FaultyToys(),))

    async def scenario() -> float:
        for name in ("slow1", "slow2", "slow3"):
            await repo.load(name)
        running = [asyncio.ensure_future(run_one(repo, name)) for name in ("slow1", "slow2", "slow3")]
        await until(lambda: all(repo.ready_model(name).scheduler.running_threads == 1
                                for name in ("slow1", "slow2", "slow3")))  # each inside its 2.5 s infer
        before = {name: toy_backends.TERMINATES[name] for name in ("slow1", "slow2", "slow3")}
        started = time.monotonic()
        await repo.terminate_running()  # 1 s each: 3 s one after another
        took = time.monotonic() - started
        # (The review of the tests: with no model asked at all, the time bound alone passed too.)
        assert {name: toy_backends.TERMINATES[name] - count for name, count in before.items()} == {
            "slow1": 1, "slow2": 1, "slow3": 1}
        await asyncio.gather(*running, return_exceptions=True)
        await repo.unload_all(grace_s=0)
        return took
    assert 1.0 <= asyncio.run(scenario()) < 2.5


def test_a_failing_terminate_running_neither_stops_an_unload_nor_a_shutdown(tmp_path, root, caplog):
    # It used to leave the model UNLOADING for ever, its unload() never called, and end a SIGTERM in a traceback.
    toy_backends.write_faulty(root, "busy", "terminate_fails")
    toy_backends.write_faulty(root, "busy2", "terminate_fails")
    toy_backends.write_faulty(root, "idle", "terminate_fails")  # never asked: it runs nothing (a clean stop)
    repo = repository(tmp_path, extra_plugins=(toy_backends.FaultyToys(),))

    async def scenario():
        await repo.load("busy")
        await repo.load("busy2")
        await repo.load("idle")
        running = [asyncio.ensure_future(run_one(repo, "busy"))]
        await asyncio.sleep(0.1)  # inside its 0.5 s infer
        entry = await repo.unload("busy", grace_s=0.05)  # the grace passes: terminate_running is called
        assert (entry.state, entry.reason) == (ModelState.UNAVAILABLE, "unloaded")
        running.append(asyncio.ensure_future(run_one(repo, "busy2")))
        await asyncio.sleep(0.1)
        await repo.terminate_running()  # the server's shutdown, past its grace
        await repo.unload_all(grace_s=0)
        assert repo.entry("busy2").state is ModelState.UNAVAILABLE
        await asyncio.gather(*running, return_exceptions=True)
    asyncio.run(scenario())
    assert toy_backends.UNLOADS["busy"] == toy_backends.UNLOADS["busy2"] == 1
    failures = [r.getMessage() for r in caplog.records if "terminate_running failed" in r.getMessage()]
    # Once each: the shutdown's unload (grace 0) does not ask busy2 a second time (its failure was logged twice).
    assert failures == ["model 'busy': terminate_running failed; unloading it anyway",
                        "model 'busy2': terminate_running failed; unloading it anyway"]


def test_a_load_raising_stop_iteration_is_unavailable_not_loading_for_ever(tmp_path, root, caplog):
    # No asyncio future can carry a StopIteration: the load's waiter never heard back, LOADING for ever.
    toy_backends.write_faulty(root, "stray_next", "stop_iteration")
    repo = repository(tmp_path, extra_plugins=(toy_backends.FaultyToys(),))

    async def scenario():
        return await asyncio.wait_for(repo.load("stray_next"), 20)
    entry = asyncio.run(scenario())
    assert entry.state is ModelState.UNAVAILABLE
    assert entry.reason == "model 'stray_next': StopIteration (raised by the load() of plugin 'faulty')"
    # Not nereid's error, so likely a bug: the log line carries where it was raised.
    (record,) = [r for r in caplog.records if "'stray_next' is UNAVAILABLE" in r.getMessage()]
    assert record.exc_info is not None and record.exc_info[0] is StopIteration


def test_a_folder_a_listing_of_every_folder_misses_is_loaded_by_name(s3, tmp_path):
    """A key directly under the URL makes the folders be found by listing every key, and obstore drops the
    1,000-key page holding a key it cannot read, with the folders listed before it in that page: a load by
    name answered NOT_FOUND for such a folder on a fresh cache."""
    import boto3

    from moto_s3 import ACCESS_KEY, BUCKET, REGION, SECRET_KEY

    for name in ("good", "mid"):
        write_toy(tmp_path / "source", name)
    upload_folder(s3.store, tmp_path / "source", s3.prefix)
    client = boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id=ACCESS_KEY,
                          aws_secret_access_key=SECRET_KEY, region_name=REGION)
    for key in ("mid/../e.txt", "/x/main.py"):
        client.put_object(Bucket=BUCKET, Key=f"{s3.prefix}/{key}", Body=b"unreadable")
    repo = _bucket_repository(tmp_path, s3.url())

    async def scenario():
        entry = await repo.load("good")
        state = entry.state
        await repo.unload_all()
        return state
    assert asyncio.run(scenario()) is ModelState.READY


def test_a_removed_folder_keeps_the_scratch_folder_a_model_renamed_away_from_it_still_uses(tmp_path, root):
    """Defect: a model renamed in place keeps what it made in its old name's scratch folder; a new folder under
    the old name shared it, and its removal deleted it, so the renamed model failed every request."""
    import shutil

    write_toy(root, "sa")
    repo = repository(tmp_path)
    scratch = tmp_path / "scratch"

    async def scenario():
        await repo.load("sa")
        (scratch / "sa" / "binary").write_text("what the first version made")
        (root / "sa").rename(root / "sb")
        await repo.rename("sa", "sb")
        write_toy(root, "sa")  # a new folder under the old name
        await repo.load("sa")
        shutil.rmtree(root / "sa")
        await repo.remove("sa")
        assert (scratch / "sa" / "binary").is_file()  # sb still runs from it
        shutil.rmtree(root / "sb")
        await repo.remove("sb")
        assert not (scratch / "sa").exists() and not (scratch / "sb").exists()  # then both go
    asyncio.run(scenario())


def test_an_unload_or_removal_abandons_a_load_that_never_returns(tmp_path, root, monkeypatch, caplog):
    """Defect: a backend's load() that never returned left the model LOADING for ever: an unload (and a load
    behind it) waited for it and was never answered, and only a restart recovered the model. An unload gives up
    on the load under way and on one queued before it; a load() that returns after all has what it built
    unloaded."""
    import logging
    import shutil
    import threading

    write_toy(root, "hang")
    events = Events()
    repo = repository(tmp_path, events=events)
    entered, release = threading.Event(), threading.Event()
    late_unloads: list[str] = []
    load, unload = toy_backends.ToyModel.load, toy_backends.ToyModel.unload

    def hanging_load(self) -> None:
        if self.context.name == "hang" and not release.is_set():
            entered.set()
            release.wait(30)
        load(self)

    def recorded_unload(self) -> None:
        late_unloads.append(self.context.name)
        unload(self)

    monkeypatch.setattr(toy_backends.ToyModel, "load", hanging_load)
    monkeypatch.setattr(toy_backends.ToyModel, "unload", recorded_unload)

    async def scenario():
        caplog.set_level(logging.INFO)
        loading = asyncio.ensure_future(repo.load("hang"))
        await until(entered.is_set)
        queued = asyncio.ensure_future(repo.load("hang"))  # waits behind the first
        await asyncio.sleep(0.05)
        entry = await asyncio.wait_for(repo.unload("hang"), 5)  # answered, though load() has not returned
        await asyncio.wait_for(asyncio.gather(loading, queued), 5)
        assert (entry.state, entry.reason, entry.loaded) == (ModelState.UNAVAILABLE, "unloaded", None)
        assert loading.result().abandoned.startswith("model 'hang': load abandoned")  # what its caller is told
        release.set()  # load() returns after all: what it built is unloaded, on its thread
        await until(lambda: late_unloads == ["hang"])
        assert (await repo.load("hang")).state is ModelState.READY  # and a new load works
        assert repo.entry("hang").abandoned == ""
        # A reload given up for an unload: no version "keeps serving" (the unload takes it next), and it is no
        # failed reload. Defect: it said "reload failed, the running version keeps serving", and counted reload_failed.
        release.clear()
        entered.clear()
        reloading = asyncio.ensure_future(repo.load("hang"))
        await until(entered.is_set)
        await asyncio.wait_for(repo.unload("hang"), 5)
        reloaded = await asyncio.wait_for(reloading, 5)
        assert reloaded.abandoned.startswith("model 'hang': load abandoned after ")
        assert "keeps serving" not in reloaded.abandoned and ("hang", "reload_failed") not in events.heard
        release.set()
        await until(lambda: late_unloads == ["hang", "hang", "hang"])  # the old version, then the late one
        await repo.load("hang")
        # A removal gives up on a load in the same way.
        release.clear()
        entered.clear()
        await repo.unload("hang")
        loading = asyncio.ensure_future(repo.load("hang"))
        await until(entered.is_set)
        shutil.rmtree(root / "hang")
        await asyncio.wait_for(repo.remove("hang"), 5)
        await asyncio.wait_for(loading, 5)
        release.set()  # (its folder gone, that load() fails: nothing more to unload)
        await until(lambda: not [t for t in threading.enumerate() if t.name == "nereid-load-hang"])
        assert late_unloads == ["hang", "hang", "hang", "hang"]
    try:
        asyncio.run(scenario())
    finally:
        release.set()
    assert "model 'hang' is UNAVAILABLE: model 'hang': load abandoned after " in caplog.text
    assert ("an unload or removal of it came while its backend's load() was still running (if that ever returns, "
            "what it built is unloaded)") in caplog.text
    assert ("model 'hang': load abandoned: an unload or removal of it is waiting for its turn, and wins over a "
            "load") in caplog.text
    assert "model 'hang': load finished after it was abandoned; unloading it" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_an_unload_that_never_returns_is_abandoned_after_its_bound(tmp_path, root, monkeypatch, caplog):
    """Defect: a native library's nereid_unload that never returned kept the server from exiting, and a few
    of them took every thread of asyncio's default pool: RepositoryIndex and other unloads hung."""
    import threading
    import time

    import nereid.backend_calls

    monkeypatch.setattr(nereid.backend_calls, "BACKEND_CALL_WAIT_S", 0.3)
    for name in ("stuck", "fine"):
        write_toy(root, name)
    repo = repository(tmp_path)
    release = threading.Event()

    async def scenario():
        await repo.load("stuck")
        await repo.load("fine")
        toy = type(repo.ready_model("stuck").backend)
        unload = toy.unload
        monkeypatch.setattr(toy, "unload", lambda self: release.wait(30) if self.context.name == "stuck" else unload(self))
        started = time.monotonic()
        for _ in range(8):  # more than asyncio's default pool has threads on this machine
            await repo.load("stuck")  # a reload: the old version's unload never returns
        took = time.monotonic() - started
        await asyncio.wait_for(repo.refresh(), 5)  # scans use the default pool: still free
        await asyncio.wait_for(repo.unload("fine"), 5)
        # (The old versions retire in the background: their unloads are abandoned while unload_all waits.)
        await asyncio.wait_for(repo.unload_all(), 5)
        release.set()
        return took
    try:
        took = asyncio.run(scenario())
    finally:
        release.set()
    assert took < 8 * 0.3 + 5
    assert caplog.text.count("model 'stuck': unload did not return within 0.3 s; abandoning it") >= 7


def test_a_removed_models_scratch_folder_is_deleted_off_the_loop_and_never_under_a_new_one(tmp_path, root,
                                                                                          monkeypatch):
    """Defect: a removed model's scratch folder was deleted on the event loop (a big one stalled every RPC);
    deleted on a thread, it must not take the files of a new folder given the same name meanwhile."""
    import shutil
    import threading

    from nereid import folder_cleanup

    real_remove_tree = folder_cleanup.remove_tree
    started, release = threading.Event(), threading.Event()
    deleted_on: list[threading.Thread] = []

    def slow_remove_tree(path):  # a big folder: it takes until released
        deleted_on.append(threading.current_thread())
        started.set()
        if threading.current_thread() is not threading.main_thread():  # (never blocks the loop: fails instead)
            release.wait(10)
        return real_remove_tree(path)

    folder = write_toy(root, "big")
    repo = repository(tmp_path)
    scratch = tmp_path / "scratch"

    async def scenario():
        await repo.load("big")
        (scratch / "big" / "old.bin").write_text("what the first version made")
        shutil.rmtree(folder)
        monkeypatch.setattr(folder_cleanup, "remove_tree", slow_remove_tree)
        removal = asyncio.ensure_future(repo.remove("big"))
        for _ in range(500):  # the loop runs on while the folder is deleted
            if started.is_set():
                break
            await asyncio.sleep(0.01)
        write_toy(root, "big")  # a new folder under the same name, loaded meanwhile
        entry = await repo.load("big")
        (scratch / "big" / "new.bin").write_text("what the new version made")
        release.set()
        await removal
        assert entry.state is ModelState.READY and repo.entry("big") is entry
        await repo.unload_all()
    try:
        asyncio.run(scenario())
    finally:
        release.set()
    assert deleted_on and threading.main_thread() not in deleted_on
    assert [path.name for path in scratch.iterdir()] == ["big"]  # nothing left but the new version's folder
    assert [path.name for path in (scratch / "big").iterdir()] == ["new.bin"]


def test_a_load_queued_behind_the_removal_of_its_folder_is_not_found(tmp_path, root):
    """Defect: a load waiting on the model (as a reload) while its deleted folder's removal took it answered
    with the forgotten entry ("unloaded": INTERNAL over the wire) instead of what a name with no folder gets."""
    import shutil

    from nereid.errors import NotFound

    folder = write_toy(root, "m")
    repo = repository(tmp_path)

    async def scenario():
        entry = await repo.load("m")
        async with entry.held():  # say, a reload of it in progress
            shutil.rmtree(folder)
            removal = asyncio.ensure_future(repo.remove("m"))
            await asyncio.sleep(0)  # the removal waits for the model first
            load = asyncio.ensure_future(repo.load("m"))
            await asyncio.sleep(0)
        with pytest.raises(NotFound, match=r"^unknown model 'm' \(no folder 'm' under ml_backends_path\)$"):
            await load
        await removal
        assert repo.entries() == [] and repo.server_ready()  # nothing left waiting for 'm'
    asyncio.run(scenario())


def test_a_rescan_that_forgets_a_folder_drops_its_scratch_folder(tmp_path, root):
    """Defect: an entry a rescan forgot (RepositoryIndex before the watcher's removal, or without a watcher)
    kept its scratch folder until the server stopped: the removal then found no entry and dropped nothing,
    one folder per name ever seen (a failed cpp build's cache in each)."""
    import shutil

    for name in ("failed", "unloaded", "later"):
        write_toy(root, name)
    (root / "failed" / "fail.txt").write_text("does not compile")
    events = Events()
    repo = repository(tmp_path, events=events)
    scratch = tmp_path / "scratch"

    async def scenario():
        for name in ("failed", "unloaded", "later"):
            await repo.load(name)
            (scratch / name / "build-cache").mkdir()  # what a (failed) build leaves there
        await repo.unload("unloaded")
        await repo.unload("later")
        shutil.rmtree(root / "failed")
        shutil.rmtree(root / "unloaded")
        repo.rescan()  # a RepositoryIndex: both entries go
        assert [e.name for e in repo.entries()] == ["later"]
        await repo.remove("failed")  # the watcher, once the removal settled: no entry left to it
        await repo.unload_all()  # (waits for the work in the background)
        assert sorted(path.name for path in scratch.iterdir()) == ["later"]
    asyncio.run(scenario())
    shutil.rmtree(root / "later")
    repo.rescan()  # outside any event loop (say, a script's): dropped all the same
    assert list(scratch.iterdir()) == []
    assert events.heard.index(("failed", "forgotten")) < events.heard.index(("failed", "remove"))
    assert ("unloaded", "forgotten") in events.heard and ("later", "forgotten") in events.heard


def test_events_hear_each_name_forgotten_for_good_and_not_an_unload(tmp_path, root):
    """The metrics drop a name's series when the repository forgets it: a removal, a rename's old name."""
    import shutil

    for name in ("kept", "before", "gone"):
        write_toy(root, name)
    events = Events()
    repo = repository(tmp_path, events=events)

    async def scenario():
        for name in ("kept", "before", "gone"):
            await repo.load(name)
        await repo.unload("kept")  # still in the index, UNAVAILABLE: not forgotten
        (root / "before").rename(root / "after")
        await repo.rename("before", "after")
        shutil.rmtree(root / "gone")
        await repo.remove("gone")
        await repo.unload_all()
    asyncio.run(scenario())
    forgotten = [model for model, event in events.heard if event == "forgotten"]
    assert forgotten == ["before", "gone"]
    # The removal is heard after the name is forgotten (it then names a model the repository does not know).
    assert events.heard[-2:] == [("gone", "forgotten"), ("gone", "remove")]


def test_the_removal_of_a_store_folder_forgets_it_and_drops_its_cached_copy(s3, tmp_path):
    """Defect: in a bucket, the removal (the watcher's, once a prefix is deleted) tested the folder's cached copy,
    which is always there: the name stayed known (its metrics series, its scratch folder) until a
    RepositoryIndex, and its copy in cache_dir for ever."""
    import time

    import obstore

    for name in ("gone", "back"):
        write_toy(tmp_path / "source", name)
    upload_folder(s3.store, tmp_path / "source", s3.prefix)
    events = Events()
    repo = _bucket_repository(tmp_path, s3.url(), events)
    mirror = repo.root

    async def scenario():
        for name in ("gone", "back"):
            assert (await repo.load(name)).state is ModelState.READY
        for key in (f"{s3.prefix}/gone/toy.txt", f"{s3.prefix}/gone/model_inference.textproto"):
            obstore.delete(s3.store, key)
        await repo.remove("gone")
        await repo.remove("back")  # (its prefix is still there: a removal of a folder uploaded again meanwhile)
        await repo.unload_all()
    asyncio.run(scenario())
    assert [e.name for e in repo.entries()] == ["back"]
    assert events.heard.index(("gone", "forgotten")) < events.heard.index(("gone", "remove"))
    assert not (tmp_path / "scratch" / "gone").exists()
    deadline = time.monotonic() + 10
    while sorted(p.name for p in mirror.iterdir()) != [".back.lock", "back"]:  # (deleted on a thread)
        assert time.monotonic() < deadline, f"the cached copy of 'gone' was never removed: {list(mirror.iterdir())}"
        time.sleep(0.05)


def test_a_load_retried_after_a_store_failure_logs_the_same_failure_again_at_debug(tmp_path, root, caplog):
    """A store down for hours fails every retry of the watcher the same way: the first failure is an ERROR, a
    retry failing for that reason again is DEBUG (dropped where DEBUG is off), any other failure an ERROR."""
    import logging

    from nereid.storage import failure_kind

    folder = write_toy(root, "m")
    caller = toy_backends.write_faulty(root, "caller", "caller")  # a model calling m, as a meta model does
    (caller / "calls.txt").write_text("m")
    repo = repository(tmp_path, extra_plugins=(toy_backends.FaultyToys(),))

    def lines() -> list[tuple[str, str]]:
        said = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "nereid.repository"]
        caplog.clear()
        return said

    async def scenario() -> None:
        caplog.set_level(logging.DEBUG, logger="nereid.repository")
        (folder / "store_fail.txt").write_text("HTTP 500 in 12.5ms, after 3 retries")
        entry = await repo.load("m")
        assert [level for level, _ in lines()] == ["ERROR"] and entry.store_fault
        await repo.load("caller")
        assert [(level, message.split(":")[0]) for level, message in lines()] == \
            [("WARNING", "model 'caller' is UNAVAILABLE")]
        retrying = failure_kind(entry.store_fault)
        await repo.load("m", retrying=retrying)
        # m's line, and its caller's (which waited on m LOADING meanwhile): no news, both DEBUG.
        assert [level for level, _ in lines()] == ["DEBUG", "DEBUG"]
        caplog.set_level(logging.INFO, logger="nereid.repository")
        await repo.load("m", retrying=retrying)
        assert lines() == []  # DEBUG is off: not written at all
        (folder / "store_fail.txt").unlink()
        (folder / "fail.txt").write_text("the model's own fault")
        await repo.load("m", retrying=retrying)
        assert [level for level, _ in lines()] == ["ERROR", "WARNING"]  # another reason: m's, and its caller's
        (folder / "fail.txt").unlink()
        assert (await repo.load("m")).state is ModelState.READY
        (folder / "store_fail.txt").write_text("HTTP 500")
        lines()
        entry = await repo.reload("m", retrying=retrying)  # the running version keeps serving: said at DEBUG
        assert entry.state is ModelState.READY and entry.store_fault
        assert [level for level, message in lines() if "reload failed" in message] == []
        await repo.reload("m")
        assert [level for level, message in lines() if "reload failed" in message] == ["ERROR"]
        await repo.unload_all()
    asyncio.run(scenario())


def test_a_failed_reload_names_the_running_version_not_the_number_the_next_load_takes(tmp_path, root, caplog):
    """Found by a plugin hunt: a failed reload was logged "(load 2)", and the next reload that succeeded was
    READY "(load 2)" too."""
    import logging

    folder = write_toy(root, "m")
    repo = repository(tmp_path, extra_plugins=(toy_backends.FaultyToys(),))

    async def scenario() -> None:
        caplog.set_level(logging.INFO, logger="nereid.repository")
        await repo.load("m")
        (folder / "fail.txt").write_text("the model's own fault")
        await repo.reload("m")
        (folder / "fail.txt").unlink()
        await repo.reload("m")
        said = [r.getMessage() for r in caplog.records
                if r.name == "nereid.repository" and "model 'm'" in r.getMessage()]
        loads = [message.split("(load ")[1].split(")")[0].split(",")[0] for message in said if "(load " in message]
        assert loads == ["1", "1", "2"], said
        assert "reload failed, the running version (load 1) keeps serving" in said[1], said
        assert repo.generation("m") == 2
        await repo.unload_all()
    asyncio.run(scenario())


def test_a_folder_moved_while_it_first_loads_is_said_to_be_gone_not_to_lack_a_file(tmp_path, root, caplog,
                                                                                      monkeypatch):
    """Found by the soak hunt: a new folder renamed during its first load (`mv x y` as the watcher loads x) logged
    `ERROR ... missing manifest.yaml` of a bundle only moved; the reason is that its folder went."""
    import logging
    import shutil

    folder = write_toy(root, "moving")
    load = toy_backends.ToyModel.load

    def moved_away(self) -> None:
        shutil.move(str(self.context.folder), str(root / "moved"))  # (as `mv` does, while load() reads)
        load(self)  # (its textproto gone: FileNotFoundError, the backend's own word)

    monkeypatch.setattr(toy_backends.ToyModel, "load", moved_away)
    repo = repository(tmp_path)
    caplog.set_level(logging.WARNING, logger="nereid.repository")

    async def scenario():
        return await repo.load("moving")
    entry = asyncio.run(scenario())
    assert entry.state is ModelState.UNAVAILABLE
    assert entry.reason.endswith("moving is gone (deleted or moved while it was being loaded)"), entry.reason
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert not folder.exists()
    # A reload the same (the dynamic-repository hunt: logged at ERROR as the file the backend then missed).
    shutil.move(str(root / "moved"), str(folder))

    async def reloaded():
        monkeypatch.setattr(toy_backends.ToyModel, "load", load)
        assert (await repo.load("moving")).state is ModelState.READY
        monkeypatch.setattr(toy_backends.ToyModel, "load", moved_away)
        caplog.clear()
        entry = await repo.reload("moving")
        state, reason = entry.state, entry.reason
        await repo.unload_all()
        return state, reason
    state, reason = asyncio.run(reloaded())
    assert state is ModelState.READY  # (the running version serves on)
    assert reason.endswith("moving is gone (deleted or moved while it was being loaded)"), reason
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_the_notes_on_new_settings_are_logged_once_however_often_they_are_checked(tmp_path, root, caplog):
    """The README walkthrough: an edit of nereid.yaml adding a bad backends: option logged the same WARNING twice
    (the watcher checks new settings, then starts them, which checks them again)."""
    import logging

    from nereid.settings import load_settings

    repo = repository(tmp_path)
    (tmp_path / "nereid.yaml").write_text((tmp_path / "nereid.yaml").read_text()
                                          + "backends:\n  python: {warm_sart: true}\n")
    edited = load_settings(tmp_path / "nereid.yaml")
    caplog.set_level(logging.WARNING, logger="nereid.repository")
    repo.check_settings(edited)
    asyncio.run(repo.apply_settings(edited))
    assert [r.getMessage() for r in caplog.records if "warm_sart" in r.getMessage()] == [
        f"{tmp_path / 'nereid.yaml'}: backends.python.warm_sart: unknown option of the python backend (allowed: "
        "preload, warm_start; did you mean 'warm_start'?), got true"]


@pytest.mark.parametrize("edited", [True, False], ids=["files edited meanwhile", "nothing changed"])
@pytest.mark.parametrize("where", ["local", "bucket"])
def test_a_load_asked_for_while_another_runs_loads_the_files_as_they_are_when_asked(tmp_path, root, monkeypatch,
                                                                                   request, edited, where):
    """Defect (the races hunt): without server.watch, a client's load that waited behind another one answered OK
    and left the model serving the files the first had read, though they were edited before it asked (a deploy
    script retrying a load that timed out, after fixing a file, was told the fix was loaded). A bucket's files
    are not stamped: such a load loads them again (the hunt of the fixes)."""
    import threading

    source = root if where == "local" else tmp_path / "source"
    write_toy(source, "m")
    if where == "bucket":
        s3 = request.getfixturevalue("s3")
        upload_folder(s3.store, source, s3.prefix)
        repo = _bucket_repository(tmp_path, s3.url())
    else:
        repo = repository(tmp_path)
    assert not repo.settings.server.watch
    read, release = threading.Event(), threading.Event()
    load = toy_backends.ToyModel.load

    def held_load(self) -> None:
        load(self)  # (the files read)
        if not release.is_set():
            read.set()
            release.wait(30)
    monkeypatch.setattr(toy_backends.ToyModel, "load", held_load)
    before = toy_backends.LOADS["m"]

    async def scenario():
        first = asyncio.create_task(repo.load("m", requested=True))
        await until(read.is_set)
        if edited:
            (source / "m" / "model_inference.textproto").write_text("input_shape: [5]\noutput_shape: [5]\n"
                                                                    "max_batch_size: 8\n")
            if where == "bucket":
                upload_folder(s3.store, source, s3.prefix)
        second = asyncio.create_task(repo.load("m", requested=True))
        await asyncio.sleep(0.1)  # (waiting behind the first)
        release.set()
        await asyncio.gather(first, second)
        shape = repo.ready_model("m").signature.inputs[0].dims
        await repo.unload_all()
        return shape
    shape = asyncio.run(scenario())
    loads = toy_backends.LOADS["m"] - before
    if where == "bucket" and not edited:
        assert (shape, loads) == ((4,), 2)  # (loaded again: nothing tells it unchanged)
    else:
        assert (shape, loads) == (((5,), 2) if edited else ((4,), 1))


def test_a_folder_renamed_and_loaded_anew_counts_for_server_ready_once_it_serves(tmp_path, root):
    """Defect (the races hunt): a rename that loads the new folder anew (a folder never loaded, a backend that
    cannot move, other settings) loaded it as counted at once: an unlisted broken folder renamed with `mv` took
    the server out of readiness for good, where the same folder copied in under the new name did not."""
    folder = write_toy(root, "broken")
    (folder / "fail.txt").write_text("a broken model")
    write_toy(root, "good")
    repo = repository(tmp_path, models_yaml="  - name: good\n")

    async def scenario():
        await repo.load("good")
        assert repo.server_ready()
        folder.rename(root / "broken2")
        assert not await repo.rename("broken", "broken2")  # never loaded: loaded anew
        assert repo.entry("broken2").state is ModelState.UNAVAILABLE and repo.server_ready()
        (root / "broken2" / "fail.txt").unlink()
        await repo.load("broken2", counted=False)  # (the watcher's, once the folder is mended)
        (root / "broken2" / "fail.txt").write_text("broken again")
        await repo.reload("broken2")
        assert repo.server_ready()  # a failed reload keeps the running version READY
        await repo.unload_all()
    asyncio.run(scenario())


def test_an_unknown_name_is_told_the_closest_known_one_among_few() -> None:
    """A "did you mean" costs a comparison with each name, for every NOT_FOUND on the event loop: among more
    names than SUGGESTED_AMONG none is made (a flood of made-up names stays cheap to refuse)."""
    few = ["python_rowsum", "echo"]
    assert str(_no_folder("python_rowsun", few)) == ("unknown model 'python_rowsun' (no folder 'python_rowsun' under "
                                                     "ml_backends_path; did you mean 'python_rowsum'?)")
    many = few + [f"other{i}" for i in range(SUGGESTED_AMONG)]
    assert str(_no_folder("python_rowsun", many)) == \
        "unknown model 'python_rowsun' (no folder 'python_rowsun' under ml_backends_path)"


def test_a_model_listed_while_its_new_folder_settles_is_said_to_wait_for_it_to_settle(tmp_path, caplog):
    """Found by a bug hunt: a folder copied in and listed in nereid.yaml within its settle time was said to load
    "once its folder 'x' is in ml_backends_path", though it was there already, being settled by the watcher."""
    import logging

    (tmp_path / "ml-backends").mkdir()
    repo = repository(tmp_path, server_extra="  watch: true\n")
    write_toy(tmp_path / "ml-backends", "copied")  # (copied in after the repository was listed: no entry yet)
    edited = tmp_path / "nereid.yaml"  # (the file the repository was started from, edited)
    edited.write_text('server:\n  ml_backends_path: "ml-backends"\n  metrics_addr: ""\n  http_addr: ""\n'
                      "  watch: true\nmodels:\n  - name: copied\n  - name: absent\n")
    with caplog.at_level(logging.INFO, logger="nereid.repository"):
        asyncio.run(repo.start_settings(load_settings(edited), settling={"copied"}))
    said = [m for m in caplog.messages if "is now listed in nereid.yaml" in m]
    assert said == ["model 'copied' is now listed in nereid.yaml; it loads once its folder, which is changing, "
                    "has settled",
                    "model 'absent' is now listed in nereid.yaml; it loads once its folder 'absent' is in "
                    "ml_backends_path"]


PYTHON_ECHO = '''
import os, sys
data = sys.stdin.buffer.read()
with open(os.environ["NEREID_OUTPUT_PATH"], "wb") as out:
    out.write(("%s %s\\n" % (os.environ["NEREID_INPUT_DTYPE"], os.environ["NEREID_INPUT_SHAPE"])).encode())
    out.write(data)
'''


def test_an_edit_of_backends_reloads_only_the_models_whose_options_it_changes(tmp_path, root, caplog):
    """The scale hunt: `backends: {python: {...}}` edited to give no model other options (a default written out,
    preload: [] added) reloaded every python model, 300 reloads for an edit that changed nothing. Real python
    models: the backend's own reading of its options decides."""
    import logging

    for name in ("plain", "own"):
        (root / name).mkdir()
        (root / name / "main.py").write_text(PYTHON_ECHO)
        (root / name / "model_inference.textproto").write_text('input_shape: [4]\noutput_shape: [4]\n'
                                                               'max_batch_size: 8\ndata_type: "FP32"\n')
    config = tmp_path / "nereid.yaml"
    head = 'server:\n  ml_backends_path: "ml-backends"\n  metrics_addr: ""\n  http_addr: ""\n'
    models = "models:\n  - name: plain\n  - name: own\n    runtime: {warm_start: false}\n"
    config.write_text(head + "backends:\n  python: {warm_start: false}\n" + models)
    (tmp_path / "scratch").mkdir()
    repo = ModelRepository(load_settings(config), make_plugin_manager(load_entry_points=False), tmp_path / "scratch")

    async def edited(backends: str) -> None:
        config.write_text(head + backends + models)
        await repo.apply_settings(load_settings(config))

    async def scenario() -> None:
        for name in ("plain", "own"):
            assert (await repo.load(name)).state is ModelState.READY
        caplog.set_level(logging.INFO, logger="nereid.repository")
        # Nothing either model runs with changes: written out, a preload of nothing.
        await edited("backends:\n  python: {warm_start: false, preload: []}\n")
        assert (repo.generation("plain"), repo.generation("own")) == (1, 1)
        assert "reloading it" not in caplog.text, caplog.text
        assert ("nereid.yaml's backends.python changed, but not the options of 2 loaded models of it (a default "
                "written out, or a key its own runtime: sets): not reloaded") in caplog.text
        # A reload only if anything changed (a file event that changed nothing, in dynamic mode) reloads nothing.
        assert (await repo.reload("plain", only_if_changed=True)).generation == 1
        # Warm start by default again: `own` keeps its own warm_start: false, `plain` alone reloads, warm.
        await edited("")
        assert (repo.generation("plain"), repo.generation("own")) == (2, 1)
        assert repo.entry("plain").loaded.backend.options.warm_start is True
        assert "model 'plain': nereid.yaml's backends.python defaults change its options; reloading it" in caplog.text
        assert "model 'own'" not in caplog.text, caplog.text
        await repo.unload_all()
    asyncio.run(scenario())


def _two_python_models(tmp_path: Path, root: Path, backends: str):
    """A repository of one python model, ``plain`` (PYTHON_ECHO), under ``backends``; and a function that
    writes nereid.yaml anew with other ``backends:`` and returns its settings."""
    (root / "plain").mkdir()
    (root / "plain" / "main.py").write_text(PYTHON_ECHO)
    (root / "plain" / "model_inference.textproto").write_text('input_shape: [4]\noutput_shape: [4]\n'
                                                              'max_batch_size: 8\ndata_type: "FP32"\n')
    config = tmp_path / "nereid.yaml"
    head = 'server:\n  ml_backends_path: "ml-backends"\n  metrics_addr: ""\n  http_addr: ""\n'
    models = "models:\n  - name: plain\n"
    config.write_text(head + backends + models)
    (tmp_path / "scratch").mkdir()
    repo = ModelRepository(load_settings(config), make_plugin_manager(load_entry_points=False), tmp_path / "scratch")

    def edited(new_backends: str):
        config.write_text(head + new_backends + models)
        return load_settings(config)
    return repo, edited


def test_an_edit_that_puts_the_options_back_during_a_reload_is_applied_once_that_reload_ends(tmp_path, root):
    """Found by the review hunt: an edit of backends: while a reload for the edit before it ran, putting the
    options back, was compared with the version serving (the same options): the reload in flight then served its
    options for good (warm start, with nereid.yaml saying warm_start: false)."""
    repo, edited = _two_python_models(tmp_path, root, "backends:\n  python: {warm_start: false}\n")

    async def scenario() -> None:
        assert (await repo.load("plain")).state is ModelState.READY
        entry = repo.entry("plain")
        first = repo.start_settings(edited(""))  # warm start by default: a reload
        for _ in range(1000):  # (its task takes the entry at its first turn; the build takes far longer)
            if entry.holders > 0:
                break
            await asyncio.sleep(0)
        assert entry.holders > 0 and repo.generation("plain") == 1
        second = repo.start_settings(edited("backends:\n  python: {warm_start: false}\n"))
        await asyncio.wait_for(asyncio.gather(first, second), 120)
        assert repo.entry("plain").loaded.backend.options.warm_start is False
        assert repo.generation("plain") == 3
        await repo.unload_all()
    asyncio.run(scenario())


def test_a_mistake_in_backends_undone_takes_its_failed_reload_s_reason_away(tmp_path, root):
    """Found by the review hunt: `warm_sart: 1` failed the reload (the running version serving on, the reason in
    RepositoryIndex); written back, the edit changed no model's options and nothing cleared the reason."""
    repo, edited = _two_python_models(tmp_path, root, "backends:\n  python: {warm_start: false}\n")

    async def scenario() -> None:
        assert (await repo.load("plain")).state is ModelState.READY
        await repo.apply_settings(edited("backends:\n  python: {warm_start: false, warm_sart: 1}\n"))
        entry = repo.entry("plain")
        assert entry.state is ModelState.READY and "warm_sart" in entry.reason, entry.reason
        await repo.apply_settings(edited("backends:\n  python: {warm_start: false}\n"))
        assert (entry.state, entry.reason, repo.generation("plain")) == (ModelState.READY, "", 1)
        await repo.unload_all()
    asyncio.run(scenario())
