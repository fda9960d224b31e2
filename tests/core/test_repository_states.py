"""Property-based (hypothesis) state tests of the model repository and the data plane over it.

Random sequences of what users and the dynamic repository do to a few model
names (write, edit, break, fix, delete and rename folders; load, reload,
unload, remove, rescan, infer, a new nereid.yaml; two or three of those at
once, with asyncio.gather) run in one event loop against a ModelRepository
and a DataPlane over it, with an in-process toy backend (ToyModel counting
its loads and unloads, adding its folder's offset).
After every step: each operation ended in time with a documented error at
most; the index lists each name once with a valid state; a READY model
answers input + its offset and a model not READY answers UNAVAILABLE, never
a result; no version that was unloaded still serves; server readiness agrees
with the states (and, while the test can follow it, with which models were
asked for). After unload_all: nothing READY or loaded, every backend that
loaded was unloaded exactly once, and no asyncio task is left.

It found that a rename onto a name whose model was still loaded (its folder
deleted, or loaded by a RepositoryModelLoad racing the watcher's rename)
replaced that model without unloading it; the explicit example keeps that case.

Examples are bounded so the module runs in a few seconds;
NEREID_HYPOTHESIS_EXAMPLES=2000 (say) searches deeper.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from nereid.backend import BackendClaim, ModelContext
from nereid.dataplane import DataPlane
from nereid.dtypes import DType
from nereid.errors import ModelFailure, NereidError, NotFound, Unavailable
from nereid.hookspecs import hookimpl
from nereid.plugins import make_plugin_manager
from nereid.model_entry import ModelState
from nereid.repository import ModelRepository
from nereid.settings import load_settings
from nereid.signature import TEXTPROTO_NAME
from nereid.tensors import InferRequest, NamedTensor

from toy_backends import ToyModel

BOUNDED = settings(max_examples=int(os.environ.get("NEREID_HYPOTHESIS_EXAMPLES", 40)), deadline=None, database=None,
                   suppress_health_check=[HealthCheck.too_slow])
NAMES = ("a", "b", "c")
OP_TIMEOUT_S = 10.0
SLOW_S = 0.002  # each toy load and request takes this long
X = np.arange(4, dtype=np.float32).reshape(1, 4)

# What each operation may raise (documented errors); anything else fails the property.
ALLOWED = {
    "load": (NotFound, ModelFailure),  # no folder; a load or reload that failed
    "reload": (NotFound,),
    "unload": (NotFound,),
    "rename": (NotFound,),  # the new folder went meanwhile (a concurrent delete)
    "infer": (NotFound, Unavailable),
}


class CountingToy(ToyModel):
    """A toy that adds the integer in its folder's ``toy.txt`` (its offset) and counts its loads and unloads."""

    made: list["CountingToy"] = []  # every instance whose load() succeeded, of the example running
    lock = threading.Lock()

    def __init__(self, context: ModelContext) -> None:
        super().__init__(context)
        self.offset = 0
        self.loaded = False
        self.unloads = 0

    def load(self) -> None:
        time.sleep(SLOW_S)  # (so that operations started at once meet the model LOADING)
        super().load()  # fail.txt refuses it
        self.offset = int((self.context.folder / "toy.txt").read_text() or "1")
        self.loaded = True
        with CountingToy.lock:
            CountingToy.made.append(self)

    def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        assert self.unloads == 0, f"model '{self.context.name}' ran a request after its unload()"
        time.sleep(SLOW_S)  # (so that an unload or reload started at once meets the request running)
        return [NamedTensor(self.signature().outputs[0].name, inputs[0].dtype, inputs[0].data + self.offset)]

    def unload(self) -> None:
        with CountingToy.lock:
            self.unloads += 1


class CountingPlugin:
    @hookimpl
    def nereid_claim_model(self, folder: Path, declared: bool) -> BackendClaim | None:
        if (folder / "toy.txt").is_file():
            return BackendClaim(CountingToy)
        return None


def yaml_text(listed: tuple[str, ...], instances: int) -> str:
    text = ('server:\n  ml_backends_path: "ml-backends"\n  metrics_addr: ""\n  http_addr: ""\n  watch: true\n')
    if listed:
        text += "models:\n" + "".join(f"  - name: {name}\n    instances: {instances}\n" for name in listed)
    return text


# -- operations -------------------------------------------------------------------------------------------------
names = st.sampled_from(NAMES)
offsets = st.integers(1, 3)
SIMPLE = st.one_of(
    st.tuples(st.just("write"), names, offsets),
    st.tuples(st.just("edit"), names, offsets),
    st.tuples(st.just("break"), names),
    st.tuples(st.just("fix"), names),
    st.tuples(st.just("delete"), names),
    st.tuples(st.just("rename"), names, names).filter(lambda op: op[1] != op[2]),
    st.tuples(st.just("load"), names),
    st.tuples(st.just("reload"), names),
    st.tuples(st.just("unload"), names),
    st.tuples(st.just("remove"), names),
    st.tuples(st.just("index")),
    st.tuples(st.just("infer"), names),
    st.tuples(st.just("settings"), st.lists(names, unique=True, max_size=3).map(tuple), st.integers(1, 2)),
)
OPS = st.one_of(SIMPLE, SIMPLE, st.tuples(st.just("gather"), SIMPLE, SIMPLE),
                st.tuples(st.just("gather"), SIMPLE, SIMPLE, SIMPLE))
START = st.tuples(st.dictionaries(names, offsets, max_size=3), st.lists(names, unique=True, max_size=2).map(tuple))


@dataclass
class World:
    root: Path  # the folder holding nereid.yaml
    plane: DataPlane
    # The names the server is expected to keep READY (README "Readiness"), while the test can follow them:
    # None once an operation whose effect on them it does not model has run (two at once, a new nereid.yaml).
    wanted: set[str] | None = field(default_factory=set)
    log: list[str] = field(default_factory=list)

    @property
    def repo(self) -> ModelRepository:
        return self.plane.repository

    @property
    def models(self) -> Path:
        return self.root / "ml-backends"


def write_folder(folder: Path, offset: int) -> None:
    folder.mkdir(parents=True)
    (folder / "toy.txt").write_text(str(offset))
    (folder / TEXTPROTO_NAME).write_text('input_shape: [4]\noutput_shape: [4]\nmax_batch_size: 8\n')


async def infer(world: World, name: str) -> None:
    """One client request: input + the offset of the version that served it, or NotFound / Unavailable."""
    entry = world.repo._entries.get(name)
    ready = entry is not None and entry.state is ModelState.READY
    before = entry.loaded if entry is not None else None
    try:
        response = await world.plane.infer(InferRequest(name, [NamedTensor("input", DType.FP32, X.copy())]))
    except (NotFound, Unavailable) as err:
        assert not ready, f"model '{name}' was READY when the request came, yet it failed: {err!r}"
        assert str(world.root) not in str(err), err
        if entry is not None and isinstance(err, Unavailable):  # says why
            assert f"model '{name}' is not ready (" in str(err), err
        return
    assert ready, f"model '{name}' was not READY, yet it answered"
    after = world.repo._entries.get(name)
    offsets = {loaded.backend.offset for loaded in (before, after.loaded if after is not None else None)
               if loaded is not None}
    (out,) = response.outputs
    assert any(np.array_equal(out.data, X + offset) for offset in offsets), (name, out.data, offsets)


async def run_op(world: World, op: tuple, alone: bool) -> None:
    kind, args = op[0], op[1:]
    repo, plane, models = world.repo, world.plane, world.models
    wanted = world.wanted if alone else None
    if kind == "write":
        name, offset = args
        if not (models / name).exists():
            write_folder(models / name, offset)
    elif kind == "edit":
        name, offset = args
        if (models / name).is_dir():
            (models / name / "toy.txt").write_text(str(offset))
    elif kind == "break":
        if (models / args[0]).is_dir():
            (models / args[0] / "fail.txt").write_text("broken on purpose")
    elif kind == "fix":
        (models / args[0] / "fail.txt").unlink(missing_ok=True)
    elif kind == "delete":
        shutil.rmtree(models / args[0], ignore_errors=True)
    elif kind == "rename":  # what the watcher does once it sees a folder renamed
        old, new = args
        if (models / old).is_dir() and not (models / new).exists():
            (models / old).rename(models / new)
            entry = repo._entries.get(old)
            moved = (entry is not None and entry.loaded is not None
                     and repo.settings.model_or_default(new)[0] == replace(entry.settings, name=new))
            await repo.rename(old, new)
            if wanted is not None:
                if moved:
                    if old in wanted:
                        wanted.discard(old)
                        wanted.add(new)
                else:
                    wanted.discard(old)
                    wanted.add(new)
    elif kind == "load":
        name = args[0]
        try:
            await plane.load(name)
        except NotFound:
            return
        except ModelFailure:
            if wanted is not None:
                wanted.add(name)
            return
        if wanted is not None:
            wanted.add(name)
        if alone:  # a load that succeeded serves the folder as it is now
            entry = repo.entry(name)
            expected = int((models / name / "toy.txt").read_text())
            assert entry.state is ModelState.READY and entry.loaded.backend.offset == expected, (
                entry.state, entry.reason, entry.loaded.backend.offset, expected)
            await infer(world, name)
    elif kind == "reload":
        name = args[0]
        entry = repo._entries.get(name)
        was_loaded = entry is not None and entry.loaded is not None
        await repo.reload(name)  # (NotFound: no entry added)
        # A model not loaded is loaded as the watcher loads one (counted by ServerReady as it was; once it serves
        # if it was not): one that fails is not waited for.
        after = repo._entries.get(name)
        if wanted is not None and not was_loaded and after is not None and after.state is ModelState.READY:
            wanted.add(name)
    elif kind == "unload":
        if wanted is not None:
            wanted.discard(args[0])
        await plane.unload(args[0])
    elif kind == "remove":  # what the watcher does once a folder is gone
        if wanted is not None:
            wanted.discard(args[0])
        await repo.remove(args[0])
    elif kind == "index":
        before = {e.name: e for e in repo.entries()}
        index = await plane.repository_index()
        listed = [row.name for row in index]
        assert len(listed) == len(set(listed)), listed
        on_disk = {p.name for p in models.iterdir()}
        assert not alone or on_disk <= set(listed), (on_disk, listed)  # (two at once: a folder written since)
        if wanted is not None:  # a folder gone while not loaded is no longer asked for
            for name in list(wanted):
                entry = before.get(name)
                if name in on_disk or (entry is not None and entry.in_use()):
                    continue
                if repo.settings.model(name) is not None and (entry is None or not entry.folder_seen):
                    continue  # listed, its folder not seen since: it waits for it, as at start
                wanted.discard(name)
    elif kind == "infer":
        await infer(world, args[0])
    elif kind == "settings":
        listed, instances = args
        world.wanted = None
        (world.root / "nereid.yaml").write_text(yaml_text(listed, instances))
        await repo.apply_settings(load_settings(world.root / "nereid.yaml"))
    else:
        raise AssertionError(op)


async def run_step(world: World, op: tuple) -> None:
    if op[0] == "gather":
        world.wanted = None
        results = await asyncio.gather(*(guarded(world, sub, alone=False) for sub in op[1:]), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
    else:
        await guarded(world, op, alone=True)


async def guarded(world: World, op: tuple, alone: bool) -> None:
    try:
        await asyncio.wait_for(run_op(world, op, alone), OP_TIMEOUT_S)
    except NereidError as err:
        # A load that an unload or removal run beside it gave up on (UNAVAILABLE, "load abandoned": the unload,
        # which came last, wins); never one run alone.
        abandoned = op[0] == "load" and not alone and isinstance(err, Unavailable) and "load abandoned" in str(err)
        allowed = ALLOWED.get(op[0], ())
        assert abandoned or isinstance(err, allowed), f"{op} raised {err!r}"


async def check(world: World) -> None:
    """The invariants that hold between steps."""
    repo, plane = world.repo, world.plane
    entries = repo.entries()
    names = [e.name for e in entries]
    assert len(names) == len(set(names)), names
    assert all(repo._entries[e.name] is e for e in entries), [(k, e.name) for k, e in repo._entries.items()]
    for entry in entries:
        assert isinstance(entry.state, ModelState)
        assert entry.folder == world.models / entry.name, (entry.name, entry.folder)
        assert str(world.root) not in entry.reason, entry.reason  # clients never see the server's paths
        if entry.state is ModelState.UNAVAILABLE:
            assert entry.reason, f"model '{entry.name}' is UNAVAILABLE without a reason"
        elif entry.state is ModelState.READY and entry.reason:
            assert entry.reason.startswith("reload failed, the running version keeps serving: "), entry.reason
        if entry.loaded is not None:
            assert entry.loaded.backend.unloads == 0, f"model '{entry.name}' is loaded with a backend unloaded"
        if entry.state is ModelState.READY:
            assert entry.loaded is not None, entry
        await infer(world, entry.name)
    states = {e.name: e.state for e in repo.entries()}
    if any(state is ModelState.LOADING for state in states.values()):
        assert not plane.ready()
    if all(state is ModelState.READY for state in states.values()):
        assert plane.ready(), states
    if world.wanted is not None:
        expected = all(states.get(name, ModelState.READY) is ModelState.READY for name in world.wanted)
        assert plane.ready() == expected, (plane.ready(), world.wanted, states)


async def scenario(root: Path, start: tuple, ops: list[tuple]) -> World:
    folders, listed = start
    models = root / "ml-backends"
    models.mkdir()
    for name, offset in folders.items():
        write_folder(models / name, offset)
    listed = tuple(name for name in listed if name in folders)
    (root / "nereid.yaml").write_text(yaml_text(listed, 1))
    (root / "scratch").mkdir()
    settings_ = load_settings(root / "nereid.yaml")
    manager = make_plugin_manager(load_entry_points=False, extra_plugins=(CountingPlugin(),))
    repo = ModelRepository(settings_, manager, root / "scratch")
    world = World(root, DataPlane(repo, settings_))
    startup = repo.startup_models()
    world.wanted = set(startup)
    await asyncio.wait_for(asyncio.gather(*(repo.load(name) for name in startup)), OP_TIMEOUT_S)
    await check(world)
    for op in ops:
        world.log.append(repr(op))
        await run_step(world, op)
        await check(world)
    await asyncio.wait_for(repo.unload_all(), OP_TIMEOUT_S)
    for entry in repo.entries():
        assert entry.state is not ModelState.READY and entry.loaded is None, (entry.name, entry.state)
    for toy in CountingToy.made:
        assert toy.unloads == 1, (f"model '{toy.context.name}' (offset {toy.offset}) was unloaded {toy.unloads} "
                                  "times after it loaded once")
    await asyncio.sleep(0)
    left = asyncio.all_tasks() - {asyncio.current_task()}
    assert not left, left
    return world


def run_scenario(start: tuple, ops: list[tuple]) -> None:
    CountingToy.made = []
    with tempfile.TemporaryDirectory() as temp:
        asyncio.run(scenario(Path(temp), start, ops))


@BOUNDED
# A rename onto a name whose model is still loaded: that model was replaced without being unloaded.
@example(start=({"a": 1, "b": 2}, ()), ops=[("delete", "b"), ("rename", "a", "b")])
# The test's own model: a model not loaded (unlisted at start), broken, then reloaded was taken as waited for.
@example(start=({"a": 1, "c": 1}, ("a",)), ops=[("break", "c"), ("reload", "c")])
@given(START, st.lists(OPS, max_size=10))
def test_random_repository_operations_keep_the_invariants(start: tuple, ops: list[tuple]) -> None:
    run_scenario(start, ops)
