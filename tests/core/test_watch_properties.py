"""Property-based (hypothesis) tests of dynamic mode's convergence: the repository follows its folder.

A RepositoryWatcher runs (``run()``, real file events, ``watch_settle_ms: 50``)
over a ModelRepository of in-process toys, each adding its folder's version
(``version.txt``) to its input. A random sequence of file-system operations
on a few model folders runs on a thread, with random short pauses between
them: a folder written file by file, an edit, a copy, a ``mv`` to a new name
or over another folder, an ``rm -rf``, two folders swapped through a
temporary name (hidden or not), a half-written folder completed later, an
rsync-style transfer (each file written under a hidden temporary name, then
renamed into place), and a nereid.yaml rewritten to list or unlist models.

Once the operations stop, the repository must converge (README "Dynamic mode"):
every folder on disk that is served is READY and answers input + the version
now on disk; one deliberately not served (unlisted at start, or unlisted from
nereid.yaml since, while settled) is not loaded; where the outcome depends on
what the watcher happened to see (a folder not served, moved or re-made
before its change settled), either is accepted, but a loaded model still
serves the version on disk; a name without a folder leaves the index (a
listed one waits, UNAVAILABLE and not loaded); no version is held that no
name serves; and the state stays so for several settle times (no reload
loop). No exception escapes the watcher and no ERROR is logged except the
documented failed loads of partial folders. After ``stop()`` and
``unload_all``, every toy whose load succeeded was unloaded exactly once.
A nereid.yaml rewritten again before the watcher read it may never be read:
the expectations are those of every way the rewrites may have been read.

It found that a folder renamed while its reload read it serves the old version
under the new name for good; that a listed model whose load failed, its folder
put back after a rescan saw it gone, is never loaded; and two ERROR lines for a
folder deleted as its load begins. The tests at the end show each every time
(xfail until fixed); the property meets them by chance.

Examples are few and short so the module runs in a few seconds;
NEREID_HYPOTHESIS_EXAMPLES=500 (say, with ``--timeout=0``: about 0.8 s an
example) searches deeper, and slower toy loads (NEREID_WATCH_LOAD_S=0.15;
default 0.02) make operations meet more loads under way.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from nereid.backend import BackendClaim, ModelContext
from nereid.dtypes import DType
from nereid.errors import ConfigError
from nereid.hookspecs import hookimpl
from nereid.plugins import make_plugin_manager
from nereid.model_entry import ModelState
from nereid.repository import ModelRepository
from nereid.settings import load_settings
from nereid.signature import TEXTPROTO_NAME
from nereid.tensors import NamedTensor
from nereid.watch import RepositoryWatcher

from toy_backends import ToyModel

BOUNDED = settings(max_examples=int(os.environ.get("NEREID_HYPOTHESIS_EXAMPLES", 3)), deadline=None, database=None,
                   suppress_health_check=[HealthCheck.too_slow])
NAMES = ("a", "b", "c")
SETTLE_MS = 50
# A folder created (written, copied or moved in) this recently may not have been seen by the watcher yet when
# nereid.yaml unlists it: then it may load afterwards as a new folder; and a nereid.yaml rewritten again this soon
# may never have been read. Generous: ten times what it takes.
FRESH_S = 1.0
CONVERGE_S = float(os.environ.get("NEREID_WATCH_CONVERGE_S", 8.0))  # the longest wait for convergence
SETTLE_S = 3 * SETTLE_MS / 1000  # after the last operation: the settle time, with a margin for the events
STABLE_S = 4 * SETTLE_MS / 1000  # it stays converged this long (no reload loop, nothing late)
TEXTPROTO = 'input_shape: [4]\noutput_shape: [4]\nmax_batch_size: 8\n'
X = np.arange(4, dtype=np.float32).reshape(1, 4)
LOAD_S = float(os.environ.get("NEREID_WATCH_LOAD_S", 0.02))  # each toy load takes this long
T, F, EITHER = "served", "not served", "either"


class VersionToy(ToyModel):
    """A toy that adds its folder's ``version.txt`` and counts its unloads (every instance that loaded is kept)."""

    made: list["VersionToy"] = []
    lock = threading.Lock()
    hold: threading.Event | None = None  # when set to an event, each load waits for it (after setting holding)
    holding = threading.Event()

    def __init__(self, context: ModelContext) -> None:
        super().__init__(context)
        self.version = None
        self.unloads = 0

    def load(self) -> None:
        time.sleep(LOAD_S)  # (so that operations meet loads under way)
        if VersionToy.hold is not None:  # (a load that waits, for the tests of one race)
            VersionToy.holding.set()
            VersionToy.hold.wait(5)
        super().load()
        text = (self.context.folder / "version.txt").read_text()
        try:
            self.version = int(text)
        except ValueError:  # read while an editor wrote it: a documented failed load, tried again on the change
            raise ConfigError(f"version.txt: {text!r} is no version") from None
        with VersionToy.lock:
            VersionToy.made.append(self)

    def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        assert self.unloads == 0, f"model '{self.context.name}' ran a request after its unload()"
        return [NamedTensor(self.signature().outputs[0].name, inputs[0].dtype, inputs[0].data + self.version)]

    def unload(self) -> None:
        with VersionToy.lock:
            self.unloads += 1


class VersionPlugin:
    BACKEND_NAME = "vtoy"

    @hookimpl
    def nereid_claim_model(self, folder: Path, declared: bool) -> BackendClaim | None:
        return BackendClaim(VersionToy) if (folder / "vtoy.txt").is_file() else None


# -- the operations ---------------------------------------------------------------------------------------------
names = st.sampled_from(NAMES)
versions = st.integers(1, 9)
pauses = st.sampled_from([0.0, 0.0, 0.002, 0.01, 0.03, 0.07, 0.12, 0.2])  # (the settle time: 0.05)
rsync_pauses = st.sampled_from([0.0, 0.01, 0.03, 0.07, 0.12])  # between a file's writing and its rename
listings = st.lists(names, min_size=1, max_size=3, unique=True).map(tuple)
OPERATION = st.one_of(
    st.tuples(st.just("write"), names, versions),
    st.tuples(st.just("edit"), names, versions),
    st.tuples(st.just("copy"), names, names),
    st.tuples(st.just("mv"), names, names),
    st.tuples(st.just("rm"), names),
    st.tuples(st.just("swap"), names, names, st.sampled_from([".swap", "swap-tmp"])),
    st.tuples(st.just("half"), names, versions),
    st.tuples(st.just("complete"), names),
    st.tuples(st.just("rsync"), names, versions, rsync_pauses),
    st.tuples(st.just("yaml"), st.one_of(st.none(), listings), st.integers(1, 2)),
)
STEPS = st.lists(st.tuples(OPERATION, pauses), max_size=8)
START = st.tuples(st.dictionaries(names, versions, max_size=3), st.one_of(st.none(), listings))


def yaml_text(root: Path, listed: tuple[str, ...] | None, instances: int = 1) -> str:
    text = (f'server:\n  ml_backends_path: "{root}"\n  metrics_addr: ""\n  http_addr: ""\n  watch: true\n'
            f"  watch_settle_ms: {SETTLE_MS}\n  watch_poll_s: 60\n  shutdown_grace_s: 2\n")
    if listed is not None:
        text += "models:\n" + "".join(f"  - name: {name}\n    instances: {instances}\n" for name in listed)
    return text


@dataclass
class Outlook:
    """What the server must make of each name, in one way the watcher may have seen nereid.yaml's rewrites (each
    one read, or overwritten before it was read): T, F or EITHER per name (a name never seen: T, a new folder
    loads), and the listing it runs with."""

    want: dict[str, str]
    listed: tuple[str, ...] | None
    skipped_until: float | None = None  # it never read the last rewrite: possible only if another came by then

    def wanted(self, name: str) -> str:
        return self.want.get(name, T)

    def reborn(self, name: str) -> str:
        """A folder made under ``name`` (absent now): it loads as a new folder if the watcher saw the old one
        go, or counts as a change of the old one (served only if that one was) if not."""
        return T if self.wanted(name) == T else EITHER


@dataclass
class Disk:
    """The folders as the operations left them, and what the README says the server must make of each name."""

    root: Path
    config: Path
    listed: tuple[str, ...] | None  # as nereid.yaml lists them now
    outlooks: list[Outlook]
    folders: dict[str, tuple[int, bool]] = field(default_factory=dict)  # name: (version, half-written)
    created: dict[str, float] = field(default_factory=dict)  # when each folder was created (monotonic)
    log: list[str] = field(default_factory=list)

    def want(self, name: str) -> str:
        """T or F when every outlook agrees, else EITHER."""
        found = {outlook.wanted(name) for outlook in self.outlooks}
        return found.pop() if len(found) == 1 else EITHER

    def write_files(self, folder: Path, version: int, half: bool) -> None:
        folder.mkdir()
        (folder / "version.txt").write_text(str(version))
        (folder / TEXTPROTO_NAME).write_text(TEXTPROTO)
        if not half:
            (folder / "vtoy.txt").write_text("")

    def made(self, name: str, version: int, half: bool) -> None:
        self.folders[name] = (version, half)
        self.created[name] = time.monotonic()
        for outlook in self.outlooks:
            outlook.want[name] = outlook.reborn(name)

    def gone(self, name: str) -> None:
        del self.folders[name]
        for outlook in self.outlooks:
            outlook.want[name] = outlook.reborn(name)  # (for the next folder made under the name)

    def apply(self, op: tuple, index: int) -> None:
        kind, args = op[0], op[1:]
        root, folders = self.root, self.folders
        if kind in ("write", "half") or (kind == "edit" and args[0] not in folders):
            name, version = args
            if name in folders:
                if kind == "write":
                    self.apply(("edit", name, version), index)
                return
            self.write_files(root / name, version, half=kind == "half")
            self.made(name, version, kind == "half")
        elif kind == "edit":  # in place, as most editors write
            name, version = args
            (root / name / "version.txt").write_text(str(version))
            folders[name] = (version, folders[name][1])
        elif kind == "complete":
            name = args[0]
            if name in folders and folders[name][1]:
                (root / name / "vtoy.txt").write_text("")
                folders[name] = (folders[name][0], False)
        elif kind == "rm":
            name = args[0]
            if name in folders:
                shutil.rmtree(root / name)
                self.gone(name)
        elif kind in ("copy", "mv"):
            source, target = args
            if source not in folders or source == target:
                return
            # (Over an existing folder, removed first: a change of it if the watcher saw neither step.)
            wants = [outlook.reborn(target) for outlook in self.outlooks]
            if target in folders:
                shutil.rmtree(root / target)
            if kind == "copy":
                shutil.copytree(root / source, root / target)  # (copy2: the same mtimes, the same identity)
                folders[target] = folders[source]
            else:
                os.rename(root / source, root / target)
                folders[target] = folders[source]
                self.gone(source)
            for outlook, want in zip(self.outlooks, wants):
                outlook.want[target] = want
            self.created[target] = time.monotonic()
        elif kind == "swap":
            first, second, temporary = args
            if first == second or first not in folders or second not in folders:
                return
            os.rename(root / first, root / temporary)
            os.rename(root / second, root / first)
            os.rename(root / temporary, root / second)
            folders[first], folders[second] = folders[second], folders[first]
            for outlook in self.outlooks:
                both = T if outlook.wanted(first) == T and outlook.wanted(second) == T else EITHER
                outlook.want[first] = outlook.want[second] = both
            self.created[first] = self.created[second] = time.monotonic()
        elif kind == "rsync":  # each file under a hidden temporary name, renamed into place once written
            name, version, pause = args
            folder = root / name
            new = name not in folders
            files = {"version.txt": str(version)}
            if new:
                folder.mkdir()
                files = {TEXTPROTO_NAME: TEXTPROTO, **files, "vtoy.txt": ""}
                self.made(name, version, True)
            elif folders[name][1]:
                files["vtoy.txt"] = ""  # (completes a half-written folder)
            for file, text in files.items():
                temporary = folder / f".{file}.X{index:05d}"  # (rsync's: six letters and digits)
                temporary.write_text(text)
                time.sleep(pause)  # longer than the settle time: the partial folder may be tried (documented)
                os.replace(temporary, folder / file)
            folders[name] = (version, False)
        elif kind == "yaml":
            listed, instances = args
            temporary = self.config.with_name(".nereid.yaml.new")
            temporary.write_text(yaml_text(root, listed, instances))
            os.replace(temporary, self.config)
            now = time.monotonic()
            # Each outlook reads this rewrite, or (in a copy) never does, if another comes soon enough.
            outlooks = []
            for outlook in self.outlooks:
                if outlook.skipped_until is not None and now > outlook.skipped_until:
                    continue  # it would have read the rewrite it skipped
                outlooks.append(Outlook(dict(outlook.want), outlook.listed, now + FRESH_S))
                outlook.skipped_until = None
                self.read(outlook, listed)
                outlooks.append(outlook)
            self.outlooks = outlooks
            self.listed = listed
        else:
            raise AssertionError(op)

    def read(self, outlook: Outlook, listed: tuple[str, ...] | None) -> None:
        """The watcher reads nereid.yaml listing ``listed`` (README: added entries load, removed ones unload)."""
        old = outlook.listed
        for name in NAMES:
            # Served as settings_changes.served has it: listed, or nothing is (no models: key serves every
            # folder). (Found by a helper: taking "no key" for "nothing listed", this oracle expected a folder an
            # added models: key leaves out to stay served, and failed about one example in a hundred.)
            was, now = old is None or name in old, listed is None or name in listed
            if was and not now:  # unloaded (a new folder may load after that, though)
                settled = name in self.folders and time.monotonic() - self.created.get(name, 0) > FRESH_S
                outlook.want[name] = F if settled else EITHER
            elif now and not was:  # loaded
                outlook.want[name] = T
        outlook.listed = listed

    def finish(self) -> None:
        """Complete the half-written folders left (the copy's end, after the last operation); the last
        nereid.yaml is read."""
        for name, (version, half) in list(self.folders.items()):
            if half:
                self.apply(("complete", name), -1)
        self.outlooks = [outlook for outlook in self.outlooks if outlook.skipped_until is None]


class ErrorLines(logging.Handler):
    """The ERROR lines logged meanwhile (any logger)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name}: {record.getMessage()}")


def undocumented(line: str) -> bool:
    """An ERROR line that no documented outcome explains. A load of a folder read while it was incomplete
    (half-written, an rsync paused mid-transfer, a file read while an editor wrote it, deleted as it was read)
    fails with the reason, and is tried again when the folder changes (README "Dynamic mode")."""
    return not (line.startswith("nereid.repository: model '")
                and (" is UNAVAILABLE: " in line or ": reload failed, the running version (load " in line))


async def problems(repository: ModelRepository, disk: Disk) -> list[str]:
    """How the repository differs from what it must have converged to (empty: converged)."""
    found = []
    await repository.refresh()  # as RepositoryIndex does before it lists
    entries = {entry.name: entry for entry in repository.entries()}
    for name in sorted(set(entries) | set(disk.folders)):
        entry = entries.get(name)
        if name in disk.folders:
            version, _ = disk.folders[name]
            want = disk.want(name)
            if entry is None:
                found.append(f"'{name}': its folder is on disk but not in the index")
                continue
            if entry.state in (ModelState.LOADING, ModelState.UNLOADING):
                found.append(f"'{name}': still {entry.state.value}")
            elif want == F and entry.loaded is not None:
                found.append(f"'{name}': not to be served (unlisted), yet loaded ({entry.state.value})")
            elif want == T or entry.loaded is not None:
                if entry.state is not ModelState.READY or entry.loaded is None:
                    found.append(f"'{name}': {want}, folder at version {version}, but {entry.state.value} "
                                 f"({entry.reason}), loaded: {entry.loaded is not None}")
                else:
                    x = NamedTensor("input", DType.FP32, X.copy())
                    (out,) = await asyncio.wait_for(entry.loaded.scheduler.submit([x], 1, 0), 5)
                    served = out.data - X
                    if not np.array_equal(served, np.full_like(X, version)):
                        found.append(f"'{name}': serves version {served.ravel()[0]:g}, the folder holds {version}")
        elif disk.listed is not None and name in disk.listed:
            if entry.loaded is not None or entry.state is not ModelState.UNAVAILABLE:
                found.append(f"'{name}': listed, no folder: must wait UNAVAILABLE and unloaded, is "
                             f"{entry.state.value} ({entry.reason}), loaded: {entry.loaded is not None}")
        else:
            found.append(f"'{name}': no folder, not listed, yet in the index ({entry.state.value}, {entry.reason}, "
                         f"loaded: {entry.loaded is not None})")
    for name in disk.listed or ():
        if name not in disk.folders and name not in entries:
            found.append(f"'{name}': listed without a folder, yet not in the index")
    serving = {id(entry.loaded) for entry in entries.values() if entry.loaded is not None}
    held = {id(loaded): name for name, loaded in repository.versions()}
    if set(held) != serving:
        found.append(f"versions held that no name serves: {sorted(held[i] for i in set(held) - serving)}")
    return found


def busy(repository: ModelRepository, watcher: RepositoryWatcher) -> list[str]:
    """What the watcher and the repository are still doing (empty: at rest)."""
    doing = [f"'{entry.name}': a load, reload or unload under way" for entry in repository.entries() if entry.holders]
    doing += [f"pending in the watcher: {sorted(watcher._pending)}"] if watcher._pending else []
    doing += ["the watcher is applying a change"] if watcher._applying.locked() else []
    doing += [f"{len(watcher._changes)} change(s) under way"] if watcher._changes else []
    doing += [f"{len(repository._background)} background task(s)"] if repository._background else []
    return doing


def loads(repository: ModelRepository) -> dict[str, int]:
    """Each name's count of versions loaded so far (a listed name without a folder may come and go: 0)."""
    return {entry.name: entry.generation for entry in repository.entries() if entry.generation}


def run_example(start: tuple[dict[str, int], tuple[str, ...] | None], steps: list[tuple[tuple, float]],
                first_pause: float = 0.0) -> None:
    folders, listed = start
    VersionToy.made = []
    errors = ErrorLines()
    logging.getLogger().addHandler(errors)
    try:
        with tempfile.TemporaryDirectory(prefix="nereid-watch-prop-") as base_name:
            base = Path(base_name)
            root = base / "srv" / "ml-backends"
            root.mkdir(parents=True)
            config = base / "nereid.yaml"
            config.write_text(yaml_text(root, listed))
            want = {name: T if listed is None or name in listed else F for name in folders}
            disk = Disk(root, config, listed, [Outlook(want, listed)])
            for name, version in folders.items():
                disk.write_files(root / name, version, half=False)
                disk.folders[name] = (version, False)
                disk.created[name] = 0.0  # there at start: settled
            asyncio.run(scenario(base, disk, steps, first_pause, errors))
    finally:
        logging.getLogger().removeHandler(errors)


def toy_repository(base: Path, config: Path, *plugins: object) -> tuple[ModelRepository, RepositoryWatcher]:
    """A repository of version toys (and ``plugins``) as nereid.yaml ``config`` sets it up, and its watcher."""
    settings_ = load_settings(config)
    manager = make_plugin_manager(load_entry_points=False, extra_plugins=(VersionPlugin(), *plugins))
    (base / "scratch").mkdir()
    repository = ModelRepository(settings_, manager, base / "scratch")
    return repository, RepositoryWatcher(repository, settings_)


async def start(repository: ModelRepository, watcher: RepositoryWatcher) -> None:
    """What the server does at start in dynamic mode."""
    await watcher.prime()
    repository.watch_started()
    await asyncio.gather(*(repository.load(name) for name in repository.startup_models()))


async def served(repository: ModelRepository, name: str) -> int:
    """The version ``name`` serves, from its answer."""
    x = NamedTensor("input", DType.FP32, X.copy())
    (out,) = await asyncio.wait_for(repository.ready_model(name).scheduler.submit([x], 1, 0), 5)
    return int((out.data - X).ravel()[0])


async def scenario(base: Path, disk: Disk, steps: list[tuple[tuple, float]], first_pause: float,
                   errors: ErrorLines) -> None:
    repository, watcher = toy_repository(base, disk.config)
    await start(repository, watcher)
    running = asyncio.create_task(watcher.run())

    def operate() -> None:
        time.sleep(first_pause)
        for index, (op, pause) in enumerate(steps):
            disk.apply(op, index)
            disk.log.append(f"{op} then {pause} s")
            time.sleep(pause)
        disk.finish()

    try:
        await asyncio.to_thread(operate)
        story = "\n  ".join(disk.log) or "(no operation)"
        await asyncio.sleep(SETTLE_S)  # the last change is seen, and settles
        deadline = time.monotonic() + CONVERGE_S
        while True:
            assert not running.done(), f"the watcher ended: {running.exception()!r}\n  {story}"
            found = await problems(repository, disk)
            if not found and not busy(repository, watcher):
                break
            if time.monotonic() > deadline:
                found += busy(repository, watcher)
                pytest.fail(f"not converged within {CONVERGE_S} s:\n    " + "\n    ".join(found)
                            + f"\n  after:\n  {story}\n  log: {errors.lines}")
            await asyncio.sleep(0.02)
        generations = loads(repository)
        await asyncio.sleep(STABLE_S)
        found = await problems(repository, disk)
        assert not found, f"converged, then not: {found}\n  {story}"
        later = loads(repository)
        assert later == generations, f"loaded again once converged: {generations} -> {later}\n  {story}"
        assert not busy(repository, watcher), f"converged, then busy: {busy(repository, watcher)}\n  {story}"
    finally:
        watcher.stop()
        await asyncio.wait_for(running, 10)  # (it raises what escaped the watcher)
        await asyncio.wait_for(repository.unload_all(), 10)
    wrong = [line for line in errors.lines if undocumented(line)]
    assert not wrong, f"ERROR lines: {wrong}\n  {story}"
    unloads = {id(toy): toy.unloads for toy in VersionToy.made}
    assert all(count == 1 for count in unloads.values()), (
        f"unloads per loaded toy (each must be 1): {[(t.context.name, t.version, t.unloads) for t in VersionToy.made]}"
        f"\n  {story}")
    left = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for _ in range(50):
        if not left:
            break
        await asyncio.sleep(0.01)
        left = [task for task in asyncio.all_tasks() if task is not asyncio.current_task() and not task.done()]
    assert not left, f"tasks left after stop() and unload_all: {left}\n  {story}"


@BOUNDED
@given(START, STEPS, st.sampled_from([0.0, 0.05]))
@example(({"a": 1, "b": 2}, ("a",)), [(("swap", "a", "b", "swap-tmp"), 0.0)], 0.0)
@example(({"a": 1}, None), [(("mv", "a", "b"), 0.0), (("half", "a", 3), 0.12), (("rsync", "c", 4, 0.0), 0.0)], 0.0)
@example(({"a": 6}, None), [(("yaml", ("b",), 1), 0.0)], 0.0)  # (the oracle's own defect, above)
# A wanted folder whose load failed, left out by an added models: key, is no longer wanted: its fixed files do not
# load (found by a helper: they did, where a restart with the new file would not load them).
@example(({}, None), [(("half", "c", 4), 1.2), (("yaml", ("a",), 1), 0.3)], 0.0)
def test_the_repository_converges_to_its_folders(start, steps, first_pause) -> None:
    run_example(start, steps, first_pause)


# -- the defects the property found, each shown every time (the property meets them by chance) -----------------

def by_hand(watcher: RepositoryWatcher) -> RepositoryWatcher:
    """``watcher``, with no scan of its own scheduled: only the test's ``apply()`` calls look (one at a time)."""
    watcher._schedule_settled_scan = lambda: None
    return watcher


def one_toy(base: Path, settle_ms: int, *plugins: object) -> tuple[ModelRepository, RepositoryWatcher]:
    """A repository under ``base`` with the toy ``a`` at version 1, and its watcher applied by hand."""
    root = base / "ml-backends"
    root.mkdir()
    disk = Disk(root, base / "nereid.yaml", None, [])
    disk.write_files(root / "a", 1, half=False)
    disk.config.write_text(yaml_text(root, None).replace(f"watch_settle_ms: {SETTLE_MS}",
                                                         f"watch_settle_ms: {settle_ms}"))
    repository, watcher = toy_repository(base, disk.config, *plugins)
    return repository, by_hand(watcher)


# Defect: a folder renamed while its reload read it served the old version under the new name for good (the
# rename moved the version the failed reload left, and the new folder counted as loaded).
def test_a_folder_renamed_while_it_reloads_serves_the_version_on_disk(tmp_path):
    """`a` serves version 1; version 2 is written and the watcher reloads it; while the load reads the files the
    folder is renamed (`mv a c`). The reload fails (its files moved away), but the watcher had taken `a`'s new
    files as known: seeing `a` gone and `c` with the same content, it moves version 1 to `c` in place, and `c`'s
    files count as loaded. `c` must serve its files' version 2 (found by the property: `mv c a; cp -r b c;
    rm -rf a` while `a`'s reload ran, with loads of 0.15 s)."""
    repository, watcher = one_toy(tmp_path, settle_ms=0)
    root = tmp_path / "ml-backends"

    async def scenario() -> None:
        await start(repository, watcher)
        assert await served(repository, "a") == 1
        (root / "a" / "version.txt").write_text("2")
        await watcher.apply()  # seen; settled at the next look (watch_settle_ms: 0)
        VersionToy.holding.clear()
        VersionToy.hold = threading.Event()
        try:
            reload = asyncio.create_task(watcher.apply())  # reloads 'a' ...
            await asyncio.to_thread(VersionToy.holding.wait, 5)
            os.rename(root / "a", root / "c")  # ... and the folder is renamed meanwhile
        finally:
            VersionToy.hold.set()
            VersionToy.hold = None
        await reload
        for _ in range(3):
            await watcher.apply()
        try:
            assert await served(repository, "c") == 2, repository.entry("c").reason
        finally:
            await repository.unload_all()
    asyncio.run(scenario())


class RemovedAsAsked:
    """A backend whose claim hook deletes the folder it is asked about (the user's `rm -rf`, as a load asks the
    backends) and declines it."""

    BACKEND_NAME = "rmrf"

    @hookimpl
    def nereid_claim_model(self, folder: Path, declared: bool) -> BackendClaim | None:
        shutil.rmtree(folder, ignore_errors=True)
        return None


# Defect: the cxx backend's nereid_declaration_hint raised FileNotFoundError for a folder deleted during its load,
# logged at ERROR as a broken plugin (and its later failures only at DEBUG).
def test_a_declaration_hint_about_a_folder_deleted_meanwhile_is_no_plugin_failure(tmp_path):
    """In dynamic mode a folder can be deleted as its load asks the backends about it (seen by the property);
    no built-in backend may then count as failing."""
    repository, _ = one_toy(tmp_path, SETTLE_MS, RemovedAsAsked())
    (tmp_path / "ml-backends" / "a" / "vtoy.txt").unlink()  # only the deleting backend is asked to claim it
    errors = ErrorLines()
    logging.getLogger().addHandler(errors)
    try:
        asyncio.run(repository.load("a"))
    finally:
        logging.getLogger().removeHandler(errors)
    assert not [line for line in errors.lines if line.startswith("nereid.plugins")], errors.lines


# Defect: a folder deleted between the watcher's scan and its load was logged at ERROR as the watcher's failure
# (NotFound), though nothing failed.
def test_a_folder_deleted_before_its_load_started_is_no_error(tmp_path):
    """The watcher decides to load the new folder `b` from its scan; `b` is deleted before the load starts (seen
    by the property). The next scan sees it gone: nothing is wrong, and no ERROR says otherwise."""
    repository, watcher = one_toy(tmp_path, settle_ms=0)
    root = tmp_path / "ml-backends"
    errors = ErrorLines()

    async def scenario() -> None:
        await start(repository, watcher)
        Disk(root, tmp_path / "nereid.yaml", None, []).write_files(root / "b", 1, half=False)
        await watcher.apply()  # seen; settled at the next look (watch_settle_ms: 0)
        look = watcher._look

        def look_then_delete():
            seen = look()
            watcher._look = look
            shutil.rmtree(root / "b")  # deleted right after the scan
            return seen
        watcher._look = look_then_delete
        logging.getLogger().addHandler(errors)
        try:
            await watcher.apply()  # loads 'b', gone by then
            await watcher.apply()
            await watcher.apply()
        finally:
            logging.getLogger().removeHandler(errors)
        assert [entry.name for entry in repository.entries()] == ["a"]
        await repository.unload_all()
    asyncio.run(scenario())
    assert errors.lines == []


# Defect: a listed model whose load failed, its folder deleted and put back before the removal settled, was never
# loaded when a rescan (RepositoryIndex) ran meanwhile: the rescan dropped it from the models served, and the
# watcher took the folder's return as an edit of a model not served.
def test_a_listed_folder_put_back_after_a_rescan_saw_it_gone_loads(tmp_path):
    """README: a listed model "loads when the folder lands", and one whose last load failed is tried again
    when its files change (found by the property: a listed model's load failed as its folder was deleted,
    then a half-written folder put back under the name and completed, with loads of 0.15 s)."""
    root = tmp_path / "ml-backends"
    root.mkdir()
    disk = Disk(root, tmp_path / "nereid.yaml", ("a",), [])
    disk.write_files(root / "a", 1, half=True)  # its load fails: no backend claims it
    disk.config.write_text(yaml_text(root, ("a",)).replace(f"watch_settle_ms: {SETTLE_MS}", "watch_settle_ms: 0"))
    repository, watcher = toy_repository(tmp_path, disk.config)
    by_hand(watcher)

    async def scenario() -> None:
        await start(repository, watcher)
        assert repository.entry("a").state is ModelState.UNAVAILABLE
        shutil.rmtree(root / "a")  # `rm -rf a && cp -r fixed a`, within the settle time ...
        await watcher.apply()  # (seen gone: not settled)
        repository.rescan()  # ... with a RepositoryIndex in between
        disk.write_files(root / "a", 2, half=False)
        await watcher.apply()  # (back, changed: not settled)
        await watcher.apply()
        try:
            entry = repository.entry("a")
            assert entry.state is ModelState.READY, entry.reason
            assert await served(repository, "a") == 2
        finally:
            await repository.unload_all()
    asyncio.run(scenario())
