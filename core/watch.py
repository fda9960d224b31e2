"""Dynamic mode (``server.watch: true``): the repository follows its folder and nereid.yaml.

watchfiles reports file events; they are only a trigger for a scan of every
model folder, compared with what the watcher last acted on. A folder is acted
on once it has looked the same for ``server.watch_settle_ms`` (files are
copied one by one), except a rename, whose files are those of a complete
folder already loaded:

- a new folder is loaded (with its nereid.yaml entry, or default settings);
- a folder whose files changed is reloaded without downtime when its model is
  served (the old version serves until the new one is READY, then drains in the
  background; a failed reload keeps the old one); one deliberately not served
  (unlisted at start, unloaded, its nereid.yaml entry removed) stays unloaded;
- a folder that vanished while another with the same contents appeared is a
  rename: the loaded model moves to the new name in place, nothing re-read;
- a folder that vanished is unloaded once its requests have finished;
- a changed nereid.yaml reloads the models whose entries changed, loads added
  ones and unloads removed ones.

Files the server or an editor writes (hidden files and folders such as
``.cache/``, ``*.swp``, ``*~``, ``#*#``) never count as a change; a hidden file
written just now (a transfer's temporary file) keeps its folder from settling.
ml_backends_path is also followed through the folder holding it: replaced as a
whole (``mv``, a symlink switched), it is watched anew; symlinked model folders
are watched where they lead.

An object store sends no events: its listing is polled every
``server.watch_poll_s`` instead, each folder's state made of its objects'
names, sizes and ETags, and the same rules apply, except that a rename is an
unload and a load (the renamed folder's files are not on local disk yet). A
load or reload the store failed (objects refused or gone at fetch) is tried
again at later polls, ever less often, until it loads or the folder changes,
and so is a load the store failed at start-up or at a RepositoryModelLoad;
one that failed for the model's own fault waits for the folder to change.
Each try that fails for the reason the last one did is logged at DEBUG only.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Awaitable, Callable

from nereid.daemon_pool import on_io_thread, on_work_thread
from nereid.config_document import same_values
from nereid.errors import ConfigError, NotFound, Unavailable
from nereid.file_events import Follow, RepositoryFollower
from nereid.files import read_regular_file
from nereid.folder_states import FolderState, moved_files_unloaded, plan_changes, scan_repository, scan_store
from nereid.settings import MAX_CONFIG_BYTES, Settings, document_from_bytes, parse_settings
from nereid.settling import SettlingFolders
from nereid.storage import StorageError, failure_kind, parse_store_url, store_failed
from nereid.store_retries import StoreRetries
from nereid.watched_paths import WatchedPaths

if TYPE_CHECKING:
    from nereid.model_entry import ModelEntry
    from nereid.repository import ModelRepository

log = logging.getLogger(__name__)

# The known state of a folder whose model a request loaded while the watcher did not see the folder (see
# RepositoryWatcher._know_requested_loads): no scan gives it, so the folder's absence reads as a removal.
_LOADED_UNSEEN = FolderState((), "loaded by a request; its folder not seen by the watcher")


async def _logged_settings(config_path: Path, step: Awaitable[object]) -> None:
    """Carry out what an edited nereid.yaml calls for; a failure is logged and leaves the folders' steps alone."""
    try:
        await step
    except Exception:
        log.exception("dynamic repository: applying the changed %s failed", config_path)


async def _logged(name: str, step: Awaitable[object]) -> None:
    """Carry out one folder's step; a failure is logged and leaves the other folders' steps alone."""
    try:
        await step
    except NotFound as err:
        # The folder went between the scan that saw it and its load: the next scan acts on its removal.
        log.info("dynamic repository: model '%s': its folder went before it could be loaded (%s)", name, err)
    except Exception as err:
        log.error("dynamic repository: model '%s': %s: %s", name, type(err).__name__, err)


@dataclass(frozen=True)
class ConfigLook:
    """What one read of nereid.yaml found: its content, or why it cannot be read (see :func:`look_at_config`).

    ``digest`` tells one look from another (a SHA-256 of the bytes, or the
    refusal): it is all the watcher keeps of a file it has applied or refused.
    ``data``, the bytes (at most MAX_CONFIG_BYTES), is kept only while the file
    settles, to read it ahead and then to apply it.
    """

    digest: str
    data: bytes | None = field(default=None, compare=False, repr=False)
    refusal: str | None = None  # (None: ``data`` holds the file)


def look_at_config(path: Path) -> ConfigLook:
    """Read nereid.yaml as the start-up does (blocking): only a regular file of at most MAX_CONFIG_BYTES is read.

    A FIFO put in its place blocked the watcher for good (and the process at
    exit, which joins that thread), a symlink to /dev/zero was read without
    end, and a 45 MB file was kept in memory and parsed for a minute and a
    half: each is a refusal, read no further.
    """
    try:
        data = read_regular_file(path, MAX_CONFIG_BYTES)
    except ConfigError as err:  # (a missing file too: "cannot read: No such file or directory")
        return ConfigLook(f"refused: {err}", refusal=str(err))
    return ConfigLook(hashlib.sha256(data).hexdigest(), data)


def _settings_from(look: ConfigLook, path: Path) -> Settings:
    """The settings the file ``look`` saw at ``path`` gives, checked as load_settings checks them (blocking);
    ConfigError when it was refused or does not load. These bytes, not the file read again: the ones that
    settled are the ones applied."""
    if look.data is None:
        raise ConfigError(look.refusal or f"{path}: cannot read")
    document = document_from_bytes(look.data, path)
    if document is None:
        # No document (nothing, or blank lines and comments): valid, and it would serve every folder with the
        # defaults (all of them loaded, the listed ones reloaded with default settings). It is what a file
        # truncated, its write still under way, reads as once its writer pauses past the settle time (the hunt of
        # live edits). A start with it serves so; an edit is refused.
        raise ConfigError(f"{path}: holds nothing (emptied, its writing still under way?); an edit that empties "
                          "it is not applied: write the configuration to serve (a server started with an empty "
                          "file serves every folder with the defaults)")
    return parse_settings(document, path, read_tls=False)  # (server: keys wait for a restart)


@dataclass(frozen=True)
class Step:
    """One change the watcher carries out (a load, a reload, a rename): ``run()`` makes its work when it starts.

    ``models``: the names it acts on, the first the one it is logged under.
    """

    models: tuple[str, ...]
    run: Callable[[], Awaitable[object]]


class RepositoryWatcher:
    """Watches ``ml_backends_path`` and nereid.yaml and brings the repository in line after each quiet spell."""

    def __init__(self, repository: ModelRepository, settings: Settings,
                 after_apply: Callable[[], Awaitable[None]] | None = None) -> None:
        self.repository = repository
        self.settings = settings
        # As given (never resolved: a symlinked ml-backends is followed through its link when it is switched).
        self.root = Path(os.path.abspath(settings.server.ml_backends_path))
        url = settings.server.ml_backends_url
        self.location = parse_store_url(url) if url else None  # a store: polled, not watched
        # The path as given, never resolved: a symlinked nereid.yaml (a Kubernetes ConfigMap's
        # nereid.yaml -> ..data/nereid.yaml, ..data -> ..v1) is re-read through the link after a swap.
        self.config_path = Path(os.path.abspath(settings.source))
        self.settle_ms = settings.server.watch_settle_ms
        self.poll_s = settings.server.watch_poll_s
        self._folders: dict[str, FolderState] = {}
        # A store's folders emptied of their files (only folder objects or ignored files left) since the watcher
        # knew them with files: gone, until files come again (see _scan).
        self._emptied: set[str] = set()
        # The running nereid.yaml's digest (see ConfigLook): what each later look is compared with.
        self._config_digest = look_at_config(self.config_path).digest
        # nereid.yaml's new look, not yet applied, and since when it has held it: a file is applied once it has
        # looked the same for the settle time, as a folder is (an editor that truncates, then writes, showed a
        # half-written file that was applied: models unloaded, or reloaded with every default).
        self._config_pending: tuple[ConfigLook, float] | None = None
        # The digest of the last nereid.yaml look that was refused (the running one kept), and why: tried again at
        # each later scan, for a refusal may pass (ml_backends_path moved away a moment, a TLS file being replaced).
        self._config_refused: tuple[str, str] | None = None
        # The pending nereid.yaml's settings, read ahead to know which folders' steps wait for it (see
        # _held_for_config): (its digest, its settings; None when it does not read).
        self._config_ahead: tuple[str, Settings | None] | None = None
        self._held: set[str] = set()  # the folders whose steps the last scan held for it
        self._stop = asyncio.Event()
        self._applying = asyncio.Lock()  # the two watches never apply at once
        self.scans = 0  # completed scans (read by tests)
        self._pending = SettlingFolders(self.settle_ms / 1000)  # folders seen changed, not yet acted on
        # A store's folders whose last load the store failed (see _from_store): tried again after a backoff.
        self._store_retries = StoreRetries(self.poll_s)
        # Each scan's loads, reloads, renames and nereid.yaml's work, carried out beside the scans that follow
        # (see _start), and each scan's task awaiting them: cancelled by stop() (a load never starts, nor holds
        # up, a shutdown; the repository's unload_all awaits them).
        self._changes: set[asyncio.Future] = set()
        # The last step started on each model: the next one on it waits for it (see _start).
        self._last_step: dict[str, asyncio.Future] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._scheduled: asyncio.Task | None = None
        self._after_apply = after_apply
        self._primed = False  # whether the repository as it was at start is known
        self._server_ignored: object | None = None  # nereid.yaml's edited server: section, said to need a restart
        self._listing_failure: str | None = None  # why the store last could not be listed (None: it could)
        self._follower = RepositoryFollower(self.root, self.config_path, self.location,
                                            settings.server.follow_symlinks, self.settle_ms, self.poll_s,
                                            self._apply_serialized, self._stop)

    async def prime(self) -> None:
        """Remember the repository as it is now (call once the start-up models are loaded)."""
        try:
            self._folders = await on_io_thread(self._scan)
        except StorageError as err:  # the first poll that can list the store catches up
            self._cannot_list(err)
        else:
            self._primed = True

    def _cannot_list(self, err: StorageError) -> None:
        """Log that the store cannot be listed: at WARNING when that starts or its reason changes, else at DEBUG
        (a store down for a day, polled every 10 s, would write 8,640 lines of the same)."""
        reason = str(err)
        kind = failure_kind(reason)  # (compared without its timings and counts)
        level = logging.DEBUG if kind == self._listing_failure else logging.WARNING
        self._listing_failure = kind
        log.log(level, "dynamic repository: %s; nothing changes until it can be listed", reason)

    def _listed(self) -> None:
        """The store could be listed: say so once after it could not be (a catch-up says it itself)."""
        if self._listing_failure is not None:
            self._listing_failure = None
            if self._primed:
                log.info("dynamic repository: the store can be listed again")

    def _catch_up(self, current: dict[str, FolderState]) -> Awaitable[object]:
        """The store could not be listed at start: take its first listing as the starting state; returns the
        loads it starts.

        What a start with the store up would have loaded is loaded now (every
        folder, or only the listed ones when nereid.yaml lists models), unless
        it is loaded already (a RepositoryModelLoad meanwhile); an unlisted
        folder stays unloaded, as one there at start does, rather than pass for
        a folder added since.
        """
        self._primed = True
        self._folders = dict(current)
        settings = self.repository.settings
        loaded = {entry.name for entry in self.repository.entries() if entry.loaded is not None}
        served = [name for name in current if name not in loaded and not self.repository.declined(name)
                  and (not settings.models_listed or settings.model(name) is not None)]
        log.info("dynamic repository: the store can be listed again; loading %s",
                 ", ".join(f"'{name}'" for name in served) or "nothing (no listed model has a folder yet)")
        self.repository.store_listed_at_last(served)
        return asyncio.gather(*(_logged(name, self._from_store(name, current[name], None,
                                                               functools.partial(self.repository.reload, name)))
                                for name in served))

    def _scan(self) -> dict[str, FolderState]:
        if self.location is None:
            return scan_repository(self.root)  # (a folder of no file but ignored ones is none: see there)
        states = scan_store(self.location)
        self._emptied &= set(states)  # (a folder gone altogether is no longer one emptied)
        # A bucket's folder emptied of its files keeps its folder object (the console's delete leaves it), and
        # was taken for an edit: its reload of nothing failed, and the removed model served on (the review hunt;
        # a local folder's is no folder at all). One new with no files yet still loads, and says why it cannot.
        for name, state in list(states.items()):
            known = self._folders.get(name)
            if state.stamp:
                self._emptied.discard(name)
            elif name in self._emptied or (known is not None and (known.stamp or known is _LOADED_UNSEEN)):
                self._emptied.add(name)
                del states[name]
        return states

    def _look(self) -> tuple[dict[str, FolderState], list[tuple[Follow, WatchedPaths]]]:
        """Scan, and work out what each watch should follow now (blocking)."""
        states = self._scan()
        return states, self._follower.wanted_now()

    async def run(self) -> None:
        """Follow changes until :meth:`stop` (see :class:`~nereid.file_events.RepositoryFollower`)."""
        await self._follower.run()

    def stop(self) -> None:
        """End :meth:`run` at its next wake-up, and any scan still scheduled."""
        self._stop.set()
        if self._timer is not None:
            self._timer.cancel()
        if self._scheduled is not None:
            self._scheduled.cancel()
        self._follower.cancel()
        for task in self._changes:
            task.cancel()

    async def apply(self) -> None:
        """Scan once and carry out what changed (nereid.yaml first, then the folders); returns once the loads
        and reloads it started have ended (the watches' own scans do not wait for them: see :meth:`_start`).

        A rename is carried out at once: its files are known to be those of a
        complete, loaded folder. Any other change waits until the folder has
        looked the same for the settle time (a copy in progress keeps changing),
        and a scan is scheduled for when that time is up. A folder whose hidden
        files are being written (rsync's temporary files) waits until they have
        been left alone for the settle time too.

        An old version's drain (a reloaded or removed model finishing its
        requests) goes on in the background, never holding up the next change.
        """
        await (await self._scan_and_start())

    async def _scan_and_start(self) -> asyncio.Future:
        """:meth:`apply`, returning once its loads, reloads and unloads are started: what ends once they have."""
        started: list[asyncio.Future] = []
        steps: list[Step] = []
        try:
            await self._scan_once(started, steps)
        finally:  # (what was started is carried out, and cancelled by stop(), even after an error)
            changes = self._start(started, steps)
        return changes

    async def _scan_once(self, started: list[asyncio.Future], steps: list[Step]) -> None:
        """Scan once and act on what changed: what nereid.yaml's edit calls for (and a store's catch-up) is
        started at once and goes into ``started``; the folders' renames, loads and reloads go into ``steps``."""
        if self._stop.is_set():
            return  # (stop() came: nothing more is applied, nereid.yaml's edits included)
        try:
            settings_work = await self._apply_config()
        except Exception:  # the folders are still handled
            log.exception("dynamic repository: applying the changed %s failed", self.config_path)
        else:
            if settings_work is not None:
                started.append(asyncio.ensure_future(_logged_settings(self.config_path, settings_work)))
        now = time.monotonic()
        try:
            current, wanted = await on_io_thread(self._look)
        except StorageError as err:  # never read as "every folder is gone"
            self._cannot_list(err)
            return
        if self.location is not None:
            self._listed()
        self._follower.restart_moved(wanted)
        if not self._primed:
            started.append(self._catch_up(current))
        self._store_retries.forget_changed(current)
        if self.location is not None:
            self._adopt_store_failures(current)
        self._know_requested_loads(current)
        plan = plan_changes(self._folders, current, renames_too=self.location is None)
        renamed = {name for pair in plan.renames for name in pair}
        held = self._held = await self._held_for_config({*plan.added, *plan.changed, *renamed})
        repository = self.repository
        for old, new in plan.renames:
            if old in held or new in held:
                continue  # (still a rename at the scan that applies nereid.yaml: the watcher's known states wait)
            log.info("dynamic repository: folder '%s' renamed to '%s'", old, new)
            # (A step an edit of nereid.yaml left for the old name is the old name's: a new folder of that name
            # later was taken for it, and never loaded; the hunt of that step.)
            repository.forget_deferred_step(old)
            # The files the watcher knew for the old name may not be the ones its running version loaded (a
            # reload of them that failed, moved away as it read them, left the version before), nor may the
            # moved files be (an edit it never saw, same size and same ends, made just before a mv): moved in
            # place, that version would serve them as loaded for good, so they are loaded after the move.
            # (As last seen: an edit seen but not yet settled when the folder was copied away is in the copy.)
            seen = self._pending.state(old) if old in self._pending else None
            stale = self.location is None and moved_files_unloaded(repository.loaded_stamp(old),
                                                                   seen or self._folders.get(old), current[new])
            self._accept(old, None)
            self._accept(new, current[new])
            steps.append(Step((new, old), functools.partial(self._renamed, old, new, stale, current[new].stamp)))
        due: dict[str, list[str]] = {"removed": [], "added": [], "changed": []}
        previous: dict[str, FolderState | None] = {}  # the known state of each folder due, before this change
        for kind in due:
            for name in getattr(plan, kind):
                state = current.get(name)
                # Settled or not, a step held for the pending nereid.yaml stays pending: due at the scan applying it.
                if self._pending.settled(name, state, now) and name not in held:
                    due[kind].append(name)
                    previous[name] = self._folders.get(name)
                    self._accept(name, state)
        for name in self._pending.drop_undone(self._folders, current):
            # Undone before it settled: nothing is done with the folder, so a load or reload an edit of nereid.yaml
            # left to this one is done now.
            if repository.deferred_step(name) is not None:
                steps.append(Step((name,), functools.partial(self._deferred_step, name)))
        for name in due["removed"]:
            repository.forget_deferred_step(name)
            log.info("dynamic repository: folder '%s' removed; unloading it", name)
            repository.remove_in_background(name)
        # (A store's folder seen "added" may already be loaded, by a RepositoryModelLoad.)
        # (Counted by ServerReady once it serves: see ModelRepository.load's counted.)
        load = functools.partial(repository.load, counted=False) if self.location is None else repository.reload
        for kind, name in [("added", name) for name in due["added"]] + [("changed", name) for name in due["changed"]]:
            # Settled: the step below loads or reloads it with the settings in force, which does what a step an edit
            # of nereid.yaml left to the watcher would (that edit made the folder wanted: see start_settings).
            deferred = repository.forget_deferred_step(name) is not None
            retry = self._store_retries.get(name)
            if retry is not None and not repository.wanted(name):
                # Unloaded (RepositoryModelUnload) or unlisted since the store failed its load: not tried again.
                self._store_retries.forget(name)
                log.info("dynamic repository: folder '%s' is no longer served (unloaded or no longer listed); "
                         "its load the store failed is not tried again", name)
                continue
            if kind == "added" and repository.declined(name):
                log.info("dynamic repository: new folder '%s' is not loaded: a client unloaded it while the store "
                         "could not be listed (load it to serve it)", name)
                continue
            if kind == "changed" and not repository.wanted(name):
                # Unlisted at start, unloaded by RepositoryModelUnload, its nereid.yaml entry removed: an edit
                # of its files is no request to serve it.
                log.info("dynamic repository: folder '%s' changed; it is not served (not listed, unloaded or "
                         "no longer listed), so nothing is loaded", name)
                continue
            if repository.loaded_stamp(name) == current[name].stamp and not deferred:
                # Loaded already from these very files (a RepositoryModelLoad of a folder just copied, or uploaded,
                # or an edit undone after its reload failed: that failure's reason, of files no longer there, goes).
                log.info("dynamic repository: folder '%s' is loaded already as it is now", name)
                repository.forget_failed_reload(name)
                continue
            if retry is not None:  # (its first failure was logged at WARNING: once, not per try)
                log.debug("dynamic repository: folder '%s': trying again the %s the store failed %d time(s)", name,
                          "load" if kind == "added" else "reload", retry.failures)
            elif kind == "added":
                log.info("dynamic repository: new folder '%s'; loading it", name)
            else:
                log.info("dynamic repository: folder '%s' changed; reloading it", name)
            if self.location is not None:
                step = functools.partial(load if kind == "added" else repository.reload, name)
                steps.append(Step((name,), functools.partial(self._from_store, name, current[name], previous[name],
                                                             step)))
            elif kind == "added":
                steps.append(Step((name,), functools.partial(load, name)))
            else:  # (an unload, or the end of its listing, meanwhile: not reloaded)
                steps.append(Step((name,), functools.partial(self._reloaded_if_wanted, name)))
        self.scans += 1
        self._schedule_settled_scan()

    async def _deferred_step(self, name: str) -> None:
        """The load or reload of ``name`` an edit of nereid.yaml left to the watcher, if it is still left."""
        work = self.repository.take_deferred_step(name)
        if work is not None:
            await work

    def _start(self, started: list[asyncio.Future], steps: list[Step]) -> asyncio.Future:
        """Carry out one scan's ``steps`` (with the work ``started`` already) beside the scans that follow; then
        publish readiness (after_apply). Returns what ends when all of it has.

        A scan never waits for them: one load that takes minutes (a large
        model compiling) or never returns held up every later change, and a
        folder copied in meanwhile did not appear until it was done. Steps on
        one model take turns: each starts once the watcher's step before it on
        that model has ended, and decides then what to do (the folder as it is
        then, whether it is still wanted).
        """
        if self._stop.is_set():  # (stop() came during the scan: nothing more starts)
            for future in started:
                future.cancel()
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        tasks = [*started, *(self._step_task(step) for step in steps)]
        for task in tasks:
            self._keep(task)

        async def carry_out() -> None:
            await asyncio.gather(*tasks)
            if self._stop.is_set():
                return
            self._schedule_settled_scan()  # (a load the store failed is pending again: tried after a backoff)
            if self._after_apply is not None:
                try:
                    await self._after_apply()
                except Exception:  # (the next scan's publishes again)
                    log.exception("dynamic repository: publishing readiness after a change failed")
        # In the repository's background work: unload_all (the server stopping) waits for it to end.
        changes = self.repository.in_background(carry_out(), "dynamic repository changes")
        self._keep(changes)
        return changes

    def _keep(self, task: asyncio.Future) -> None:
        self._changes.add(task)
        task.add_done_callback(self._changes.discard)

    def _step_task(self, step: Step) -> asyncio.Task:
        """Run ``step`` in a task once the watcher's last step on each of its models has ended (and, after a
        removal of a folder of its name still taking its model off the name, once that has)."""
        before = {self._last_step[name] for name in step.models if name in self._last_step}
        name = step.models[0]

        async def run() -> None:
            if before:
                await asyncio.wait(before)
            removal = self.repository.removal_of(name)
            if removal is not None:  # (it waits for a load or rename in progress, never for the drain)
                await asyncio.wait({removal})
            await _logged(name, step.run())
        task = asyncio.get_running_loop().create_task(run(), name=f"nereid: dynamic repository: '{name}'")
        for model in step.models:
            self._last_step[model] = task

        def forget(task: asyncio.Task) -> None:
            for model in step.models:
                if self._last_step.get(model) is task:
                    del self._last_step[model]
        task.add_done_callback(forget)
        return task

    async def _renamed(self, old: str, new: str, stale: bool, stamp: object) -> None:
        """Move the model of folder ``old`` to ``new`` (see ModelRepository.rename); ``stale``: its running version
        had not loaded the files the watcher knew, so they are loaded after the move (unless the move loaded
        them anew: a failed load of them has no stamp, and was loaded once more, its ERROR twice; the soak)."""
        moved_in_place = await self.repository.rename(old, new)
        if moved_in_place and stale and self.repository.loaded_stamp(new) != stamp:
            log.info("dynamic repository: folder '%s' holds files its model had not loaded; reloading it", new)
            await self.repository.reload(new)

    async def _reloaded_if_wanted(self, name: str) -> None:
        """Reload the changed folder ``name``, unless it is no longer wanted (unloaded, unlisted since the scan),
        or its running version has these very files and settings (nereid.yaml's edit reloaded it meanwhile)."""
        if not self.repository.wanted(name):
            log.info("dynamic repository: folder '%s' changed; it is no longer served (unloaded or no longer "
                     "listed), so nothing is loaded", name)
            return
        await self.repository.reload(name, only_if_changed=True)

    def _know_requested_loads(self, current: dict[str, FolderState]) -> None:
        """Know as "loaded, its folder not seen" each model loaded (by a RepositoryModelLoad) whose folder the
        watcher does not know and ``current`` does not hold: its folder's absence is then a removal.

        A folder uploaded again after its removal, loaded at once and deleted before the next look showed no
        change to the watcher (never seen, not there), and its model served for good. One whose removal is
        under way is left to it, and so is one a step of the watcher's is still to act on (a rename waiting
        for the model's reload to end: its old name is no folder the watcher knows, and is no removal).
        """
        for entry in self.repository.entries():
            name = entry.name
            if (entry.loaded is not None and name not in self._folders and name not in current
                    and self.repository.removal_of(name) is None and name not in self._last_step):
                self._folders[name] = _LOADED_UNSEEN

    async def _from_store(self, name: str, state: FolderState, previous: FolderState | None,
                          load: Callable[..., Awaitable[ModelEntry]]) -> None:
        """Carry out ``load()``, the load or reload of the store's folder ``name`` seen in ``state`` (called
        with ``retrying=``, see :meth:`ModelRepository.load`); if the store failed it, the folder goes back to
        ``previous`` to be tried again.

        The folder's state was taken as known before the load: without this a failed load would look done,
        and a folder whose objects do not change again would never be tried again once the store serves
        (a new model UNAVAILABLE for good, an edited one serving its old version). A failure that is the
        model's own (its code, its settings) is not tried again: it would fail the same way each time.
        """
        retry = self._store_retries.get(name)
        generation = self.repository.generation(name)  # (a load that leaves it so failed)
        try:
            # A try again that fails as the last one did is no news: the repository says it at DEBUG.
            entry = await load(retrying=retry.reason if retry is not None else None)
        except (StorageError, Unavailable) as err:
            if not store_failed(err):
                raise
            # The store could not be listed to find a folder the repository did not know.
            fault: str | None = str(err)
        else:
            if entry.generation != generation:  # a new version serves
                retry = self._store_retries.forget(name)
                if retry is not None:
                    log.info("dynamic repository: folder '%s' loaded; the store had failed it %d time(s)", name,
                             retry.failures)
                return
            # The repository records when the store failed the load (a fetch, a weights stream): the error's
            # chain holds a StorageError. Anything else was the model's own fault.
            fault = entry.store_fault or None
        if fault is None:
            self._store_retries.forget(name)
            return
        if self._folders.get(name) != state:
            return  # changed or gone meanwhile: that change is acted on as any other
        self._try_again_later(name, state, previous, fault)

    def _adopt_store_failures(self, current: dict[str, FolderState]) -> None:
        """Try again, as the watcher's own, the loads the store failed that the watcher did not start: the
        start-up loads (loaded by the server once the watcher was primed), a RepositoryModelLoad's, and a
        RepositoryModelLoad's reload of a serving model.

        Only a model that is still wanted, not loading now, whose folder is as the watcher knows it (a folder
        changed since is loaded anew anyway) and is not being tried again already.
        """
        for entry in self.repository.entries():
            name, state = entry.name, current.get(entry.name)
            if (entry.store_fault and not entry.holders and state is not None
                    and self._folders.get(name) == state and name not in self._pending
                    and name not in self._store_retries and self.repository.wanted(name)):
                # A serving model's reload goes back to a state no scan can see, so that the scan after the
                # backoff finds the folder changed and reloads it: its files are those it serves, and were
                # never seen as a change (the reload's failed reason stayed beside READY for good).
                previous = None if entry.loaded is None else replace(state, stamp=(("reload the store failed",),))
                self._try_again_later(name, state, previous, entry.store_fault)

    def _try_again_later(self, name: str, state: FolderState, previous: FolderState | None, fault: str) -> None:
        """The store failed the load (or reload, with ``previous`` the state loaded) of the folder ``name`` seen
        in ``state`` for the reason ``fault``: it goes back to ``previous``, to be tried again after a backoff
        (see :mod:`nereid.store_retries`)."""
        retry = self._store_retries.failed(name, state, fault, reloading=previous is not None)
        if previous is None:
            self._folders.pop(name, None)
        else:
            self._folders[name] = previous
        # Pending in this state, settled once the backoff is over: the scan after that loads it again.
        self._pending.due_at(name, state, time.monotonic() + retry.delay_s)

    def _accept(self, name: str, state: FolderState | None) -> None:
        """Make ``state`` the folder's known state (None: gone); it is no longer pending."""
        self._pending.done(name)
        if state is None:
            self._folders.pop(name, None)
        else:
            self._folders[name] = state

    def _schedule_settled_scan(self) -> None:
        """Scan again when the first pending folder (or a pending nereid.yaml) has had its settle time (no event
        may come)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        # (A folder held for the pending nereid.yaml is due when the file is: it would have a scan every moment.)
        held = self._held if self._config_pending is not None else set()
        dues = [] if (folders_due := self._pending.next_due(held)) is None else [folders_due]
        if self._config_pending is not None:
            dues.append(self._config_pending[1] + self.settle_ms / 1000)
        if not dues:
            return
        due = min(dues)

        def scan() -> None:
            self._timer = None
            self._scheduled = asyncio.get_running_loop().create_task(self._apply_serialized())

        self._timer = asyncio.get_running_loop().call_later(max(0.0, due - time.monotonic()) + 0.001, scan)

    async def _apply_serialized(self) -> asyncio.Future | None:
        """The watches' scan: :meth:`apply`, not waiting for the loads it starts (see :meth:`_start`); returns
        the task carrying them out (None after an error, logged)."""
        async with self._applying:
            try:
                return await self._scan_and_start()
            except Exception:  # the watcher must outlive any one bad change
                log.exception("dynamic repository: applying a change failed")
                return None

    async def _apply_config(self) -> Awaitable[None] | None:
        """Apply nereid.yaml if its content changed; one that does not load is logged and changes nothing.

        The new settings are in force on return; the loads, reloads and unloads they call for are started, and
        returned (None: nothing was applied).
        """
        look = await on_work_thread(look_at_config, self.config_path)  # never read a file on the loop
        if look.digest == self._config_digest:
            self._config_pending = None  # (back as it was)
            if self._config_refused is not None:
                log.info("dynamic repository: %s is back to the running configuration", self.config_path.name)
                self._config_refused = None
            return None
        now = time.monotonic()
        if self._config_pending is None or self._config_pending[0] != look:
            self._config_pending = (look, now)  # changed (again): its settle time starts
        if now - self._config_pending[1] < self.settle_ms / 1000:
            return None  # (the scan that apply schedules comes back for it)
        self._config_pending = None
        try:
            new = await on_work_thread(_settings_from, look, self.config_path)
            # The settings served: a server: section changed needs a restart. Checked as served, so that the
            # repository knows them checked already when they are applied (an edit adding a bad backends: option
            # logged its WARNING twice; a bug hunt).
            served = replace(new, server=self.settings.server)
            # (Refused before it is said to apply.) Off the loop: the plugins' defaults hooks run there, and a slow
            # one held every request for as long, at each edit (the config hunt).
            # (A daemon thread: one held by a hook that never returns must not keep the process from exiting.)
            await on_io_thread(self.repository.check_settings, served)
        except ConfigError as err:
            # Once per refusal: the same file refused again for the same reason, at a later scan, is no news.
            repeated = self._config_refused == (look.digest, str(err))
            log.log(logging.DEBUG if repeated else logging.ERROR,
                    "dynamic repository: %s; keeping the running configuration", err)
            self._config_refused = (look.digest, str(err))
            return None
        self._config_digest = look.digest
        old = self.settings
        server_changed = not same_values(new.server, old.server)  # (types too: strict_readiness: 1 to true)
        if server_changed and (self._server_ignored is None or not same_values(new.server, self._server_ignored)):
            changed = [key for key in new.server.__dataclass_fields__
                       if not same_values(getattr(new.server, key), getattr(old.server, key))]
            log.warning("dynamic repository: %s changed server.%s: needs a restart; ignored",
                        self.config_path.name, ", server.".join(changed))
        # Said once per server: section as edited, not again at each later edit of the models that leaves it be.
        self._server_ignored = new.server if server_changed else None
        new = served
        if self._stop.is_set():
            return None  # (stop() came while the file was read: its work would start after it)
        self.settings = new
        # (An operator who fixed a refused file learns it took: nothing else says so when no model changes.)
        log.info("dynamic repository: %s changed; applying it%s", self.config_path.name,
                 " (it is valid again)" if self._config_refused is not None else "")
        self._config_refused = None
        return self.repository.start_settings(new, settling=self._pending)

    async def _held_for_config(self, names: set[str]) -> set[str]:
        """Those of ``names`` whose folder steps wait for the nereid.yaml still settling: the ones it gives other
        settings than the running file (all of them when it lists models otherwise, or changes a backend's
        defaults). None waits when no edit is pending, or the pending file does not read (it will be refused).

        A folder renamed together with its entry (one git checkout) was loaded under the running file, which
        does not list the new name: with default settings (a cxx model, which only nereid.yaml declares, with
        an ERROR), then again once the file settled. Held, it is loaded once, with the new entry.
        """
        pending = self._config_pending
        if not names or pending is None:
            return set()
        if self._config_ahead is None or self._config_ahead[0] != pending[0].digest:
            self._config_ahead = (pending[0].digest, await on_work_thread(self._settings_of, pending[0]))
        new, running = self._config_ahead[1], self.settings
        if new is None:
            return set()
        if new.models_listed != running.models_listed or not same_values(new.backend_defaults,
                                                                          running.backend_defaults):
            return set(names)
        return {name for name in names
                if not same_values(new.model_or_default(name)[0], running.model_or_default(name)[0])}

    def _settings_of(self, look: ConfigLook) -> Settings | None:
        """The settings nereid.yaml's ``look`` gives, None when it does not read (blocking)."""
        if look.data is None:
            return None  # (a refused file: never parsed)
        try:
            return _settings_from(look, self.config_path)
        except Exception:  # (refused when it settles, with the reason: nothing to say here)
            return None
