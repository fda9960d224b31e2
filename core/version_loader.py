"""One version of a model folder loaded: built from the folder as it is now, wired to its queue and runner.

The repository decides when a folder loads and what its state becomes; this
module does the load itself: the folder fetched (from an object store) and
checked, claimed and loaded by its backend on a daemon thread, and the result
given its scheduler, request runner and hook threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import AsyncIterator

import pluggy

from nereid.backend import CallsModels, ModelCaller, ModelContext, what_it_calls
from nereid.backend_calls import await_build, on_daemon_thread, unload_backend, unload_unclaimed
from nereid.daemon_pool import on_work_thread
from nereid.errors import ConfigError, backend_exit, calling_plugin, shown_name
from nereid.files import check_confined
from nereid.folder_states import folder_stamp, loaded_store_stamp
from nereid.leftovers import remove_model_leftovers
from nereid.model_building import BuildStage, BuiltVersion, build_model
from nereid.model_entry import LoadAbandoned, LoadedVersion, ModelEntry
from nereid.model_runner import HookThreads, make_runner
from nereid.plugins import streamed_files
from nereid.run_folders import runs_folder
from nereid.scheduler import ModelScheduler
from nereid.settings import DEFAULT_MODEL_LOAD_THREADS, ModelSettings, Settings
from nereid.stats import ModelStats
from nereid.storage import materialize_model_version
from nereid.storage.mirror import CACHE_SUBFOLDER

# The repository's logger: a load's warnings read as the repository's, as they always have.
log = logging.getLogger("nereid.repository")


def _without(stamp: object, names: frozenset[str]) -> tuple:
    """A folder stamp's files (see :func:`~nereid.folder_states.folder_stamp`) but ``names``."""
    return tuple(file for file in stamp if file[0] not in names)  # type: ignore[attr-defined]


def warn_if_settings_ignored(name: str, settings: ModelSettings, running: int) -> None:
    """Log the settings of model ``name``, which calls models and runs ``running`` requests at once (its backend's
    count), that do not apply to it: ``instances`` other than 1, and batching rules (each of its requests is an
    orchestration with a deadline of its own, never merged with another)."""
    if settings.instances != 1:  # (a Triton ensemble's instance_group, ported, say)
        log.warning("model '%s': instances: %d does not apply to a model that calls models; %d of its requests run "
                    "at once (its backend's count; queue_capacity for a meta model)", name, settings.instances,
                    running)
    batching = settings.batching
    asked = [key for key, value in (("max_queue_delay_ms", batching.max_queue_delay_ms),
                                    ("preferred_batch_sizes", batching.preferred_batch_sizes),
                                    ("max_batch_size", batching.max_batch_size),
                                    ("max_batch_cost", batching.max_batch_cost)) if value]
    if batching.enabled and asked:  # (found by a bug hunt: accepted without a word, as if they applied)
        log.warning("model '%s': batching: %s does not apply to a model that calls models; each of its requests "
                    "runs alone, as an orchestration with its own deadline (the models it calls batch their "
                    "sub-calls)", name, ", ".join(asked))


async def discard_version(name: str, loaded: LoadedVersion) -> None:
    """Release a version that never served (nothing was ever queued in it): its batcher, its backend and its
    hook threads."""
    try:
        await loaded.scheduler.drain(0)
        await unload_backend(name, loaded.backend)
    finally:
        loaded.hook_threads.release()
        loaded.release_folder()


# How long a release of a retired version holds its turn (see UnloadTurns) before the next one may start beside it.
UNLOAD_TURN_S = 2.0


class UnloadTurns:
    """Turns for the releases of retired versions (a backend's ``unload()``, a scratch folder's removal, each on a
    thread of its own): at most ``count`` at once, the others waiting, first come first served.

    250 RepositoryModelUnload calls at once started 250 threads, whose GIL
    kept gRPC's ServerLive waiting up to 2.1 s on two cores (the scale hunt).
    Apart from the loads' own turns: an unload never waits behind a load of
    another model (one compiling for minutes), and no load waits for an
    unload's turn, so neither can hold what the other waits for. A release
    still running after ``longest_s`` gives its turn up (it runs on): the turns
    bound the threads that compete for the GIL, and one blocked in a sleep or
    in I/O takes none; a turn held for the 30 s a backend call may take kept
    every other model's unload waiting behind one that hung (the review hunt).
    """

    def __init__(self, count: int, longest_s: float | None = None) -> None:
        self._slots = asyncio.Semaphore(count)
        self.longest_s = UNLOAD_TURN_S if longest_s is None else longest_s
        self.waiting = 0  # releases waiting for their turn
        self._open = False

    @contextlib.asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """Hold a turn for the body (none once :meth:`open`)."""
        if self._open:
            yield
            return
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        given_up = False

        def give_up() -> None:
            nonlocal given_up
            if not given_up:
                given_up = True
                self._slots.release()
        timer = asyncio.get_running_loop().call_later(self.longest_s, give_up)
        try:
            yield
        finally:
            timer.cancel()
            give_up()

    def open(self) -> None:
        """Let every release go at once from now on, those waiting too: the server stops (nothing is served any
        more, and its stop must not wait turns behind releases that hang)."""
        if self._open:
            return
        self._open = True
        for _ in range(self.waiting):
            self._slots.release()


class VersionLoader:
    """Loads versions of model folders for one repository.

    ``models`` is handed to every model's context (how meta models call the
    others). A version it loads is counted (``nereid_model_load_duration_seconds``) by the repository once it
    serves: a reload's new version may still be refused then.
    """

    def __init__(self, manager: pluggy.PluginManager, scratch_dir: Path, models: ModelCaller | None = None,
                 load_threads: int = DEFAULT_MODEL_LOAD_THREADS) -> None:
        self.manager = manager
        self.scratch_dir = scratch_dir
        # Every model's runs make their folders here, not in the model's scratch folder: a TMPDIR that named the
        # model left no room for the AF_UNIX sockets a run makes (see nereid.run_folders).
        self.runs_dir = runs_folder(scratch_dir)
        self.models = models
        # At most ``load_threads`` builds at once (server.model_load_threads). Hundreds of folders at start, each
        # build's thread importing and reading at once, kept the event loop from the GIL: liveness went
        # unanswered for 10-30 s on two cores, long enough for a liveness probe to kill the server.
        self._build_slots = asyncio.Semaphore(load_threads)
        # As many releases of retired versions at once, in turns of their own (see UnloadTurns).
        self.unload_turns = UnloadTurns(load_threads)

    def scratch_for(self, name: str) -> Path:
        """The scratch folder for the model ``name`` (made if it is not there); ConfigError naming the model when
        it cannot be made (a name an object store takes, past a local file system's 255 bytes: the raw OSError
        named only the scratch path; a bug hunt)."""
        path = self.scratch_dir / name
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            if err.errno == errno.ENAMETOOLONG:
                raise ConfigError(f"model {shown_name(name)}: its name is {len(os.fsencode(name))} bytes, and the "
                                  "server keeps a local folder of that name (its scratch folder, a bucket's mirror): a "
                                  "local file system allows 255 bytes per name; give the model folder a shorter "
                                  "name") from None
            raise ConfigError(f"model {shown_name(name)}: cannot make its scratch folder {path}: "
                              f"{err.strerror or err}") from None
        return path

    async def load(self, entry: ModelEntry, stats: ModelStats, settings: Settings) -> LoadedVersion:
        """Build the entry's folder as it is now into a new LoadedVersion (raises with the reason), counting its
        requests in ``stats`` (a reload's new version keeps the old one's).

        A model that loaded but then cannot be wired up (its ``dependencies()``
        raises, say) is unloaded before the reason is raised: what its
        ``load()`` acquired must not leak. An unload of the entry waiting for
        its turn wins: :class:`~nereid.model_entry.LoadAbandoned`, nothing built.
        """
        name = entry.name
        entry.scratch_names.add(name)
        stamp = None
        restamped: list[object] = []  # the folder's stamp after load() rewrote it (ModelContext.folder_rewritten)
        # A local folder's files are stamped whatever server.watch says: a client's load that waited behind
        # another one compares them (see ModelRepository._loaded_as_now), and without the stamp it took the files
        # the first had read for the folder's now (an edit between the two was never loaded; the races hunt).
        stamped_here = settings.server.ml_backends_url is None

        def folder_rewritten(names: frozenset[str]) -> None:
            stamped = folder_stamp(entry.folder)  # (on the build's thread)
            # Taken for the version's only when nothing but those files changed since the build began.
            if stamped is not None and stamp is not None and _without(stamped[0], names) == _without(stamp, names):
                restamped.append(stamped[0])
        context = ModelContext(name, entry.folder, entry.settings, self.scratch_for(name), entry.settings_origin,
                               self.models, on_folder_rewritten=folder_rewritten if stamped_here else None,
                               runs_dir=self.runs_dir, config_name=settings.config_name)
        if stamped_here:
            stamped = await on_work_thread(folder_stamp, entry.folder)  # before the build reads the files
            stamp = stamped[0] if stamped is not None else None
        # Waited for as a task the entry holds as its build: an unload or removal coming meanwhile cancels it
        # (held_for_unload), and is not kept waiting behind every other folder's build.
        turn = asyncio.ensure_future(self._build_slots.acquire())
        entry.building = turn
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self._build_slots.release()  # (taken just before the cancellation came)
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # this task was cancelled (the server stopping)
                raise
            raise LoadAbandoned(f"model '{name}': load abandoned: an unload or removal of it came while it waited "
                                "for its turn to load (server.model_load_threads)") from None
        finally:
            entry.building = None
        slot_held = True
        stage = BuildStage("the check of its folder's files")  # the step the build is in, for its note and reason

        def release_slot() -> None:
            nonlocal slot_held
            if slot_held:
                slot_held = False
                self._build_slots.release()

        try:
            if entry.unloads_waiting:  # an unload waits for its turn: it wins, and nothing is built for nothing
                # (Most often sent after this load, which waited for its turn behind another: not "came first".)
                raise LoadAbandoned(f"model '{name}': load abandoned: an unload or removal of it is waiting for "
                                    "its turn, and wins over a load")
            started = time.monotonic()
            backend_defaults = settings.backend_defaults  # (read once: kept with what it builds)
            building = on_daemon_thread(functools.partial(self._build, context, backend_defaults, settings, stage),
                                        f"nereid-load-{name}", functools.partial(unload_unclaimed, name))
            entry.building = building
            # A build still running after LONG_LOAD_NOTE_S gives its slot up: a load() that never returns must
            # not keep every other folder from loading.
            built = await await_build(name, building, started, running_long=release_slot, stage=stage)
        except asyncio.CancelledError:
            context.abandoned.set()  # (a build that can stop early does: a compiler held its slot for nothing)
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # this task was cancelled (the server stopping)
                raise
            # Only the build was: an unload or removal gave up on it (held_for_unload).
            raise LoadAbandoned(f"model '{name}': load abandoned after {time.monotonic() - started:.1f} s: an "
                                f"unload or removal of it came while {stage.call()} was still running (if "
                                "that ever returns, what it built is unloaded)") from None
        finally:
            entry.building = None
            release_slot()
        load_seconds = time.monotonic() - started
        if restamped:
            stamp = restamped[-1]
        elif built.folder_hold is not None and built.folder_hold.remote is not None:
            stamp = loaded_store_stamp(built.folder_hold.remote)  # (a store's folder: the watcher's stamp of it)
        loaded = await self._wired(entry, built, stats, load_seconds, stamp, context, backend_defaults)
        entry.generation += 1
        return loaded

    async def _wired(self, entry: ModelEntry, built: BuiltVersion, stats: ModelStats, load_seconds: float,
                     stamp: object, context: ModelContext, backend_defaults: dict) -> LoadedVersion:
        """The built model given its scheduler, runner and hook threads; unloaded again if that fails."""
        name = entry.name
        scheduler: ModelScheduler | None = None
        try:
            instances, depends_on = entry.settings.instances, ()
            if isinstance(built.backend, CallsModels):
                # Model code, on the event loop: a sys.exit() there must be its failure, not the server's end. So
                # must a KeyboardInterrupt: the server takes Ctrl-C with the loop's signal handler, never as one.
                instances, depends_on = calling_plugin(
                    lambda: what_it_calls(name, built.backend),
                    lambda exit_: backend_exit(name, exit_, "while asked what it calls"), also=(KeyboardInterrupt,))
                warn_if_settings_ignored(name, entry.settings, instances)
            scheduler = ModelScheduler(name, built.backend, built.batch_signature, entry.settings.queue_capacity,
                                       instances, stats, built.policy, copies_outputs=not built.fresh_outputs,
                                       config_name=context.config_name)
            hook_threads = HookThreads(name)
            return LoadedVersion(built.backend_name, built.backend, built.signature, built.batch_signature,
                               scheduler, stats, load_seconds,
                               make_runner(built.backend, built.signature, built.batch_signature, scheduler,
                                           hook_threads),
                               hook_threads, depends_on, stamp, context.settings,
                               backend_defaults.get(built.backend_name), built.folder_hold, built.uses_device,
                               built.longest_run_s)
        except Exception:
            if scheduler is not None:  # its batcher task is running: end it, or asyncio logs it destroyed
                await scheduler.drain(0)
            await unload_backend(name, built.backend)
            if built.folder_hold is not None:
                built.folder_hold.release()
            raise

    def _build(self, context: ModelContext, backend_defaults: dict, settings: Settings,
               stage: BuildStage) -> BuiltVersion:
        """Fetch the folder if it is in a store, check it stays inside the repository, then build the model
        (blocking), telling ``stage`` each step as it starts.

        A folder in a store is fetched into the local mirror, and the version
        is built from (and runs from) a version folder of its own made of those
        files, held until the version is released: a later fetch (a reload of
        this server's, or of one sharing the cache) never changes its files.
        """
        server = settings.server
        if server.ml_backends_url:
            stage.enter("the fetch of its folder from the object store")
        hold = materialize_model_version(server, context.name,
                                         streamed_files(self.manager, context.name, context.settings.backend))
        if hold is not None:
            context = replace(context, folder=hold.folder, repository_folder=context.folder)
        try:
            stage.enter("the check of its folder's files")
            check_confined(context.folder, server.ml_backends_path, server.follow_symlinks, settings.config_name)
            remove_model_leftovers(context.folder, CACHE_SUBFOLDER)
            built = build_model(self.manager, context, backend_defaults, settings.source, stage)
        except BaseException:
            if hold is not None:
                hold.release()
            raise
        for note in built.notes:  # (once per load: what the folder holds that the model ignores)
            log.warning("model '%s': %s", context.name, note)
        return replace(built, folder_hold=hold)
