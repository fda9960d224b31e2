"""One model folder's entry in the repository: its state, the version it serves, and the lock its loads take.

The repository (:mod:`nereid.repository`) owns the entries and moves them
between states; the data plane, the metrics and the watcher read them.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

from nereid.backend import Model
from nereid.errors import Unavailable
from nereid.model_runner import HookThreads, Runner
from nereid.scheduler import ModelScheduler
from nereid.settings import DEFAULT_CONFIG_NAME, ModelSettings
from nereid.signature import ModelSignature
from nereid.stats import ModelStats


def not_listed_reason(config_name: str = DEFAULT_CONFIG_NAME) -> str:
    """The reason of a folder the configuration file ``config_name`` does not list (see Settings.config_name).
    (The data plane adds "; load it with RepositoryModelLoad" where that call is served.)"""
    return f"not listed in {config_name}"


NOT_LISTED_REASON = not_listed_reason()  # with the default file's name: an entry made with no reason of its own
# A folder that appeared after the start of a server with no models: key (every folder loads at start) and no
# server.watch: "not listed in nereid.yaml" said so of a file that lists nothing (found by a bug hunt).
FOUND_AFTER_START_REASON = "found after the start (without server.watch, a folder added later is not loaded by itself)"


def waiting_for_folder(name: str) -> str:
    """The reason of a listed model whose folder is not in the repository (dynamic mode loads it once it lands)."""
    return f"waiting for its folder '{name}' in ml_backends_path"


class ModelState(str, enum.Enum):
    """Triton's model states, as RepositoryIndex reports them."""

    LOADING = "LOADING"
    READY = "READY"
    UNLOADING = "UNLOADING"
    UNAVAILABLE = "UNAVAILABLE"


@dataclass
class LoadedVersion:
    """One version of a model that loaded and serves (or retires): its backend's :class:`~nereid.backend.Model`,
    signatures, scheduler and statistics. A :class:`ModelEntry` (one per name) holds the version it serves; a
    :class:`RetiringVersion` one a reload or unload replaced, while it drains.

    ``signature`` is client-facing; ``batch_signature`` is what the backend's
    ``infer`` takes and returns (the same unless the backend has hooks).
    ``run`` is its request path ([preprocess →] queue [→ postprocess]), built once at load.
    """

    backend_name: str
    backend: Model
    signature: ModelSignature
    batch_signature: ModelSignature
    scheduler: ModelScheduler
    stats: ModelStats
    load_seconds: float
    run: Runner
    hook_threads: HookThreads  # what ``run`` runs its hooks on: released with the version
    depends_on: tuple[str, ...] = ()  # models it calls (a meta model): READY only while they are
    # The folder's files as the watcher stamps them, taken before the build (a local folder; None: a bucket's):
    # a watcher seeing the same files needs not load them again, nor a client's load behind another.
    stamp: object = None
    settings: ModelSettings | None = None  # what it was built with (nereid.yaml may have changed since)
    backend_defaults: object = None  # nereid.yaml's backends: entry for its backend, as it was built with
    # What keeps the version folder it runs from (a model from an object store; see nereid.storage.VersionHold):
    # released with the version, once its requests have finished.
    folder_hold: object = None
    uses_device: bool = True  # False: it runs nothing on a device (see UsesNoDevice), reported on the CPU
    longest_run_s: float | None = None  # the bound it ends each execution at itself (see BoundsItsRuns)

    def release_folder(self) -> None:
        """Let the version folder go (the version is released); nothing for a local folder, or a second time."""
        if self.folder_hold is not None:
            self.folder_hold.release()


class LoadAbandoned(Unavailable):
    """A load or reload given up because an unload or a removal of the model came while its backend's load()
    ran (or before it started): the unload does not wait for a load() that may never return."""


@dataclass
class ModelEntry:
    """One model folder and where it stands."""

    name: str
    folder: Path
    settings: ModelSettings
    settings_origin: str
    state: ModelState = ModelState.UNAVAILABLE
    reason: str = NOT_LISTED_REASON
    loaded: LoadedVersion | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    generation: int = 0  # versions loaded so far: every load and reload adds one
    holders: int = 0  # operations holding the lock or waiting for it
    folder_seen: bool = False  # a scan found its folder (a listed model may be waiting for its first)
    # Listed and asked for when a rescan found its folder gone (before the watcher saw it go): no longer counted
    # for ServerReady, but still wanted, so that the folder's return loads it, however the watcher sees that.
    awaiting_folder: bool = False
    # The names whose scratch folders its versions were given: its own, and the names it was renamed from
    # (a model moved in place keeps what it made there, a binary's link, a warm parent's folder).
    scratch_names: set[str] = field(default_factory=set)
    # Versions a removal took from it that are still finishing their requests (in the background, without
    # its lock): the entry stays, UNLOADING, until they are released, unless a new folder's model loads first.
    draining: int = 0
    # Why its last load or reload failed, when the object store failed it (a fetch, a listing, a weights
    # stream): a watcher tries such a load again. Empty when it loaded, or failed for its own reasons.
    store_fault: str = ""
    # The backend's load() of a load or reload under way (its daemon thread's future), and the unloads and
    # removals waiting for the entry: each gives up on that load, whose load() may never return.
    building: asyncio.Future | None = None
    unloads_waiting: int = 0
    # Why its last load or reload was given up for an unload or removal (LoadAbandoned); "" otherwise. Set when
    # that load returns, cleared when the next starts: its caller reads it at once.
    abandoned: str = ""
    # Its last load or reload refused for the models it calls, which a change of theirs may let through (in
    # dynamic mode it is tried again then, see ModelRepository): what a new version kept from serving calls,
    # or the other models on the depends_on cycle a load closed. Cleared when the next load or reload starts.
    kept_calling: tuple[str, ...] = ()
    cycle_through: frozenset[str] = frozenset()

    def clear_refusal(self) -> None:
        """Forget the last load's outcome (a load or reload is starting)."""
        self.abandoned = ""
        self.kept_calling, self.cycle_through = (), frozenset()

    @contextlib.asynccontextmanager
    async def held_for_unload(self) -> AsyncIterator[None]:
        """:meth:`held`, for an unload or a removal: a load under way, or one that would start while this
        waits, is abandoned (see :class:`LoadAbandoned`), so that a backend's load() that never returns cannot
        keep the model from being unloaded, or the unload from being answered."""
        self.unloads_waiting += 1
        try:
            if self.building is not None:
                self.building.cancel()  # the late result goes to unload_unclaimed, on its thread
            async with self.held():
                yield
        finally:
            self.unloads_waiting -= 1

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        """Hold the entry's lock (loads, unloads, renames take turns). The entry counts as in use
        from the moment the caller starts waiting, so a rescan never forgets it under a waiter."""
        self.holders += 1
        try:
            async with self.lock:
                yield
        finally:
            self.holders -= 1

    def in_use(self) -> bool:
        """A model is loaded or draining, or an operation holds or awaits the lock."""
        return self.loaded is not None or self.holders > 0 or self.draining > 0

    def waiting_on_dependencies(self) -> bool:
        """Loaded, but UNAVAILABLE until every model it calls is READY (the repository's walk of the
        dependency graph is the only thing that leaves a loaded model UNAVAILABLE)."""
        return self.loaded is not None and self.state is ModelState.UNAVAILABLE


@dataclass(frozen=True)
class RetiringVersion:
    """A version that serves no more (reloaded, unloaded, removed) and finishes its requests before release."""

    name: str  # the name it served under
    loaded: LoadedVersion
    scratch_names: frozenset[str]  # its entry's scratch folders: kept while it runs
