"""The model repository: which folders exist, who owns them, and their state.

Folders under ``ml_backends_path`` are models (the folder name is the model
name). The repository claims each through the plugins, loads it on a worker
thread, and keeps its state (LOADING, READY, UNLOADING, UNAVAILABLE) and the
reason when it is not ready.
"""

from __future__ import annotations

import asyncio
import difflib
import functools
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Awaitable, Callable, Collection, Container, Coroutine, Protocol, TypeVar

import pluggy

from nereid.backend import ModelCaller, ModelContext, Relocatable
from nereid.backend_calls import on_daemon_thread, terminate_backend, unload_backend
from nereid.client_paths import ClientPaths
from nereid.config_document import same_values
from nereid.daemon_pool import on_io_thread, on_work_thread
from nereid.dependencies import DependencyCycle
from nereid.dependent_states import DependentStates, log_unavailable
from nereid.errors import (ConfigError, NereidError, NotFound, PublicText, Unavailable, backend_exit, calling_plugin,
                           cap_message, describe_exception, loop_safe_call)
from nereid.files import NAME_MAX, folder_gone, is_model_folder_name
from nereid.folder_cleanup import FolderCleanup
from nereid.folder_states import folder_stamp
from nereid.log_limit import RateLimitedLog
from nereid.model_building import BackendRaised
from nereid.model_entry import (FOUND_AFTER_START_REASON, LoadAbandoned, LoadedVersion, ModelEntry, ModelState,
                                RetiringVersion, not_listed_reason, waiting_for_folder)
from nereid.model_hooks import collect_released_code_soon
from nereid.plugins import OptionsAsked, check_backend_defaults, gone_while_loading, options_change
from nereid.settings import ModelSettings, Settings
from nereid.settings_changes import changed_backends, served, settings_step
from nereid.stats import ModelStats
from nereid.store_retries import StartupListing
from nereid.storage import (StorageError, failure_kind, forget_listed_folder, mirror_leftovers, model_folder_exists,
                            scan_model_folders, store_failed, store_holds_folder, store_unreachable)
from nereid.task_sets import until_all_done
from nereid.version_loader import VersionLoader, discard_version

log = logging.getLogger(__name__)

T = TypeVar("T")

# How long past its own bound (timeout_s) a run of a replaced version may still take to be ended and answered: a
# warm parent that stops answering fails its runs at most 5 s past their timeout_s.
RUN_END_MARGIN_S = 5.0


@dataclass(frozen=True)
class RepositoryScan:
    """One look at the model folders: their names, or why they could not be listed."""

    names: list[str] | None  # None: the store (or folder) could not be listed
    error: StorageError | None = None
    # A store's: the names whose cached copy is in the local mirror but which the listing no longer has.
    leftovers: tuple[str, ...] = ()


class RepositoryEvents(Protocol):
    """Who hears of loads and dynamic-repository events (the server's metrics)."""

    def model_loaded(self, model: str, seconds: float) -> None:
        """One model version loaded in ``seconds``."""

    def repository_event(self, model: str, event: str) -> None:
        """A ``reload``, ``reload_failed``, ``rename`` or ``remove``."""

    def model_renamed(self, old: str, new: str) -> None:
        """The loaded model ``old`` moved in place to the name ``new`` (its folder renamed): what was kept for
        ``old`` is now ``new``'s. Heard once ``new`` is known and ``old`` is not, before ``old`` is forgotten."""

    def model_forgotten(self, model: str) -> None:
        """The repository no longer knows the name ``model`` (its entry was dropped): nothing is kept for it.

        Not for an unload (the entry stays, in RepositoryIndex). A ``remove`` that forgot the name is heard
        after this, for a name the repository does not know.
        """


class ModelRepository:
    """All model folders of one server, and the loaded models among them.

    ``events`` hears of loads and reloads; ``models`` is handed to every
    model's context (how meta models call the others). ``on_state_change``
    is called (on the event loop, never awaited) after every change that can
    move :meth:`server_ready`: a state, or the models it counts.
    """

    def __init__(self, settings: Settings, manager: pluggy.PluginManager, scratch_dir: Path,
                 events: RepositoryEvents | None = None, models: ModelCaller | None = None,
                 on_state_change: Callable[[], None] | None = None) -> None:
        self.settings = settings
        self.events = events
        self.on_state_change = on_state_change
        self.models = models
        self.manager = manager
        self.scratch_dir = scratch_dir
        self.root = settings.server.ml_backends_path
        self._client_paths = ClientPaths(self.root, scratch_dir, settings.source)
        self._loader = VersionLoader(manager, scratch_dir, models, settings.server.model_load_threads)
        self._entries: dict[str, ModelEntry] = {}
        self._dependents = DependentStates()
        self._scan_errors = RateLimitedLog(log)
        # The listing's last failure, said once until it changes or a listing answers: RepositoryIndex lists again
        # at each call, and an ml_backends_path that can be searched but not listed (mode 711, a hardening whose
        # models all serve) logged an ERROR at each, ten every 10 s under a polling sidecar (the deploy hunt).
        self._last_scan_error: str | None = None
        # Work that outlives the call that started it: old versions draining after a reload, removals. Awaited
        # by unload_all; the versions draining are also ended by terminate_running.
        self._background: set[asyncio.Task] = set()
        self._retiring: dict[int, RetiringVersion] = {}  # by id() of its LoadedVersion
        self._terminated: set[int] = set()  # id() of the backends the shutdown's terminate_running asked
        self._removing: dict[str, asyncio.Task] = {}  # the latest removal of each name, draining in the background
        # The loads and unloads clients asked for, still running (see accepted): a stop abandons them (unload_all).
        self._accepted: set[asyncio.Task] = set()
        self._accepted_loads: set[asyncio.Task] = set()  # of those, the loads (see abandon_loads)
        self._cleanup = FolderCleanup(scratch_dir, self._scratch_kept, self._known_names, self.in_background)
        # Whether a watcher loads folders that appear from now on (dynamic mode, once it knows the folders
        # there at start: those are not loaded unless listed, exactly as without it).
        self._watched = False
        # Models the server is expected to keep ready: ServerReady looks at these.
        # Start-up models count from the first moment, so the server never
        # reports ready before they have loaded.
        self._exposed: set[str] = set()
        # Names a client unloaded while the store could not be listed, before they had an entry: neither the
        # listing that answers at last nor the watcher loads them, until a client loads them (a bug hunt).
        self._declined: set[str] = set()
        # The listing RepositoryIndex calls share while it runs, and the one they share next (see refresh's join).
        self._shared_refresh: asyncio.Future[StorageError | None] | None = None
        self._next_refresh: asyncio.Future[StorageError | None] | None = None
        self._settings_checked: Settings | None = None  # the last settings check_settings passed (and logged)
        # Models whose load or reload an edit of nereid.yaml left to the watcher, their folders changing (see
        # start_settings): "load" or "reload", until the watcher acts on the folder, or takes the step back.
        self._deferred_steps: dict[str, str] = {}
        # Of those, the ones the watcher loads by itself (a folder dropped in, a model an edit of nereid.yaml
        # lists), which ServerReady counts only once they serve: see load's ``counted``.
        self._counted_once_ready: set[str] = set()
        # A store that could not be listed at start with no models: key (and no watcher, which loads the folders
        # it finds later): ServerReady is false until a listing has answered, and the folders it finds then load
        # as at start (see list_until_answered). The store's error meanwhile.
        self._startup_listing: StorageError | None = None
        self._listed = asyncio.Event()  # set once a listing has answered after the failed one at start
        self._found_late: list[str] = []  # the folders that listing found, to be loaded as at start
        scan = self._scan()
        self._apply_scan(scan)
        unlisted_store = (scan.error is not None and settings.server.ml_backends_url is not None
                          and not settings.models_listed)
        if unlisted_store and not settings.server.watch:
            self._startup_listing = scan.error
        # The same under a watcher, whose first listing loads the folders as at start (see store_listed_at_last):
        # ServerReady is false until then, where it was true serving nothing.
        self._awaiting_watch_listing = unlisted_store and settings.server.watch
        self._exposed.update(self.startup_models())
        for name in self._exposed:
            self._entries[name].state, self._entries[name].reason = ModelState.LOADING, "waiting to load"

    def watch_started(self) -> None:
        """A watcher has taken note of the folders there now and loads every folder added from here on.

        Folders found before keep "not listed": nothing loads them by itself.
        """
        self._watched = True

    def declined(self, name: str) -> bool:
        """Whether a client unloaded ``name`` while the store could not be listed (it had no entry then), and has
        not loaded it since: a folder of that name found later is not loaded by itself."""
        return name in self._declined

    def wanted(self, name: str) -> bool:
        """Whether the server means to serve ``name``: loaded or loading, or asked for (listed, loaded at start,
        dropped in under a watch, RepositoryModelLoad) and neither unloaded nor unlisted since, e.g. one whose
        last load failed. A folder unlisted at start or unloaded is not: an edit of its files loads nothing.
        """
        entry = self._entries.get(name)
        if entry is None:  # (asked for while the store's listing failed: no entry yet, wanted all the same)
            return name in self._exposed and self.settings.server.ml_backends_url is not None
        return (entry.loaded is not None or entry.holders > 0 or name in self._exposed
                or (entry.awaiting_folder and self.settings.model(name) is not None))

    def generation(self, name: str) -> int:
        """How many versions of ``name`` have loaded so far (0 for a name not known)."""
        entry = self._entries.get(name)
        return entry.generation if entry is not None else 0

    def forget_failed_reload(self, name: str) -> None:
        """The folder of ``name`` (and its settings) are again what its running version loaded: the reason a
        reload of others failed for (shown READY in RepositoryIndex) is no longer true, and goes."""
        entry = self._entries.get(name)
        if entry is not None and entry.state is ModelState.READY and entry.loaded is not None:
            entry.reason = ""

    def loaded_stamp(self, name: str) -> object:
        """The watcher's stamp of the files the running version of ``name`` loaded from (None: not known)."""
        entry = self._entries.get(name)
        return entry.loaded.stamp if entry is not None and entry.loaded is not None else None

    def in_background(self, work: Coroutine[object, object, object], what: str) -> asyncio.Task:
        """Run ``work`` as a task of its own, awaited by :meth:`unload_all` (a failure is logged)."""
        task = asyncio.get_running_loop().create_task(work, name=f"nereid: {what}")
        self._background.add(task)

        def done(task: asyncio.Task) -> None:
            self._background.discard(task)
            if not task.cancelled() and task.exception() is not None:
                log.error("%s failed: %s", what, describe_exception(task.exception()))
        task.add_done_callback(done)
        return task

    def accepted(self, work: Coroutine[object, object, T], what: str, load: bool = False) -> asyncio.Task[T]:
        """Run a load or unload a client asked for (``work``; ``load``: a load) as a task of the repository's own,
        which the client awaits through :func:`asyncio.shield`: it runs to its end whatever the client does (its
        deadline passing, its cancel), as Triton finishes an operation it has accepted. A server stop abandons
        the loads still running as it begins (see :meth:`abandon_loads`), and the rest at its end (see
        :meth:`unload_all`)."""
        task = asyncio.get_running_loop().create_task(work, name=f"nereid: {what}")
        self._accepted.add(task)
        task.add_done_callback(self._accepted.discard)
        if load:
            self._accepted_loads.add(task)
            task.add_done_callback(self._accepted_loads.discard)
        return task

    def abandon_loads(self) -> None:
        """Abandon the loads clients asked for that still run: a server stop begins. Their clients are answered
        at once (UNAVAILABLE, see the data plane), where the drain waited for each, a backend's load() taking
        minutes or never returning, and the client was then told its model had loaded, on a server stopping."""
        for task in list(self._accepted_loads):
            task.cancel()

    def remove_in_background(self, name: str) -> asyncio.Task:
        """:meth:`remove` as background work (after any removal of ``name`` still going): nothing waits for
        the model's requests to finish. The task ends once the model is taken off the name (a load or rename
        in progress on it finishes first); its old version then finishes its requests as background work of
        its own, while the name is free for a new folder. :meth:`removal_of` finds the task until it is done."""
        previous = self._removing.get(name)

        async def remove() -> None:
            if previous is not None:
                await asyncio.wait({previous})
            await self._start_removal(name)
        task = self.in_background(remove(), f"removal of '{name}'")
        self._removing[name] = task
        task.add_done_callback(lambda done: self._removing.pop(name) if self._removing.get(name) is done else None)
        return task

    def removal_of(self, name: str) -> asyncio.Task | None:
        """The removal of ``name`` not yet done taking its model off the name, if any (a load of a folder put
        under that name comes after it). Its old version may drain longer: that holds up nothing."""
        return self._removing.get(name)

    def versions(self) -> list[tuple[str, LoadedVersion]]:
        """Every version held, each once, with the name it serves or served under: the serving ones first, then
        the old ones still finishing their requests (a reload's, an unload's, a removal's: a name whose folder
        is gone keeps its version until it is released). Safe to call from another thread (the metrics scrape).
        """
        held = {id(loaded): (entry.name, loaded) for entry in self.entries() if (loaded := entry.loaded) is not None}
        for retiring in list(self._retiring.values()):  # a copy: the event loop changes it meanwhile
            held.setdefault(id(retiring.loaded), (retiring.name, retiring.loaded))
        return list(held.values())

    def startup_models(self) -> list[str]:
        """The models to load at start: the listed ones, or every folder when none are listed."""
        if self.settings.models_listed:
            return [m.name for m in self.settings.models]
        return list(self._entries)

    def rescan(self) -> None:
        """Pick up folders added since the last scan, and forget the ones gone that nothing keeps.

        A removed folder keeps its entry while its model is loaded (it serves
        until unloaded) or an operation on it runs, and while nereid.yaml lists
        it (then it waits for its folder again). A model listed in nereid.yaml whose folder does not exist yet
        (allowed in dynamic mode) has an entry too, UNAVAILABLE until its
        folder lands. A store that cannot be listed forgets nothing. The
        cached copies of store folders the listing no longer has, and no entry
        keeps, are removed in the background (see :meth:`FolderCleanup.drop_mirrors_soon`).
        """
        self._apply_scan(self._scan())

    async def refresh(self, *, join: bool = False) -> StorageError | None:
        """:meth:`rescan`, with the listing (a directory, or a store's paged listing) off the event loop; returns
        why the folders could not be listed (None: they could).

        ``join``: share a listing with the other joining callers (RepositoryIndex's: a flood of them while a store
        hung ran one 30 s listing each, 16 at a time, and loads and the watcher's listings waited behind them; a
        bug hunt). Only one that starts after this call: a caller arriving while one runs shares the next,
        which starts once it ends, so a folder made before the call is always seen (a hunt of that fix found a
        joined listing that had begun earlier miss it). A load lists on its own.
        """
        if not join:
            return await asyncio.shield(asyncio.ensure_future(self._refresh_now()))
        if self._next_refresh is None:
            after = self._shared_refresh
            listing = asyncio.ensure_future(self._refresh_after(after))
            if after is None:
                self._shared_refresh = listing
            else:
                self._next_refresh = listing
            listing.add_done_callback(self._shared_refresh_done)
        else:
            listing = self._next_refresh
        return await asyncio.shield(listing)  # (a caller gone leaves the listing to finish and be applied)

    async def _refresh_after(self, running: asyncio.Future | None) -> StorageError | None:
        if running is not None:
            await asyncio.gather(running, return_exceptions=True)
            # Running now: callers arriving from here share the listing after this one.
            self._shared_refresh, self._next_refresh = self._next_refresh, None
        return await self._refresh_now()

    async def _refresh_now(self) -> StorageError | None:
        scan = await on_io_thread(self._scan)
        self._apply_scan(scan)
        return scan.error

    def _shared_refresh_done(self, done: asyncio.Future) -> None:
        if self._shared_refresh is done:
            self._shared_refresh = None
        if self._next_refresh is done:  # (ended before it ran: cancelled at a stop)
            self._next_refresh = None

    def _apply_scan(self, scan: RepositoryScan) -> None:
        present = scan.names
        known = set(self._entries)
        for name in present or ():  # a local folder or an object store
            self._folder_found(name)
        if present is not None and self._startup_listing is not None:
            self._listed_at_last(present)
        for settings in self.settings.models:
            if settings.name not in self._entries:
                self._entries[settings.name] = self._listed_entry(settings.name)
        if present is not None:
            self._forget_gone(set(present))
            # A name asked for while the store could not be listed (see load), which the store now answers it
            # does not hold: a typo, say; it must not wait, wanted, for a folder of that name for ever.
            self._exposed -= {name for name in self._exposed
                              if name not in self._entries and self.settings.model(name) is None}
        if self._entries.keys() - known and any(entry.loaded is not None and entry.loaded.depends_on
                                                for entry in self._entries.values()):
            # A model calling one that was no model of this server must now name what that one waits for.
            self._refresh_dependents()
        # Cached copies of store folders this server does not know (forgotten now, or before a restart): a server
        # fed versioned names must not keep one per name it ever served.
        self._cleanup.drop_mirrors_soon(self.settings.server, scan.leftovers)

    def _listed_entry(self, name: str) -> ModelEntry:
        """A new entry for ``name``, which nereid.yaml lists, whose folder is not there: UNAVAILABLE, waiting."""
        index, settings = next((i, s) for i, s in enumerate(self.settings.models) if s.name == name)
        return ModelEntry(name, self.root / name, settings, f"{self.settings.source}: models[{index}]",
                          reason=waiting_for_folder(name))

    def _listed_at_last(self, present: list[str]) -> None:
        """The store's listing has answered after the one at start failed (no models: key): every folder it
        found is a start-up model, counted by ServerReady from now on and waiting for its load (see
        :meth:`list_until_answered`), unless a client has loaded it or is loading it meanwhile."""
        self._startup_listing = None
        for name in present:
            entry = self._entries[name]
            if name in self._exposed or entry.loaded is not None or entry.holders:
                continue
            if name in self._declined:  # (its entry says "unloaded": see _folder_found)
                continue
            self._exposed.add(name)
            entry.state, entry.reason = ModelState.LOADING, "waiting to load"
            self._found_late.append(name)
        self._listed.set()
        self._state_changed()

    def store_listed_at_last(self, names: list[str]) -> None:
        """The watcher's first listing of a store that could not be listed at start: ``names`` load now as at
        start, counted by ServerReady at once (which was false until this listing, when nereid.yaml lists no
        models)."""
        names = [name for name in names if name not in self._declined]
        self._exposed.update(names)
        self._counted_once_ready.difference_update(names)
        for name in names:
            self._folder_found(name)  # (an entry now: ServerReady passes over a name that has none)
            entry = self._entries[name]
            if entry.loaded is None:
                entry.state, entry.reason = ModelState.LOADING, "waiting to load"
        self._awaiting_watch_listing = False
        self._state_changed()

    def waiting_for_listing(self) -> bool:
        """Whether the store could not be listed at start (no models: key, no watcher) and the folders a later
        listing finds are still to be loaded: see :meth:`list_until_answered`."""
        return self._startup_listing is not None or bool(self._found_late)

    async def list_until_answered(self) -> list[str]:
        """When the store could not be listed at start (no models: key, no watcher), list it again, ever less
        often (see :class:`~nereid.store_retries.StartupListing`), until it answers; returns the folders found
        then, for the server to load as at start ([] when the listing at start answered).

        Another call's listing (a RepositoryIndex, a load) that answers first ends the wait, and its folders are
        returned the same. Each try runs on a daemon thread of its own: a stop cancels this at once, and never
        waits for a listing the store is slow to answer.
        """
        failure = self._startup_listing
        if failure is not None:
            retry = StartupListing(str(self.settings.server.ml_backends_url), failure)
            while self._startup_listing is not None:
                try:
                    await asyncio.wait_for(self._listed.wait(), retry.delay_s)
                except asyncio.TimeoutError:
                    pass
                if self._startup_listing is None:
                    break
                try:
                    scan = await on_daemon_thread(functools.partial(self._scan, logged=False),
                                                  "nereid-store-listing")
                except Exception as err:  # not the store's (the local cache refusing a mirror folder): tried again
                    log.error("%s: listing the model folders failed: %s", self.settings.server.ml_backends_url,
                              describe_exception(err), exc_info=err)
                    retry.failed(err)
                    continue
                self._apply_scan(scan)
                if scan.error is not None and self._startup_listing is not None:
                    retry.failed(scan.error)
            tries = f" ({retry.tries} failed tr{'y' if retry.tries == 1 else 'ies'} since the start)"
        else:  # (answered first by a RepositoryIndex's or a load's listing, before this began)
            tries = ""
        # (Less any a client has unloaded since: an unload lists the store too, and may have been the one.)
        found = [name for name in self._found_late if name in self._exposed]
        self._found_late = []
        if failure is not None or found:
            log.info("%s: the model folders are listed at last%s; loading %s", self.settings.server.ml_backends_url,
                     tries, ", ".join(f"'{name}'" for name in found) or "nothing (no model folder there)")
        return found

    def _folder_found(self, name: str) -> None:
        """Give the folder ``name``, just seen, an entry unless it has one."""
        if name not in self._entries:
            server = self.settings.server
            # In dynamic mode the watcher loads every folder added once it has settled; say so rather than ask
            # for a load. Not for a folder there before it started watching: it never loads that one by itself.
            unlisted = ("unloaded" if name in self._declined  # (by a client, before the store could be listed)
                        else f"new folder: it loads once it has been unchanged for server.watch_settle_ms "
                        f"({server.watch_settle_ms:g} ms)" if server.watch and self._watched
                        # Nothing is listed in nereid.yaml: every folder loads once the store's listing answers.
                        else _WAITING_FOR_LISTING if self._startup_listing is not None
                        else not_listed_reason(self.settings.config_name) if self.settings.models_listed
                        else FOUND_AFTER_START_REASON)
            settings, origin = self.settings.model_or_default(name)
            self._entries[name] = ModelEntry(name, self.root / name, settings, origin, reason=unlisted)
        self._entries[name].folder_seen = True

    def _scan(self, logged: bool = True) -> RepositoryScan:
        """The model folders now (blocking); without names, with the error, when they cannot be listed (logged
        unless not ``logged``: the caller says it its own way)."""
        server = self.settings.server
        try:
            names = scan_model_folders(server)
        except StorageError as err:
            if logged and str(err) != self._last_scan_error:  # (rate-limited too: a client can make it change)
                self._scan_errors.error("%s", err)
            elif logged:
                log.debug("%s (again)", err)
            self._last_scan_error = str(err)
            return RepositoryScan(None, err)
        self._last_scan_error = None
        return RepositoryScan(names, leftovers=tuple(mirror_leftovers(server, names)))

    def _forget_gone(self, present: set[str]) -> None:
        """Drop the entries of folders that are gone, unless loaded or in use: ``events`` hears each is forgotten,
        and its scratch folders are removed in the background (a store folder's cached copy too: see
        :meth:`_apply_scan`).

        An entry nereid.yaml lists stays, waiting for its folder again as at
        start. Either way a model whose folder went while it was not loaded is
        no longer one the server must keep READY (ServerReady).
        """
        gone = [entry for entry in self.entries() if entry.name not in present and not entry.in_use()]
        changed = False
        scratch: set[str] = set()
        for entry in gone:
            if self.settings.model(entry.name) is None:
                self._entries.pop(entry.name, None)
                self._forgotten(entry.name)
                # The watcher's removal of the name, if any, finds no entry now: its scratch folders go here
                # (a failed load's too: a cpp build cache), or one would stay per name ever seen.
                scratch |= entry.scratch_names
            elif entry.folder_seen:
                entry.folder_seen = False
                entry.awaiting_folder = entry.name in self._exposed
                entry.state, entry.reason = ModelState.UNAVAILABLE, waiting_for_folder(entry.name)
            else:
                continue  # listed, its folder never seen yet: it still waits for it, as it did at start
            self._exposed.discard(entry.name)
            changed = True
        if scratch:
            self._cleanup.drop_scratch_soon(scratch)
        if changed:
            self._refresh_dependents()

    def _forgotten(self, name: str) -> None:
        """Tell ``events`` (and the store's kept listing) that ``name`` has no entry any more (dropped for good,
        not replaced)."""
        if name in self._entries:
            return
        forget_listed_folder(self.settings.server, name)
        if self.events is not None:
            self.events.model_forgotten(name)
        self._retry_cycles_through(name)

    def entries(self) -> list[ModelEntry]:
        """Every known model folder, by name."""
        entries = dict(self._entries)  # a copy: the metrics thread reads this too
        return [entries[name] for name in sorted(entries)]

    def entry(self, name: str) -> ModelEntry:
        """The entry for ``name``; NotFound when no such folder exists."""
        entry = self._entries.get(name)
        if entry is None and is_model_folder_name(name) and model_folder_exists(self.settings.server, name):
            # One stat, or a store's last listing (refreshed off the loop, at most every 5 s), and a full
            # rescan only when the folder is really there: a flood of made-up names must not list the
            # repository per request on the loop.
            if self.settings.server.ml_backends_url is None:
                self.rescan()  # a local directory listing
            else:
                self._folder_found(name)  # the store was just listed: listing it here would stall the loop
            entry = self._entries.get(name)
        if entry is None:
            raise _no_folder(name, self._entries)
        return entry

    def ready_model(self, name: str) -> LoadedVersion:
        """The loaded model behind ``name``; NotFound or Unavailable with the reason otherwise."""
        # Through entry(): an unknown name gets the same NotFound as every other call's (statistics, a version).
        entry = self.entry(name)
        if entry.state is not ModelState.READY or entry.loaded is None:
            detail = f": {entry.reason}" if entry.reason else ""
            raise Unavailable(f"model '{name}' is not ready ({entry.state.value}{detail})")
        return entry.loaded

    def knows(self, name: str) -> bool:
        """Whether ``name`` has an entry now; a dict lookup, never a stat or a listing (unlike :meth:`entry`,
        which gives a folder just found an entry: asked about a name just forgotten, it could bring it back)."""
        return name in self._entries

    def serving(self, name: str) -> LoadedVersion | None:
        """The loaded model behind ``name`` if it is READY, else None; a dict lookup, as :meth:`knows`."""
        entry = self._entries.get(name)
        if entry is None or entry.state is not ModelState.READY:
            return None
        return entry.loaded

    def loaded_version(self, name: str) -> LoadedVersion | None:
        """The version of ``name`` loaded now, READY or not (a model waiting for those it calls); a dict lookup."""
        entry = self._entries.get(name)
        return entry.loaded if entry is not None else None

    @property
    def releases_waiting_turns(self) -> int:
        """Releases of retired versions (unloads, reloads' old versions, removals) waiting for their turn: at most
        ``server.model_load_threads`` run at once (see :class:`~nereid.version_loader.UnloadTurns`)."""
        return self._loader.unload_turns.waiting

    def release_without_turns(self) -> None:
        """From now on every release of a version goes at once, those waiting for a turn too: the server stops, and
        its drain must not wait turns behind releases that hang (quick unloads waited out the grace, answered
        UNAVAILABLE; the review hunt)."""
        self._loader.unload_turns.open()

    def loading(self) -> bool:
        """True while some model is LOADING."""
        return any(entry.state is ModelState.LOADING for entry in self.entries())

    def server_ready(self) -> bool:
        """True when every exposed model is READY (Triton's strict readiness; one the watcher loaded by itself
        counts once it has served), and, for a store that could not be listed at start with no models: key, once
        it has been (it would otherwise be ready serving nothing)."""
        return (self._startup_listing is None and not self._awaiting_watch_listing
                and all(self._entries[name].state is ModelState.READY
                        for name in self._exposed - self._counted_once_ready if name in self._entries))

    def holding_readiness(self) -> list[tuple[str, str]]:
        """The models that keep :meth:`server_ready` false, with their states (sorted by name)."""
        return sorted((name, self._entries[name].state.value) for name in self._exposed - self._counted_once_ready
                      if name in self._entries and self._entries[name].state is not ModelState.READY)

    async def load(self, name: str, *, retrying: str | None = None, requested: bool = False,
                   counted: bool = True) -> ModelEntry:
        """Load a model folder, or a loaded one again (see :meth:`reload`). A failure to load leaves it
        UNAVAILABLE with the reason; never raises for it. A name with no folder is NotFound; one that a store
        that cannot be listed may hold is Unavailable, with the store's reason.

        ``requested``: a client's RepositoryModelLoad. A model nereid.yaml lists whose folder is missing is then
        NotFound too, its entry left as it is (its old version may still be finishing its requests); loaded at
        start (dynamic mode), it waits UNAVAILABLE for its folder instead.

        ``retrying``: this load tries again after the store failed the last one, for a reason of this
        :func:`~nereid.storage.failure_kind`. Failing for that reason again is no news, and is logged at DEBUG,
        not ERROR: a store down for hours, or a key the local disk cannot hold, fails every try the same way.

        ``counted``: ServerReady counts the model from this load on (a start-up model's, a client's). False, for
        what the watcher loads by itself (a folder dropped in, a model an edit of nereid.yaml lists): only once
        it is READY, so that a broken folder copied into a serving repository, or a model loading for a
        minute, does not take the server out of its load balancer. A model counted already stays counted.
        """
        looked_up = False  # a store's listing has just found this very name: not asked about it again
        if requested:
            self._declined.discard(name)  # asked for again
        if name not in self._entries and is_model_folder_name(name):
            # Look again now (off the loop): a store's listing is otherwise reused for a few seconds,
            # and a model just uploaded must load.
            failure = await self.refresh()
            looked_up = name in self._entries
            if name not in self._entries and self.settings.server.ml_backends_url is not None:
                # A listing of every folder can miss one (a listing page the store client drops for an
                # unreadable key): asked for by name, it is looked for by name. Not when the store could not be
                # reached at all: a store that hangs then held the load for two timeouts (60 s; a bug hunt).
                try:
                    held = (failure is None or not store_unreachable(failure)) and \
                        await on_io_thread(store_holds_folder, self.settings.server, name)
                except StorageError as err:
                    held, failure = False, failure or err
                if held:
                    self._folder_found(name)
                    looked_up = True
                elif failure is not None:
                    # The store did not answer: the folder may well be there. NOT_FOUND would send the client
                    # looking for a typo while the reason (credentials, endpoint) is only in the server's log.
                    # Asked for all the same, where something tries it again: the watcher's retry knows it is
                    # wanted (until an unload says otherwise). Without a watcher the client loads it again.
                    if self.settings.server.watch:
                        self._exposed.add(name)
                    raise _store_cannot_tell(name, failure) from failure
        entry = self.entry(name)
        entry.clear_refusal()  # (this load's own outcome from here on)
        missing = await self._folder_missing(entry, requested and not looked_up)
        if entry.loaded is None and missing and self.settings.model(name) is None:
            # Nothing keeps the name: its folder is gone, and at most its old model still finishes its requests
            # (a removal draining). The answer for a name that never had a folder.
            raise _no_folder(name)
        if requested and entry.loaded is None and missing:
            # Listed, but nothing to load from: the client's mistake, not the model's fault ("failed to load",
            # INTERNAL); and a version still draining keeps showing UNLOADING.
            raise _listed_without_folder(name, self.settings.server.watch, self.settings.config_name)
        if counted:
            self._counted_once_ready.discard(name)
        elif name not in self._exposed:
            self._counted_once_ready.add(name)
        self._exposed.add(name)
        entry.awaiting_folder = False  # (asked for again: counted as any other)
        if entry.loaded is not None:
            # (Not while another operation holds it, a removal under way say: this load waits for it, then
            # answers for the name as it is then.)
            if missing and not entry.holders and self.removal_of(name) is None:
                # Nothing to load from: the client's mistake, not a fault of the model's ("failed to load",
                # INTERNAL, said the folder went "while it was being loaded").
                serves = ("until the watcher unloads it" if self.settings.server.watch
                          else "on (nothing follows the folder without server.watch)")
                raise NotFound(PublicText(f"model '{name}': its folder '{name}' is gone from ml_backends_path, "
                                          f"so it cannot be loaded again; the version loaded before serves {serves}"))
            # Loaded already: loaded again without downtime, as Triton does. The running version serves until
            # the new one is READY, and keeps serving if the new one fails (the reason shows in the index).
            await self.reload(name, retrying=retrying, requested=requested)
            if entry.loaded is not None and self._entries.get(name) is entry:
                return entry
            # Unloaded or forgotten while the reload waited for it (its folder removed, renamed onto): this
            # load comes after that, so it looks again, as a load of the name as it is now (still the client's:
            # a folder gone meanwhile is NOT_FOUND, not "failed to load ...: waiting for its folder").
            return await self.load(name, retrying=retrying, requested=requested)
        self._state_changed()  # counted from now on: ServerReady is false until it is READY
        async with entry.held():
            if entry.loaded is None:
                # (READY: counted from now on, see _state_changed)
                await self._load_locked(entry, retrying, requested)
                return entry
            if await self._loaded_as_now(entry):  # loaded meanwhile, by a load that held the model first
                return entry
        # Loaded meanwhile, but from other files or settings than the folder's and nereid.yaml's now (a load
        # started before an edit): loaded again, as asked.
        return await self.reload(name, retrying=retrying, requested=requested)

    async def _folder_missing(self, entry: ModelEntry, requested: bool) -> bool:
        """Whether ``entry``'s folder is not there to load from: locally, no folder; in a store, for a client's
        load (``requested``), the store answered and holds nothing under its prefix.

        A store that cannot be listed cannot tell (False: the load goes on and reports the store's failure). A
        load nobody asked for (at start, nereid.yaml's, the watcher's) is left to its fetch, whose failure is the
        model's reason in RepositoryIndex; a client's is answered NOT_FOUND, as for a local folder (it was
        INTERNAL "failed to load ...: no such model folder (no objects under it)").
        """
        if self.settings.server.ml_backends_url is None:
            return folder_gone(entry.folder)
        if not requested:
            return False
        try:
            return not await on_io_thread(store_holds_folder, self.settings.server, entry.name)
        except StorageError:
            return False

    async def _loaded_as_now(self, entry: ModelEntry) -> bool:
        """Whether the running version was built with the entry's settings as they are now and, where the files
        were stamped (a local folder), from the folder's files as they are now."""
        loaded = entry.loaded
        if (loaded is None or not same_values(loaded.settings, entry.settings)
                or self._defaults_change_options(entry, self.settings)):
            return False
        if loaded.stamp is None or self.settings.server.ml_backends_url is not None:
            # Files not stamped, or a bucket's (their state is the watcher's, not known here): loaded again, as
            # asked. A client's load that waited behind another was answered OK with the objects the first had
            # fetched, though they were replaced before it asked (the hunt of the fixes).
            return False
        stamped = await on_work_thread(folder_stamp, entry.folder)
        return stamped is not None and stamped[0] == loaded.stamp

    def _defaults_change_options(self, entry: ModelEntry, settings: Settings) -> bool:
        """Whether ``entry``'s running version would load with other options under the ``backends:`` defaults of
        ``settings`` than under those it was loaded with, its own settings as ``settings`` give them: its
        backend's to say (see :func:`~nereid.plugins.options_change`)."""
        loaded = entry.loaded
        assert loaded is not None
        own, origin = settings.model_or_default(entry.name)
        asked = OptionsAsked(loaded.backend_name, entry.name, entry.folder, own.runtime, origin, settings.source)
        return options_change(self.manager, asked, loaded.backend_defaults,  # type: ignore[arg-type]
                              settings.backend_defaults.get(loaded.backend_name))

    async def _load_locked(self, entry: ModelEntry, retrying: str | None, requested: bool = False) -> ModelEntry:
        """The load of :meth:`load`, the entry held and not loaded; ``requested``: a client's."""
        name = entry.name
        # (A folder in an object store is fetched by the version loader, which reports the store's error.)
        if self.settings.server.ml_backends_url is None and folder_gone(entry.folder):
            if entry.draining:  # its old version still finishes its requests: UNLOADING says so until then
                return entry
            entry.state, entry.reason = ModelState.UNAVAILABLE, waiting_for_folder(name)
            log.warning("model '%s' is UNAVAILABLE: %s", name, entry.reason)
            self._refresh_dependents()
            return entry
        # What it failed for last, if it did: a client's load failing so again (one asking to load a broken folder
        # over and over) is no news, and is logged at DEBUG, not ERROR (the log hunt: each RepositoryModelLoad an
        # ERROR). An edit's reload says its failure again: the edit may have been meant to fix it.
        failed_before = entry.reason if requested and entry.state is ModelState.UNAVAILABLE else None
        entry.state, entry.reason = ModelState.LOADING, ""
        self._refresh_dependents()
        try:
            entry.loaded = await self._loader.load(entry, ModelStats(), self.settings)
        except Exception as err:  # any load failure is the model's, reported with its reason
            reason = _reason(err)
            repeated = _repeats(reason, retrying) or (failed_before is not None and
                                                      self.public_text(reason) == failed_before)
            # (The log keeps absolute paths.) An abandoned load is what its unload asked for: no fault.
            abandoned = isinstance(err, LoadAbandoned)
            level = logging.WARNING if abandoned else logging.ERROR
            moved = not abandoned and self.settings.server.ml_backends_url is None and folder_gone(entry.folder)
            if moved:
                # Moved (or deleted) while its backend read it, a folder renamed during its first load: that is
                # the reason, not the file the backend then missed, and no fault to log at ERROR (the soak hunt:
                # "missing manifest.yaml" of a bundle only renamed).
                reason = gone_while_loading(entry.folder)
                level = logging.WARNING
            log.log(logging.DEBUG if repeated else level, "model '%s' is UNAVAILABLE: %s", name, reason,
                    exc_info=None if moved else _plugin_traceback(err))
            entry.state, entry.reason = ModelState.UNAVAILABLE, self.public_text(reason)
            entry.abandoned = entry.reason if abandoned else ""
            entry.store_fault = reason if store_failed(err) else ""
            entry.cycle_through = _cycle_through(err, name)
            # The models calling it wait again (they waited on it LOADING meanwhile): no news either then.
            self._refresh_dependents(repeated=repeated)
            return entry
        except asyncio.CancelledError:
            # Only a stop cancels a load: a client's is run apart from its call (see accepted).
            entry.state, entry.reason = ModelState.UNAVAILABLE, "load abandoned (the server is stopping)"
            raise
        entry.store_fault = ""
        self._heard_loaded(name, entry.loaded)
        self._enter_loaded_version(entry)
        return entry

    async def reload(self, name: str, *, retrying: str | None = None, only_if_changed: bool = False,
                     requested: bool = False) -> ModelEntry:
        """Load the folder again without downtime; a model that is not loaded is simply loaded.

        The running version serves until the new one is READY, then requests
        switch over and the old one drains and unloads, in the background: the
        call returns once the new version serves (a model with long requests
        holds up nothing else). If the new version fails, the running one keeps
        serving and the reason shows in RepositoryIndex (the state stays READY)
        and in the log. ``retrying``: as for :meth:`load`. ``only_if_changed``:
        nothing is done when, once its turn comes, the running version has the
        folder's files and the settings as they are then (a change already
        loaded by a reload before it). ``requested``: a client's, whose failure
        for the reason the last one failed for is no news (logged at DEBUG).
        """
        entry = self._entries.get(name)
        if entry is None or entry.loaded is None:
            # (Which looks for a folder it does not know yet.) Counted by ServerReady as it was: a start-up model
            # at once, one the watcher found once it serves (see load's counted).
            return await self.load(name, retrying=retrying, counted=False)
        async with entry.held():
            old = entry.loaded
            if old is None:  # unloaded while we waited for the lock
                return entry
            if only_if_changed and await self._loaded_as_now(entry):
                log.info("model '%s' is loaded already as its folder and settings are now", name)
                self.forget_failed_reload(name)  # (of files or settings that are no longer so)
                return entry
            entry.clear_refusal()
            failed_before = entry.reason if requested else None  # (see _load_locked)
            try:
                new = await self._loader.load(entry, old.stats, self.settings)
            except LoadAbandoned as err:
                # The unload that gave up on it takes the running version off next: none "keeps serving", and
                # no reload failed.
                log.warning("model '%s': reload abandoned: %s", name, err)
                entry.reason = entry.abandoned = self.public_text(_reason(err))
                return entry
            except Exception as err:
                reason = _reason(err)
                # As a first load's: moved (a swap by rename) while its backend read it is the reason, at WARNING,
                # not the file the backend then missed, at ERROR (the dynamic-repository hunt).
                moved = self.settings.server.ml_backends_url is None and folder_gone(entry.folder)
                if moved:
                    reason = gone_while_loading(entry.folder)
                # (The running version's number: "(load N+1)" here was the number the next reload that succeeds
                # is logged READY with.)
                # (Not "version N": the protocol's model version is always 1; N counts loads.)
                failure = self.public_text(f"reload failed, the running version keeps serving: {reason}")
                repeated = _repeats(reason, retrying) or failure == failed_before
                log.log(logging.DEBUG if repeated else logging.WARNING if moved else logging.ERROR,
                        "model '%s': reload failed, the running version (load %d) keeps serving: %s", name,
                        entry.generation, reason,
                        exc_info=None if moved else _plugin_traceback(err))
                entry.reason = failure
                entry.store_fault = reason if store_failed(err) else ""
                entry.cycle_through = _cycle_through(err, name)
                self._record(name, "reload_failed")
                return entry
            entry.store_fault = ""
            blocked = self._kept_from_serving(entry, new)
            if blocked is not None:
                # As any failed reload: the running version serves on (Triton keeps an ensemble whose new
                # version misses a model it calls). Swapped in, it would have taken down every caller with it.
                await discard_version(name, new)
                entry.generation -= 1  # (that version never served: versions count what served, as the metric says)
                log.error("model '%s': reload failed, the running version (load %d) keeps serving: %s", name,
                          entry.generation, blocked)
                entry.reason = self.public_text(f"reload failed, the running version keeps serving: {blocked}")
                entry.kept_calling = new.depends_on
                self._record(name, "reload_failed")
                return entry
            entry.loaded = new
            self._heard_loaded(name, new)
            self._enter_loaded_version(entry)  # the new version may call other models
            self._record(name, "reload")
        self.in_background(self._retire(self._retiring_version(name, old, entry), self._replaced_version_grace(old),
                                        successor=new),
                           f"model '{name}': unloading the version load {entry.generation} replaced")
        return entry

    async def rename(self, old: str, new: str) -> bool:
        """Move a loaded model to a renamed folder with the same files, keeping everything it loaded. Returns
        whether it was moved in place (False: the new folder was loaded anew, whatever that load's outcome).

        The old name answers NOT_FOUND at once (UNAVAILABLE, waiting for its
        folder, when nereid.yaml lists it); requests already running under
        it finish. When the backend cannot move (or the new name has other
        settings in nereid.yaml, or a model of its own, loaded or loading), the
        new folder is loaded anew (a loaded model there is reloaded without
        downtime) and the old model unloaded.
        """
        entry = self._entries.get(old)
        settings, origin = self.settings.model_or_default(new)
        loaded = entry.loaded if entry is not None else None
        if (entry is None or loaded is None or not same_values(settings, replace(entry.settings, name=new))
                or self._taken(new, entry)):
            self.remove_in_background(old)  # the old model finishes its requests meanwhile
            await self.load(new, counted=False)
            return False
        async with entry.held():
            # (Looked at again under the lock: an unload, reload or move that ran while this waited for it left
            # another version serving, or none: the retired one was moved, or an unloaded one given a folder
            # descriptor that no unload closes; the read hunt.)
            moved = (entry.loaded is loaded and self._entries.get(old) is entry
                     and await self._moved_in_place(entry, loaded, old, new, settings, origin))
        if not moved:
            self.remove_in_background(old)  # the new folder loads at once; the old model finishes its requests
            await self.load(new, counted=False)
        return moved

    async def _moved_in_place(self, entry: ModelEntry, loaded: LoadedVersion, old: str, new: str,
                              settings: ModelSettings, origin: str) -> bool:
        """Move ``entry``'s serving version ``loaded`` from ``old`` to ``new`` (see :meth:`rename`), its lock held;
        whether it moved (False: the backend could not, or the new name was taken meanwhile)."""
        # Claimed before the move (which waits on a thread): a removal finishing meanwhile must not delete
        # the scratch folder the moved model is given.
        claimed = new not in entry.scratch_names
        entry.scratch_names.add(new)
        context = ModelContext(new, self.root / new, settings, self._loader.scratch_for(new), origin, self.models,
                               runs_dir=self._loader.runs_dir, config_name=self.settings.config_name)
        try:
            if not isinstance(loaded.backend, Relocatable):
                raise ConfigError(f"backend '{loaded.backend_name}' cannot move a loaded model")
            # Plugin code: a sys.exit() or KeyboardInterrupt of its own is its failure (the move is not made),
            # never the server's end (it ended the server, exit status the plugin's, nothing logged).
            await on_work_thread(calling_plugin,
                                 functools.partial(loop_safe_call, loaded.backend.relocate, context),
                                 lambda exit_: backend_exit(old, exit_, "while moving it"))
            # (Looked at again after each wait: a request may have loaded the new name meanwhile, whose model
            # this one must not replace unseen: it would never be unloaded.)
            if self._taken(new, entry):
                raise ConfigError(f"'{new}' has a model of its own, loaded or loading")
        except Exception as err:
            # (A plugin's own exception is named with its type and the backend: its bare message named neither;
            # the plugin hunt.)
            why = _reason(err) if isinstance(err, NereidError) else \
                f"relocate() of backend '{loaded.backend_name}' raised {describe_exception(err, one_line=True)}"
            # A backend that never moves models (meta) is loaded anew as it always is: no news, not a WARNING
            # at every rename (the races hunt). A move tried and failed is.
            level = logging.WARNING if isinstance(loaded.backend, Relocatable) else logging.INFO
            log.log(level, "model '%s': cannot be renamed in place (%s); loading '%s' anew", old,
                    cap_message(why), new)
            moved = False
        else:
            moved = True
        if not moved and claimed:
            entry.scratch_names.discard(new)
        if moved:
            if entry.reason.endswith(self.public_text(gone_while_loading(entry.folder))):
                # A reload that failed as this very move took its folder: the version moved has what the folder
                # holds (or the watcher reloads it next), and that reason named a folder there is no more.
                entry.reason = ""
            del self._entries[old]
            entry.name, entry.folder, entry.settings, entry.settings_origin = new, context.folder, settings, origin
            loaded.settings = settings  # (moved in place only with the same settings, its name apart)
            self._entries[new] = entry  # replaces an entry a rescan may have made for the new folder
            if self.events is not None:  # its loads, requests and events follow it, as its version does
                self.events.model_renamed(old, new)
            self._forgotten(old)  # (nothing is left under the old name: the model's figures are the new one's)
            exposed = old in self._exposed
            if exposed:
                self._exposed.discard(old)
                self._exposed.add(new)
                if old in self._counted_once_ready:
                    self._counted_once_ready.discard(old)
                    self._counted_once_ready.add(new)
            if self.settings.model(old) is not None:
                # Listed in nereid.yaml: it waits for its folder, as a listed model whose folder was removed
                # (it answered NOT_FOUND, "no folder", and left the counts of ServerReady and /metrics).
                self._entries[old] = self._listed_entry(old)
                self._entries[old].awaiting_folder = exposed
            loaded.scheduler.name = new
            self._record(new, "rename")
            self._refresh_dependents()  # models calling the old name wait for it again
            log.info("model '%s' renamed to '%s' in place (load %d, nothing reloaded)", old, new,
                     entry.generation)
            self._cleanup.drop_empty_scratch(old)  # left empty by the move: nothing kept there
        return moved

    def _taken(self, name: str, moving: ModelEntry) -> bool:
        """Whether ``name`` has a model of its own that a model ``moving`` there would replace: loaded, or a load
        holding (or awaiting) its lock. A draining removal's versions are not in the way (they finish apart)."""
        target = self._entries.get(name)
        return target is not None and target is not moving and (target.loaded is not None or target.holders > 0)

    async def remove(self, name: str) -> None:
        """A folder that is gone: unload its model once its requests have finished, then forget it.

        The model is taken off the name at once (after a load or rename of it
        in progress): it is UNLOADING while it finishes its requests, and a
        new folder put under the name meanwhile loads and serves at once, as
        a reload's new version does. The removal is counted even when a rescan
        forgot the entry first (its model was not loaded).
        """
        await (await self._start_removal(name))

    async def _start_removal(self, name: str) -> asyncio.Task:
        """Take the removed folder's model off its name (see :meth:`_take_removed`); the rest of the removal
        runs as background work, whose task is returned."""
        return self.in_background(await self._take_removed(name), f"removal of '{name}': finishing its requests")

    async def _take_removed(self, name: str) -> Coroutine[object, object, None]:
        """Take the removed folder's model off its entry, once no load or rename of it runs; returns the rest
        of the removal (its old version draining, then the entry forgotten), to be run as background work."""
        entry = self._entries.get(name)
        if entry is None:
            return self._finish_removal(name, None, None)
        self._exposed.discard(name)
        self._state_changed()  # no longer counted, even while it waits for a load to finish
        async with entry.held_for_unload():
            self._exposed.discard(name)  # (asked for again while it waited: its folder is gone all the same)
            retiring = None
            if entry.loaded is not None:
                retiring = self._retiring_version(name, entry.loaded, entry)
                entry.loaded = None
                entry.draining += 1
                entry.state, entry.reason = ModelState.UNLOADING, ""
                self._refresh_dependents()  # a model being unloaded takes no new requests: its callers stop too
        return self._finish_removal(name, entry, retiring)

    async def _finish_removal(self, name: str, entry: ModelEntry | None, retiring: RetiringVersion | None) -> None:
        """Let the removed model finish its requests and release it, then forget its entry unless its folder
        is back, or something else uses it now (a new version loaded, a load under way)."""
        if entry is not None and retiring is not None:
            try:
                await self._retire(retiring)
            finally:
                entry.draining -= 1
            log.info("model '%s' unloaded", name)
            if entry.loaded is None and entry.state is ModelState.UNLOADING and not entry.draining:
                entry.state, entry.reason = ModelState.UNAVAILABLE, "unloaded"
        if entry is not None:
            listed = self.settings.model(name) is not None
            if (self._entries.get(name) is entry and not entry.in_use() and await self._folder_gone(entry, listed)
                    and self._entries.get(name) is entry and not entry.in_use()):  # (again: that was a wait)
                if listed:
                    # Listed in nereid.yaml: it waits for its folder, as at start (forgotten, it answered NOT_FOUND
                    # and its callers said it was no model of this server, until a listing made it anew).
                    entry.folder_seen = False
                    entry.awaiting_folder = name in self._exposed
                    self._exposed.discard(name)
                    entry.state, entry.reason = ModelState.UNAVAILABLE, waiting_for_folder(name)
                else:
                    self._entries.pop(name)
                    self._forgotten(name)  # before the removal is recorded: that one then names no forgotten model
                    self._cleanup.drop_mirrors_soon(self.settings.server, [name])
            self._refresh_dependents()
            if self._entries.get(name) is not entry:  # forgotten (or replaced by a model renamed onto the name)
                await self._cleanup.drop_scratch(entry.scratch_names)
        self._record(name, "remove")

    async def _folder_gone(self, entry: ModelEntry, emptied_counts: bool = False) -> bool:
        """Whether the entry's folder is gone: locally, no folder (or, with ``emptied_counts``, one holding no file
        but ignored ones, as the watcher takes it: a listed model then says it waits for its folder, where it said
        `unloaded`, as if it could load); in a store, no object under its prefix (a store that cannot be listed
        cannot tell: False, and a later listing forgets it).

        A store folder's cached copy is no sign: it stays until the name is
        forgotten (see :meth:`FolderCleanup.drop_mirrors_soon`).
        """
        if self.settings.server.ml_backends_url is None:
            gone = folder_gone(entry.folder)
            if gone or not emptied_counts:
                return gone
            stamped = await on_io_thread(folder_stamp, entry.folder)
            return stamped is None or not stamped[0]
        try:
            return not await on_io_thread(store_holds_folder, self.settings.server, entry.name)
        except StorageError as err:
            log.info("model '%s': its folder's removal cannot be confirmed (%s); a later listing forgets it",
                     entry.name, err)
            return False

    async def apply_settings(self, settings: Settings) -> None:
        """Follow an edited nereid.yaml: reload changed entries, load added ones, unload removed ones."""
        await self.start_settings(settings)

    def check_settings(self, settings: Settings) -> None:
        """ConfigError when ``settings`` ask what only the plugins can refuse (defaults for a backend that is not
        installed); :meth:`start_settings` applies nothing of such settings. What they find short of that (a
        backend's own refusal of an option) is logged. Settings that passed are not checked again (the watcher
        checks them, then starts them: the same WARNING came twice, the hooks asked twice; the README walkthrough)."""
        if self._settings_checked is settings:
            return  # (checked already, and passed: the plugins' hooks are not asked twice)
        notes = check_backend_defaults(self.manager, settings.backend_defaults, settings.source)
        self._settings_checked = settings
        for note in notes:
            log.warning("%s", note)

    def start_settings(self, settings: Settings, settling: Container[str] = ()) -> Awaitable[None]:
        """:meth:`apply_settings`, started: the settings are in force on return, and their loads, reloads and
        unloads run in tasks of their own; what is returned ends once they have ended.

        ``settling``: the folders the watcher has seen change and not yet acted on (dynamic mode). Their loads and
        reloads are the watcher's, once they have settled, with these settings: an edit listing a folder still
        being copied loaded it half-copied (its requests failing) and again once whole (a bug hunt).
        """
        try:
            self.check_settings(settings)
        except ConfigError as err:
            log.error("%s; keeping the running configuration", err)
            return asyncio.sleep(0)  # (nothing applied, nothing to wait for)
        old = self.settings
        self.settings = settings
        backends_changed = changed_backends(old, settings)
        unchanged: dict[str, int] = {}  # loaded models of a backend whose defaults changed that run as they were
        work = []
        for entry in self.entries():
            loaded_backend = entry.loaded.backend_name if entry.loaded is not None else None
            options_changed = loaded_backend in backends_changed and self._defaults_change_options(entry, settings)
            step = settings_step(entry.name, old, settings, entry.settings, loaded_backend,
                                 entry.name in self._exposed and entry.folder_seen, backends_changed, options_changed)
            entry.settings, entry.settings_origin = settings.model_or_default(entry.name)
            if step is None:
                if loaded_backend in backends_changed:
                    if entry.holders > 0 or entry.reason:
                        # Decided once its turn comes, against the version serving then (a reload only if anything
                        # changed): a reload under way was built with the defaults of before this edit, and an edit
                        # putting the options back left that reload's options serving for good; and a failed
                        # reload's reason stayed in RepositoryIndex once its cause was undone (the review hunt).
                        work.append(self._reload_entry(entry))
                    else:
                        unchanged[loaded_backend] = unchanged.get(loaded_backend, 0) + 1
                continue
            if step.action != "unload" and entry.name in settling:
                log.info("model '%s'%s; it loads once its folder, which is changing, has settled", entry.name,
                         step.why.rsplit(";", 1)[0])
                self._deferred_steps[entry.name] = step.action
                if step.action == "load":
                    # Wanted from now, as the load would have made it, so that the watcher's own step for the
                    # settled folder loads it (a store's retry included); counted by ServerReady once it serves.
                    # Listed by this edit, it is no longer one a client declined (the hunt of this step).
                    if entry.name not in self._exposed:
                        self._counted_once_ready.add(entry.name)
                    self._exposed.add(entry.name)
                    self._declined.discard(entry.name)
                continue
            self._deferred_steps.pop(entry.name, None)
            log.info("model '%s'%s", entry.name, step.why)
            if step.action == "unload":
                work.append(self._unlisted(entry.name))
            elif step.action == "load":
                work.append(self.load(entry.name, counted=False))  # (listed by the edit: counted once it serves)
            else:
                work.append(self._reload_entry(entry))
        for backend, count in sorted(unchanged.items()):  # (one line, where each model said "reloading it")
            log.info("%s's backends.%s changed, but not the options of %d loaded model%s of it (a default "
                     "written out, or a key its own runtime: sets): not reloaded", settings.config_name, backend, count,
                     "" if count == 1 else "s")
        for model in settings.models:  # listed by this edit before its folder is there: one line for it too
            if model.name not in self._entries and old.model(model.name) is None:
                if model.name in settling:  # (there, new and still changing: "is in ml_backends_path" misled)
                    log.info("model '%s' is now listed in %s; it loads once its folder, which is changing, "
                             "has settled", model.name, settings.config_name)
                else:
                    log.info("model '%s' is now listed in %s; it loads once its folder '%s' is in "
                             "ml_backends_path", model.name, settings.config_name, model.name)
        return self._settled([asyncio.ensure_future(step) for step in work])

    def take_deferred_step(self, name: str) -> Awaitable[ModelEntry] | None:
        """The load or reload of ``name`` that an edit of nereid.yaml left to the watcher (see :meth:`start_settings`),
        for the watcher to await once the folder has settled, or its change was undone before it settled (then
        the folder is never acted on, and the edit was dropped for good; the hunt of that change); None when
        there is none."""
        action = self._deferred_steps.pop(name, None)
        entry = self._entries.get(name)
        if action is None or entry is None or not self.wanted(name):
            return None
        log.info("model '%s': its folder has settled (or is as it was); %s it with its settings now in %s",
                 name, "loading" if action == "load" else "reloading", self.settings.config_name)
        return self.load(name, counted=False) if action == "load" else self._reload_entry(entry)

    def deferred_step(self, name: str) -> str | None:
        """The step (``load``, ``reload``) of ``name`` an edit of nereid.yaml left to the watcher; None: none."""
        return self._deferred_steps.get(name)

    def forget_deferred_step(self, name: str) -> str | None:
        """The watcher acts on ``name``'s folder (a load or reload with the settings in force): no step is left.
        Returns the step that was (see :meth:`deferred_step`)."""
        return self._deferred_steps.pop(name, None)

    async def _unlisted(self, name: str) -> ModelEntry:
        """Unload ``name``, which nereid.yaml no longer lists: its reason is then what a folder not listed at
        start shows, not "unloaded" (which reads as an operator's unload). Listed again while its requests
        drained, it is loaded once they have.

        An edit listing it again found it still loaded (draining) and scheduled nothing, or a reload that found
        it unloaded: it stayed unloaded for good, listed, with ServerReady true (the hunt of live edits)."""
        entry = await self.unload(name)
        if entry.loaded is None and entry.state is ModelState.UNAVAILABLE:
            if served(self.settings, name):
                log.info("model '%s' is served by %s again (listed again while it drained); loading it", name,
                         self.settings.config_name)
                return await self.load(name, counted=False)
            entry.reason = not_listed_reason(self.settings.config_name)
            self._refresh_dependents()  # (theirs named it "unloaded", as though a client had: the same hunt)
        return entry

    async def _reload_entry(self, entry: ModelEntry) -> ModelEntry:
        """Reload ``entry``'s model under the name it has when this starts: a rename (dynamic mode) may have
        moved it since the reload was asked for, and the old name would find no model to reload. Not when its
        running version has these settings already: an edit whose reload failed, then undone."""
        return await self.reload(entry.name, only_if_changed=True)

    async def _settled(self, steps: list[asyncio.Future]) -> None:
        for outcome in await asyncio.gather(*steps, return_exceptions=True):
            if isinstance(outcome, NotFound):  # its folder went meanwhile: that removal is acted on as any other
                log.info("applying %s: %s", self.settings.config_name, outcome)
            elif isinstance(outcome, Exception):  # (one step's failure stops neither the others nor the refresh)
                log.error("applying %s: %s", self.settings.config_name, describe_exception(outcome))
        await self.refresh()  # entries only the old nereid.yaml kept (listed, folder never landed) go

    def _record(self, name: str, event: str) -> None:
        if self.events is not None:
            self.events.repository_event(name, event)

    def public_text(self, text: str) -> str:
        """``text`` fit for clients: paths relative to ml_backends_path (or nereid.yaml's folder), capped (see
        :class:`~nereid.client_paths.ClientPaths`). The log keeps absolute paths."""
        return self._client_paths.public_text(text)

    async def unload(self, name: str, grace_s: float | None = None) -> ModelEntry:
        """Finish the model's queued and running requests, then release it.

        Running work gets ``grace_s`` (default ``shutdown_grace_s``) before it is ended.
        """
        # Wanted no more, whatever follows: a load the store failed (and a watcher retries) stops here, even for
        # a name the store's failed listing cannot confirm; and a step an edit of nereid.yaml left to the watcher
        # (it reloaded a model a client had unloaded since; the hunt of that step).
        self._exposed.discard(name)
        self._counted_once_ready.discard(name)  # (a later exposure counts it afresh: see load)
        self._deferred_steps.pop(name, None)
        if (name not in self._entries and is_model_folder_name(name)
                and self.settings.server.ml_backends_url is not None):
            failure = await self.refresh()
            self._exposed.discard(name)  # (again: a load of it may have come in while the store was listed)
            if name not in self._entries and failure is not None:
                self._declined.add(name)
                # As a load then answers: NOT_FOUND would say there is no such folder, which nobody can tell.
                raise _store_cannot_tell(name, failure, "; nothing is loaded under this name, and it will not be "
                                                        "loaded until asked for again") from failure
        entry = self.entry(name)
        entry.awaiting_folder = False
        self._state_changed()  # no longer counted, even while it waits for a load to finish
        async with entry.held_for_unload():
            try:
                if entry.loaded is not None:
                    await self._unload_locked(entry, grace_s)
            finally:
                # (Also when cancelled by a stop: an unload once begun is seen to its end, see _unload_locked.)
                if entry.loaded is None:
                    entry.reason = "unloaded"
                    self._refresh_dependents()
        return entry

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` until no version held (old ones still draining too) runs anything; True
        when none does."""
        busy = [loaded.scheduler for _, loaded in self.versions() if not loaded.scheduler.idle]
        return all(await asyncio.gather(*(scheduler.wait_idle(timeout_s) for scheduler in busy)))

    def stop_starting(self) -> None:
        """Have every held version start no execution from now on (the server's shutdown grace has passed)."""
        for _, loaded in self.versions():
            loaded.scheduler.stop_starting()

    async def terminate_running(self) -> None:
        """Ask every loaded backend that can, and still runs something, to end its running executions now.

        An idle model is not asked: its ``terminate_running`` is for a grace
        that has passed with work still running, not for every clean stop. One
        backend whose ``terminate_running`` fails is logged and passed over: the
        others are still asked, and the unloads that follow go on. They are
        asked all at once: one whose ``terminate_running`` hangs (bounded by the
        backend-call wait) held up the others, one after another, at every stop.
        """
        running = [(name, loaded.backend) for name, loaded in self.versions()
                   if not loaded.scheduler.idle  # (old versions still draining too)
                   and id(loaded.backend) not in self._terminated]  # (a drain's own grace has asked it already)
        # Asked once: the unloads that follow (grace 0) do not ask again, nor log the same failure twice.
        self._terminated.update(id(backend) for _, backend in running)
        await asyncio.gather(*(terminate_backend(name, backend) for name, backend in running))

    async def unload_all(self, grace_s: float | None = None) -> None:
        """Unload every loaded model (server shutdown), once the work left in the background is done (old
        versions draining, removals). A load or unload a client asked for and still running is abandoned first: a
        load's reason says the server is stopping, and an unload begun finishes its drain."""
        self.release_without_turns()  # (nothing serves any more: see there)
        # Not waited for: a backend's load() may take minutes, or never return (its late result is unloaded).
        for task in list(self._accepted):
            task.cancel()
        await asyncio.gather(*self._accepted, return_exceptions=True)
        await until_all_done(self._background)
        # Callers first, layer by layer: a meta model unloaded after what it calls would first turn
        # UNAVAILABLE ("dependency 'b' is not ready (UNLOADING)"), a WARNING on every clean shutdown.
        remaining = {e.name for e in self.entries() if e.loaded is not None}
        while remaining:
            called = {dependency for name in remaining for dependency in self._loaded_depends_on(name)}
            layer = [name for name in remaining if name not in called] or sorted(remaining)  # (a cycle: all)
            await asyncio.gather(*(self.unload(name, grace_s) for name in layer))
            remaining.difference_update(layer)

    def _loaded_depends_on(self, name: str) -> tuple[str, ...]:
        entry = self._entries.get(name)
        return entry.loaded.depends_on if entry is not None and entry.loaded is not None else ()

    async def _unload_locked(self, entry: ModelEntry, grace_s: float | None = None) -> None:
        loaded = entry.loaded
        assert loaded is not None
        entry.state, entry.reason = ModelState.UNLOADING, ""
        self._refresh_dependents()  # a model being unloaded takes no new requests: its callers stop too
        retire = asyncio.ensure_future(self._retire(self._retiring_version(entry.name, loaded, entry), grace_s))
        try:
            await asyncio.shield(retire)
        except asyncio.CancelledError:
            # Cancelled once begun (the server stopping while nereid.yaml's unload ran): seen to its end, so that
            # the backend is unloaded once and the entry says so (unload_all unloaded it a second time).
            await asyncio.wait({retire})
            if not retire.cancelled() and retire.exception() is None:
                self._unloaded(entry)
            raise
        self._unloaded(entry)

    @staticmethod
    def _unloaded(entry: ModelEntry) -> None:
        entry.loaded = None
        entry.state = ModelState.UNAVAILABLE
        log.info("model '%s' unloaded", entry.name)

    def _replaced_version_grace(self, loaded: LoadedVersion) -> float:
        """How long a version a reload replaced may go on with its queued and running requests: shutdown_grace_s,
        or, for a model that ends its own runs at a bound (a python or cpp model's timeout_s), until that bound.

        Nothing waits on a replaced version (its successor serves): with the shutdown grace alone, an edit of
        nereid.yaml ended every run of a python model past 30 s, though its timeout_s gave it 60 (the nereid.yaml
        hunt). A server stop still ends it at the stop's own grace (see ModelScheduler.stop_starting).
        """
        grace = self.settings.server.shutdown_grace_s
        return grace if loaded.longest_run_s is None else max(grace, loaded.longest_run_s + RUN_END_MARGIN_S)

    def _takes_over(self, name: str, old: LoadedVersion, new: LoadedVersion) -> bool:
        """Whether ``new``, which replaced ``old`` in a reload, takes ``old``'s queued requests: it serves now (READY:
        not a meta model waiting for a model it calls, nor unloaded or replaced since) and has the same signature,
        so each runs there as it would have here. Otherwise they finish on ``old``, as before the hand-over (the
        review: a new input shape, or a successor not READY, failed requests the old version would have run)."""
        return self.serving(name) is new and new.signature == old.signature

    def _retiring_version(self, name: str, loaded: LoadedVersion, entry: ModelEntry) -> RetiringVersion:
        """Count ``loaded`` as retiring from now on, before it is taken off its entry: a shutdown ends its
        running work too, its queue stays in the metrics, its scratch folders stay while it runs."""
        retiring = RetiringVersion(name, loaded, frozenset(entry.scratch_names))
        self._retiring[id(loaded)] = retiring
        return retiring

    async def _retire(self, retiring: RetiringVersion, grace_s: float | None = None, *,
                      successor: LoadedVersion | None = None) -> None:
        """Let one version's queued and running requests finish, then release it; ``successor`` (the version that
        replaced it in a reload): its queued requests go there instead, when it can take them (see
        :meth:`_takes_over` and ModelScheduler.drain).

        A scratch folder a removal left to it (see :meth:`FolderCleanup.drop_scratch`) is deleted then.
        """
        name, loaded = retiring.name, retiring.loaded
        backend = loaded.backend

        async def end_running() -> None:
            if id(backend) not in self._terminated:  # (the shutdown's terminate_running asked it already)
                self._terminated.add(id(backend))  # (and is not to ask it again: a backend is asked once)
                await terminate_backend(name, backend)  # never raises: the unload goes on past a failing terminate

        def let_go() -> None:
            loaded.hook_threads.release()
            loaded.release_folder()
            self._retiring.pop(id(loaded), None)
            self._terminated.discard(id(backend))
            collect_released_code_soon()  # (a model.py's module, which only the collector frees)

        let_go_done = False
        try:
            # Bounded by the grace: an abandoned request's thread must not hold the unload (or the loop).
            takes_over = successor is not None and self._takes_over(name, loaded, successor)
            taker = successor.scheduler if takes_over else None
            await loaded.scheduler.drain(self.settings.server.shutdown_grace_s if grace_s is None else grace_s,
                                         end_running, successor=taker)
            # In turns, once drained (a turn is for the release's threads, not for requests finishing): each
            # release at once took a thread, and hundreds of them held liveness for seconds (the scale hunt). One
            # turn for the release and the removal of its scratch folders after it.
            async with self._loader.unload_turns.turn():
                try:
                    await unload_backend(name, backend)
                finally:
                    let_go_done = True
                    let_go()
                await self._cleanup.drop_scratch(retiring.scratch_names)
        finally:
            if not let_go_done:  # (the drain, or the wait for a turn, ended by an error or a cancel)
                let_go()

    def _heard_loaded(self, name: str, loaded: LoadedVersion) -> None:
        """Tell ``events`` of a version that serves from now on (``nereid_model_load_duration_seconds``): counted
        here, not when the loader ends, so that it counts the loads ``nereid_model_version`` counts (a reload's
        version refused by :meth:`_kept_from_serving` counted as a load, and as no version; the accounting hunt)."""
        if self.events is not None:
            self.events.model_loaded(name, loaded.load_seconds)

    def _kept_from_serving(self, entry: ModelEntry, new: LoadedVersion) -> str | None:
        """Why a reload's ``new`` version must not replace the READY one running: the models it calls leave
        it unable ever to be READY (one missing, failed, or a cycle it closes). None when it may replace it:
        the running version is not READY either, or the new one is READY or waits only on a model LOADING."""
        if entry.state is not ModelState.READY or not new.depends_on:
            return None
        verdict = DependentStates.verdict_calling(self._entries, entry.name, new.depends_on)
        if verdict.ready or verdict.loading:
            return None
        return f"its new version could not be READY: {verdict.why}"

    def _enter_loaded_version(self, entry: ModelEntry) -> None:
        """Make a version just loaded (or reloaded) serve, and log that in one line.

        It is READY unless it calls models that are not: then UNAVAILABLE with
        the reason (never logged READY first), until they are.
        """
        loaded = entry.loaded
        assert loaded is not None
        verdict = DependentStates.verdict(self._entries, entry.name)
        done = (f"load {entry.generation}, backend {loaded.backend_name}, device {entry.settings.device}, "
                f"{loaded.load_seconds:.2f} s")
        if verdict.ready:
            entry.state, entry.reason = ModelState.READY, ""
            log.info("model '%s' is READY (%s)", entry.name, done)
        else:
            entry.state, entry.reason = ModelState.UNAVAILABLE, verdict.why
            log_unavailable(entry, verdict, f" (loaded: {done})")
        self._refresh_dependents()  # the models calling it
        self._retry_cycles_through(entry.name)

    def _refresh_dependents(self, repeated: bool = False) -> None:
        """Keep models that call other models READY exactly while those are READY (issue 14; see
        :class:`~nereid.dependent_states.DependentStates`), then tell the server (:meth:`_state_changed`).

        Called after every state change. ``repeated``: the change is a store failure that repeats the last one
        (see :meth:`load`'s ``retrying``).
        """
        self._dependents.refresh(self._entries, repeated)
        self._state_changed()
        self._retry_kept_versions()

    def _retry_kept_versions(self) -> None:
        """In dynamic mode, load again each model whose new version was kept from serving for the models
        it calls (see :meth:`_kept_from_serving`), once they are all READY: a new meta model version copied in
        before a model it calls, that model arriving later (Triton's poll retries an ensemble whose composing
        model appears). Not for models only LOADING: the retry would swap the running version out for one
        that waits on them, and then on their failure."""
        for entry in list(self._entries.values()):
            if (entry.kept_calling
                    and DependentStates.verdict_calling(self._entries, entry.name, entry.kept_calling).ready):
                self._try_refused_again(entry, "the models its new version calls are READY now")

    def _retry_cycles_through(self, name: str) -> None:
        """In dynamic mode, load again each model refused for a depends_on cycle through ``name``, which has
        just loaded a new version or gone: its manifest may no longer close the cycle. (Only then: a failed
        load changes no manifest, so two models refused for one cycle never retry each other in turn.)"""
        for entry in list(self._entries.values()):
            if name in entry.cycle_through:
                self._try_refused_again(entry, f"model '{name}' on its depends_on cycle has changed")

    def _try_refused_again(self, entry: ModelEntry, why: str) -> None:
        """Load ``entry`` again (in the background) after its refusal for the models it calls, when a watcher
        follows the repository and it is still wanted; the refusal is forgotten either way."""
        entry.kept_calling, entry.cycle_through = (), frozenset()
        if not (self.settings.server.watch and self.wanted(entry.name)):
            return
        log.info("model '%s': %s; loading it again", entry.name, why)
        # (only_if_changed: a reload of the watcher's may have loaded the new version meanwhile.)
        self.in_background(self.reload(entry.name, only_if_changed=True),
                           f"model '{entry.name}': loading it again ({why})")

    def _state_changed(self) -> None:
        """Count from now on each model the watcher loaded that serves (see :meth:`load`'s ``counted``), then tell
        ``on_state_change`` that ServerReady may have moved (the health service follows it)."""
        # Whatever made it READY: its own load, or (a model calling others) theirs, through _refresh_dependents.
        self._counted_once_ready.difference_update([
            name for name in self._counted_once_ready
            if (entry := self._entries.get(name)) is not None and entry.state is ModelState.READY])
        if self.on_state_change is not None:
            self.on_state_change()

    def _scratch_kept(self, name: str) -> bool:
        """Whether an entry, or a version still finishing its requests, was given the scratch folder ``name``."""
        return (any(name in entry.scratch_names for entry in self._entries.values())
                or any(name in retiring.scratch_names for retiring in self._retiring.values()))

    def _known_names(self) -> set[str]:
        """The names of the entries and of the old versions still finishing their requests (safe off the loop:
        each is read in one copy)."""
        return set(dict(self._entries)) | {retiring.name for retiring in list(self._retiring.values())}


_WAITING_FOR_LISTING = ("waiting to load: the model folders could not be listed at start; every folder loads once "
                        "they are")


def _listed_without_folder(name: str, watched: bool, config_name: str) -> NotFound:
    """The error for a load of ``name``, which the configuration file ``config_name`` lists, while it has no model
    folder."""
    then = ("it loads once its folder lands (server.watch)" if watched
            else "put its folder back, then load it again")
    return NotFound(PublicText(f"model '{name}': its folder '{name}' is missing from ml_backends_path, so it cannot "
                               f"be loaded; {config_name} lists it: {then}"))


def _store_cannot_tell(name: str, failure: StorageError, more: str = "") -> Unavailable:
    """The answer for ``name``, which a store that cannot be listed (``failure``) may hold: never NOT_FOUND."""
    return Unavailable(f"model '{name}': cannot tell whether its folder is in the store: {failure}{more}")


# The most model names an unknown one is compared with for a "did you mean": each comparison costs, on the event loop,
# for every NOT_FOUND (about 1 ms for 128 names alike; a flood of made-up names must stay cheap to refuse).
SUGGESTED_AMONG = 64


def _no_folder(name: str, known: Collection[str] = ()) -> NotFound:
    """The error for a name with no model folder (and nothing else keeping it); with the closest of the ``known``
    names (those RepositoryIndex lists), when there is one and they are few (see :data:`SUGGESTED_AMONG`)."""
    # The folder relative to ml_backends_path: clients never see the server's absolute paths.
    # (A copy of the names first, made at once: a dict of entries may change on another thread meanwhile.)
    close = (difflib.get_close_matches(name, list(known), n=1)
             if len(known) <= SUGGESTED_AMONG and len(name) <= NAME_MAX else [])
    meant = f"; did you mean '{close[0]}'?" if close else ""
    return NotFound(PublicText(f"unknown model '{name}' (no folder '{name}' under ml_backends_path{meant})"))


def _repeats(reason: str, retrying: str | None) -> bool:
    """Whether a failed load's ``reason`` is the store failure it was retrying after (see ModelRepository.load)."""
    return retrying is not None and failure_kind(reason) == retrying


def _plugin_traceback(err: BaseException) -> BaseException | None:
    """What a load failure's log line shows the traceback of: the exception a backend's create() or load()
    raised that was not nereid's (a bug, most likely: the plugin's author needs where), else nothing."""
    return err.__cause__ if isinstance(err, BackendRaised) else None


def _cycle_through(err: BaseException, name: str) -> frozenset[str]:
    """The other models on the depends_on cycle a load of ``name`` was refused for (none for another failure)."""
    return frozenset(err.cycle) - {name} if isinstance(err, DependencyCycle) else frozenset()


def _reason(err: BaseException) -> str:
    # Capped: the reason is logged and kept in RepositoryIndex (an alias bomb's was 312 MB).
    text = str(err).strip()
    return cap_message(text) if text else type(err).__name__
