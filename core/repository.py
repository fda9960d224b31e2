"""The model repository: which folders exist, who owns them, and their state.

Folders under ``ml_backends_path`` are models (the folder name is the model
name). The repository claims each through the plugins, loads it on a worker
thread, and keeps its state (LOADING, READY, UNLOADING, UNAVAILABLE) and the
reason when it is not ready.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping

import pluggy

from nereid.backend import Backend, ModelContext
from nereid.batching import BatchPolicy
from nereid.errors import ConfigError, NotFound, Unavailable
from nereid.metrics import ServerMetrics
from nereid.plugins import claim_folder
from nereid.scheduler import ModelScheduler
from nereid.settings import ModelSettings, Settings
from nereid.signature import ModelSignature
from nereid.stats import ModelStats
from nereid.tensors import NamedTensor

log = logging.getLogger(__name__)

NOT_LISTED_REASON = "not listed in nereid.yaml; load it with RepositoryModelLoad"


class ModelState(str, enum.Enum):
    """Triton's model states, as RepositoryIndex reports them."""

    LOADING = "LOADING"
    READY = "READY"
    UNLOADING = "UNLOADING"
    UNAVAILABLE = "UNAVAILABLE"


@dataclass
class LoadedModel:
    """A model that loaded: its backend, signatures, scheduler and statistics.

    ``signature`` is client-facing; ``batch_signature`` is what the backend's
    ``infer`` takes and returns (the same unless the backend has hooks).
    ``preprocess`` / ``postprocess`` are the backend's hooks, looked up once.
    """

    backend_name: str
    backend: Backend
    signature: ModelSignature
    batch_signature: ModelSignature
    scheduler: ModelScheduler
    stats: ModelStats
    load_seconds: float
    preprocess: Callable[[list[NamedTensor]], list[NamedTensor]] | None = None
    postprocess: Callable[[list[NamedTensor]], list[NamedTensor]] | None = None


@dataclass
class ModelEntry:
    """One model folder and where it stands."""

    name: str
    folder: Path
    settings: ModelSettings
    settings_origin: str
    state: ModelState = ModelState.UNAVAILABLE
    reason: str = NOT_LISTED_REASON
    loaded: LoadedModel | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass(frozen=True)
class BuiltModel:
    """A loaded backend with what the core derived from it."""

    backend_name: str
    backend: Backend
    signature: ModelSignature
    batch_signature: ModelSignature
    policy: BatchPolicy


def build_model(manager: pluggy.PluginManager, context: ModelContext,
                backend_defaults: Mapping[str, Mapping[str, Any]] | None = None) -> BuiltModel:
    """Claim, create and load one model; raise with the reason when it cannot be served.

    ``backend_defaults`` (nereid.yaml's ``backends:``) gives runtime options for
    every model of the claiming backend; the model's own ``runtime:`` wins.
    Blocking (backends compile and read files here): call it on a worker thread.
    """
    result = claim_folder(manager, context.folder, context.settings.backend)
    if result.claim is None:
        raise ConfigError(result.reason)
    defaults = (backend_defaults or {}).get(result.claim.backend)
    if defaults:
        context = replace(context, settings=replace(context.settings,
                                                     runtime={**defaults, **context.settings.runtime}))
    backend = result.claim.create(context)
    backend.load()
    try:
        signature = backend.signature()
        batch_signature = getattr(backend, "batch_signature", backend.signature)()
        policy = BatchPolicy.resolve(context.settings.batching, batch_signature, context.settings_origin)
    except BaseException:
        backend.unload()
        raise
    return BuiltModel(result.claim.backend, backend, signature, batch_signature, policy)


def list_model_folders(root: Path) -> list[str]:
    """Names of the model folders under ``root`` (hidden folders such as ``.cache`` skipped)."""
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


class ModelRepository:
    """All model folders of one server, and the loaded models among them."""

    def __init__(self, settings: Settings, manager: pluggy.PluginManager, scratch_dir: Path,
                 metrics: ServerMetrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.manager = manager
        self.scratch_dir = scratch_dir
        self.root = settings.server.ml_backends_path
        self._entries: dict[str, ModelEntry] = {}
        self.rescan()
        # Models the server is expected to keep ready: ServerReady looks at these.
        # Start-up models count from the first moment, so the server never
        # reports ready before they have loaded.
        self._exposed: set[str] = set(self.startup_models())
        for name in self._exposed:
            self._entries[name].state, self._entries[name].reason = ModelState.LOADING, "waiting to load"

    def startup_models(self) -> list[str]:
        """The models to load at start: the listed ones, or every folder when none are listed."""
        if self.settings.models_listed:
            return [m.name for m in self.settings.models]
        return list(self._entries)

    def rescan(self) -> None:
        """Pick up folders added since the last scan (a removed folder keeps its entry until unloaded)."""
        for name in list_model_folders(self.root):
            if name not in self._entries:
                settings, origin = self.settings.model_or_default(name)
                self._entries[name] = ModelEntry(name, self.root / name, settings, origin)

    def entries(self) -> list[ModelEntry]:
        """Every known model folder, by name."""
        entries = dict(self._entries)  # a copy: the metrics thread reads this too
        return [entries[name] for name in sorted(entries)]

    def entry(self, name: str) -> ModelEntry:
        """The entry for ``name``; NotFound when no such folder exists."""
        entry = self._entries.get(name)
        if entry is None:
            self.rescan()
            entry = self._entries.get(name)
        if entry is None:
            # The folder relative to ml_backends_path: clients never see the server's absolute paths.
            raise NotFound(f"unknown model '{name}' (no folder '{name}' under ml_backends_path)")
        return entry

    def ready_model(self, name: str) -> LoadedModel:
        """The loaded model behind ``name``; NotFound or Unavailable with the reason otherwise."""
        entry = self._entries.get(name)
        if entry is None:
            raise NotFound(f"unknown model '{name}'")
        if entry.state is not ModelState.READY or entry.loaded is None:
            detail = f": {entry.reason}" if entry.reason else ""
            raise Unavailable(f"model '{name}' is not ready ({entry.state.value}{detail})")
        return entry.loaded

    def server_ready(self) -> bool:
        """True when every exposed model is READY (Triton's strict readiness)."""
        return all(self._entries[name].state is ModelState.READY for name in self._exposed if name in self._entries)

    async def load(self, name: str) -> ModelEntry:
        """(Re)load a model folder. A failure leaves it UNAVAILABLE with the reason; never raises for it."""
        entry = self.entry(name)
        self._exposed.add(name)
        async with entry.lock:
            if entry.loaded is not None:
                await self._unload_locked(entry)
            if not entry.folder.is_dir():
                entry.state, entry.reason = ModelState.UNAVAILABLE, f"folder {entry.folder} no longer exists"
                return entry
            entry.state, entry.reason = ModelState.LOADING, ""
            context = ModelContext(name, entry.folder, entry.settings, self._scratch_for(name), entry.settings_origin)
            started = time.monotonic()
            try:
                built = await asyncio.to_thread(build_model, self.manager, context, self.settings.backend_defaults)
            except Exception as err:  # any load failure is the model's, reported with its reason
                entry.state, entry.reason = ModelState.UNAVAILABLE, _reason(err)
                log.error("model '%s' is UNAVAILABLE: %s", name, entry.reason)
                return entry
            load_seconds = time.monotonic() - started
            if self.metrics is not None:
                self.metrics.model_loaded(name, load_seconds)
            stats = ModelStats()
            scheduler = ModelScheduler(name, built.backend, built.batch_signature, entry.settings.queue_capacity,
                                       entry.settings.instances, stats, built.policy)
            entry.loaded = LoadedModel(built.backend_name, built.backend, built.signature, built.batch_signature,
                                       scheduler, stats, load_seconds,
                                       getattr(built.backend, "preprocess", None),
                                       getattr(built.backend, "postprocess", None))
            entry.state, entry.reason = ModelState.READY, ""
            log.info("model '%s' is READY (backend %s, device %s, %.2f s)", name, built.backend_name,
                     entry.settings.device, load_seconds)
        return entry

    async def unload(self, name: str) -> ModelEntry:
        """Finish the model's queued and running requests, then release it."""
        entry = self.entry(name)
        self._exposed.discard(name)
        async with entry.lock:
            if entry.loaded is not None:
                await self._unload_locked(entry)
            entry.reason = "unloaded"
        return entry

    async def terminate_running(self) -> None:
        """Ask every loaded backend that can to end its running executions now."""
        for entry in self.entries():
            terminate = getattr(entry.loaded.backend, "terminate_running", None) if entry.loaded else None
            if terminate is not None:
                await asyncio.to_thread(terminate)

    async def unload_all(self) -> None:
        """Unload every loaded model (server shutdown)."""
        await asyncio.gather(*(self.unload(e.name) for e in self.entries() if e.loaded is not None))

    async def _unload_locked(self, entry: ModelEntry) -> None:
        loaded = entry.loaded
        assert loaded is not None
        entry.state, entry.reason = ModelState.UNLOADING, ""
        terminate = getattr(loaded.backend, "terminate_running", None)

        async def end_running() -> None:
            if terminate is not None:
                await asyncio.to_thread(terminate)

        # Bounded by the grace: an abandoned request's thread must not hold the unload (or the loop).
        await loaded.scheduler.drain(self.settings.server.shutdown_grace_s, end_running)
        try:
            await asyncio.to_thread(loaded.backend.unload)
        except Exception:
            log.exception("model '%s': unload failed", entry.name)
        entry.loaded = None
        entry.state = ModelState.UNAVAILABLE
        log.info("model '%s' unloaded", entry.name)

    def _scratch_for(self, name: str) -> Path:
        path = self.scratch_dir / name
        path.mkdir(parents=True, exist_ok=True)
        return path


def _reason(err: BaseException) -> str:
    text = str(err).strip()
    return text if text else type(err).__name__
