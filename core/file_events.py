"""When dynamic mode looks at the repository: after file events, and at each poll (a store's only then).

The model folders are watched recursively (with where symlinked model folders
lead); nereid.yaml and ml_backends_path through the folders holding them (and
the links on their way, and the file a symlinked nereid.yaml leads to), not
recursively: editors replace files, a release replaces the whole
ml_backends_path, which a watch on the file or folder itself would lose, and
those folders may hold a whole project. What a look finds is the watcher's
business (:mod:`nereid.watch`); this module only says when.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Awaitable, Callable

import watchfiles

from nereid.daemon_pool import on_work_thread_or_here
from nereid.folder_states import ignored_name
from nereid.settling import MAX_GROUPING_FACTOR
from nereid.storage import StoreURL
from nereid.watched_paths import (WatchedPaths, awaited_targets, identity_of, links_on_the_way, nearest_folder,
                                  symlinked_folders)

# The watcher's logger: operators follow dynamic mode's lines in one place.
log = logging.getLogger("nereid.watch")

EVENT_STEP_MS = 20  # events are grouped this long before a look; the settle time is applied per folder
# The link a Kubernetes ConfigMap or Secret volume swaps to update its files (its AtomicWriter's name).
KUBERNETES_DATA_LINK = "..data"


class Follow:
    """One file watch that a look can restart on other paths.

    It is the watch's stop event: watchfiles asks ``is_set()`` at every step
    (from its own thread), and ``set()``s it when its task is cancelled.
    """

    def __init__(self, recursive: bool, wanted: Callable[[], WatchedPaths], stop: asyncio.Event) -> None:
        self.recursive = recursive
        self.wanted = wanted  # blocking: what it should follow now
        self.current: WatchedPaths | None = None  # what the running watch follows
        self.restart = False
        self._stop = stop

    def is_set(self) -> bool:
        return self.restart or self._stop.is_set()

    def set(self) -> None:
        self.restart = True


def describe_error(err: BaseException) -> str:
    """``Type: message`` for an error, each one for an ExceptionGroup (watchfiles raises those)."""
    if isinstance(err, BaseExceptionGroup):
        return "; ".join(describe_error(inner) for inner in err.exceptions)
    return f"{type(err).__name__}: {err}"


# What a file watcher's error says when the kernel's inotify limits of the server's user are what failed: each
# process of the uid shares them, so another program holding them all fails the watch, read as "Too many open files".
_INSTANCES_EXHAUSTED = ("os error 24", "Too many open files")
_WATCHES_EXHAUSTED = ("os error 28", "No space left on device", "OS file watch limit reached")


def watch_limit_hint(problem: str) -> str:
    """What a file watcher's error (:func:`describe_error`'s text) means when it is an inotify limit, for its log
    line: the sysctl to raise; "" for any other error.

    inotify_init fails with EMFILE ("Too many open files") both when the process is out of file descriptors and
    when the uid's ``fs.inotify.max_user_instances`` (128 on many distributions) are all taken, which a server with
    descriptors to spare reads as the wrong limit (the limits hunt); inotify_add_watch fails with ENOSPC ("No space
    left on device") at ``fs.inotify.max_user_watches``.
    """
    if any(sign in problem for sign in _INSTANCES_EXHAUSTED):
        return ("; from the file watcher this is most often the inotify instances of the server's user all taken: "
                "raise fs.inotify.max_user_instances (sysctl; every process of the user counts), or the server's own "
                "limit of open files if it is at it")
    if any(sign in problem for sign in _WATCHES_EXHAUSTED):
        return ("; the inotify watches of the server's user are all taken (one per folder watched, every process "
                "of the user counts): raise fs.inotify.max_user_watches (sysctl)")
    return ""


class _WatchHealth:
    """Whether one watch runs: the failure logged last (None: it runs) and which of its starts failed last."""

    def __init__(self) -> None:
        self.failure: str | None = None
        self.starts = 0
        self.failed_start = 0


class RepositoryFollower:
    """Calls ``look()`` after each batch of relevant file events under ``root`` and beside ``config_path`` (a
    store at ``location``: every ``poll_s`` instead), until ``stop`` is set.

    Each watch also looks once as it starts (what changed before it was up is
    not lost), and a watch that cannot run (a path that is not UTF-8, a folder
    gone) is replaced by a look every ``poll_s`` until it can. ``look`` is the
    watcher's scan; it asks :meth:`wanted_now` what the watches should follow
    and hands the answer to :meth:`restart_moved`, so that a folder replaced
    under its name, or a link switched, is followed anew.
    """

    def __init__(self, root: Path, config_path: Path, location: StoreURL | None, follow_symlinks: bool,
                 settle_ms: float, poll_s: float, look: Callable[[], Awaitable[object]],
                 stop: asyncio.Event) -> None:
        self.root = root
        self.config_path = config_path
        self.location = location
        self.follow_symlinks = follow_symlinks
        self.settle_ms = settle_ms
        self.poll_s = poll_s
        self._look = look
        self._stop = stop
        self._catch_ups: set[asyncio.Task] = set()
        # The model folders, recursively (with where symlinked model folders lead), and, not recursively, the
        # folders holding nereid.yaml, ml_backends_path, the links on their way and the file nereid.yaml leads
        # to (a replaced ml_backends_path or a switched link shows there, not in the watch of the folder it
        # replaced).
        self._models = Follow(True, self._models_paths, stop) if location is None else None
        self._outer = Follow(False, self._outer_paths, stop)
        self._targets: tuple[Path, ...] = ()  # where symlinked model folders lead, as the models watch follows
        # Where model folder links that lead nowhere yet would lead: their target's arrival is a change (see
        # _outer_paths), which no watch of the target itself can report.
        self._awaited: tuple[Path, ...] = ()
        # The names under which an event of the file nereid.yaml leads to comes (see _outer_paths): a symlinked
        # nereid.yaml's target edited in place sends its events there alone, never by the link's name.
        self._config_files: frozenset[Path] = frozenset()

    async def run(self) -> None:
        """Follow changes until ``stop`` is set."""
        models = self._follow(self._models, self.root) if self._models is not None else self._poll()
        await asyncio.gather(self._guarded(models, self.root if self.location is None else self.location),
                             self._guarded(self._follow(self._outer, self.config_path.parent), self.config_path),
                             *([self._guarded(self._look_every_poll(), "the look at each poll")]
                               if self.location is None else []))

    async def _look_every_poll(self) -> None:
        """Every ``poll_s``, look at the whole tree, as Triton's poll mode scans its repository: a change that sends
        no event to any watch is found within that time. A folder above ml_backends_path (or above a symlinked
        model folder's target) renamed, a release folder swapped with ``mv`` (the old tree served on, for good: a
        hunt); a file written through ``mmap``, or through a hard link from outside the tree, or by another machine
        on a network file system (the reload hunt: the model served its old weights until an unrelated event).
        The look restarts a watch whose paths moved (see :meth:`restart_moved`), and costs a stat of each file:
        a folder's contents are read again only when its stamp changed."""
        while not await self._stopped_within(self.poll_s):
            await self._look()

    def cancel(self) -> None:
        """Cancel the looks that a watch's start scheduled and that have not ended (the watcher stopping): one
        waiting for its turn, or one under way."""
        for task in self._catch_ups:
            task.cancel()

    def wanted_now(self) -> list[tuple[Follow, WatchedPaths]]:
        """What each watch should follow now (blocking)."""
        return [(follow, follow.wanted()) for follow in (self._models, self._outer) if follow is not None]

    def restart_moved(self, wanted: list[tuple[Follow, WatchedPaths]]) -> None:
        """Restart each watch whose paths changed since it started (``wanted``: :meth:`wanted_now`'s answer)."""
        for follow, paths in wanted:
            if follow.current is not None and paths != follow.current and not follow.restart:
                log.info("dynamic repository: following anew (%s)", follow.current.differences(paths))
                follow.restart = True

    async def _guarded(self, watch: Awaitable[None], what: object) -> None:
        """Run one watch; if it ever ends in an error, say so (it used to end without a word)."""
        try:
            await watch
        except Exception as err:
            log.error("dynamic repository: following %s stopped: %s; its changes are no longer acted on "
                      "until a restart", what, describe_error(err))

    async def _stopped_within(self, seconds: float) -> bool:
        """Wait ``seconds``; True if the follower was stopped meanwhile."""
        try:
            await asyncio.wait_for(self._stop.wait(), seconds)
        except TimeoutError:
            return False
        return True

    async def _poll(self) -> None:
        while not await self._stopped_within(self.poll_s):
            await self._look()

    async def _follow(self, follow: Follow, what: Path) -> None:
        """Look after each batch of file events of ``follow`` until stopped.

        When a look finds that what it follows has changed (a folder replaced
        under its name, a link switched, a symlinked model folder added), the
        watch starts again on what is there now. Each time a watch starts, the
        repository is looked at once it is up: what changed before it was
        there is not lost. When the watch cannot run (watchfiles gives up on
        any path that is not UTF-8, or ``what`` went away), it is looked at
        every ``watch_poll_s`` instead, and the watch is tried again after each
        look. The failure is logged once (and again if it changes).
        """
        health = _WatchHealth()
        while not self._stop.is_set():
            follow.restart = False
            health.starts += 1
            # What it resolves to is taken before the watch starts: a swap in between then shows as a change.
            current = follow.current = await on_work_thread_or_here(follow.wanted)
            if follow is self._models:
                self._targets = tuple(path for path in current.paths if path != self.root)
            # This task runs at the watch's first wait, when watchfiles has set up its watches (synchronously, as
            # the iteration starts): a change after that is an event, one before it is found by this look.
            catch_up = asyncio.get_running_loop().create_task(self._catch_up(what, health, health.starts))
            self._catch_ups.add(catch_up)
            catch_up.add_done_callback(self._catch_ups.discard)
            try:
                async for _ in watchfiles.awatch(*current.paths, watch_filter=self.relevant,
                                                 step=EVENT_STEP_MS,
                                                 debounce=max(1600, int(self.settle_ms * MAX_GROUPING_FACTOR)),
                                                 stop_event=follow, recursive=follow.recursive):
                    self._working_again(what, health)  # events arrive: the watch works
                    await self._look()
                if self._stop.is_set():
                    return
                continue  # restarted by a look: on what is there now
            except Exception as err:
                text = describe_error(err)
                if text != health.failure:
                    log.error("dynamic repository: cannot follow %s with file events (%s); looking at it every "
                              "%g s (server.watch_poll_s) instead, until it can%s", what, text, self.poll_s,
                              watch_limit_hint(text))
                # (Before this task next waits: the catch-up look of this start then knows it failed.)
                health.failure, health.failed_start = text, health.starts
            if await self._stopped_within(self.poll_s):
                return
            await self._look()  # what changed while no events came

    async def _catch_up(self, what: Path, health: _WatchHealth, start: int) -> None:
        """The look a watch's ``start`` schedules, run once the watch is set up or has failed; then, when the watch
        had failed before, once this start has stayed up for ``watch_poll_s``, say that file events are followed
        again.

        Not at once: watchfiles may fail after its first wait (a folder named in
        no UTF-8 is met by its thread, later), and a watch said to be followed
        again at each start, then failing, logged an ERROR and an INFO line at
        every poll, for as long as the folder stayed (the long-life hunt).
        """
        await self._look()
        if health.failure is None or await self._stopped_within(self.poll_s):
            return
        if health.starts == start and health.failed_start != start:
            self._working_again(what, health)

    def _working_again(self, what: Path, health: _WatchHealth) -> None:
        """Say, once, that the watch of ``what`` works again after it had failed."""
        if health.failure is not None:
            log.info("dynamic repository: following %s with file events again (they had failed: %s); no longer "
                     "looking at it every %g s", what, health.failure, self.poll_s)
            health.failure = None

    def _models_paths(self) -> WatchedPaths:
        """ml_backends_path and where its symlinked model folders lead (blocking)."""
        return WatchedPaths.of((self.root, *symlinked_folders(self.root, self.follow_symlinks)))

    def _outer_paths(self) -> WatchedPaths:
        """The folders holding nereid.yaml, ml_backends_path, each link on their way and the file nereid.yaml
        leads to, and the nearest folder there on the way to each model folder link's missing target
        (blocking)."""
        ends = [self.config_path] + ([self.root] if self.location is None else [])
        folders = {path.parent for path in ends}
        folders.update(Path(link).parent for end in ends for link in links_on_the_way(end))
        folders.update(self._config_file_folders(folders))
        if self.location is None:
            # A link whose target is not there yet (deployed later, or removed and deployed again) was never loaded
            # once it was: no event came. Its target's arrival shows in the nearest folder that is there (one
            # inside ml_backends_path is in the models watch already, where only the filter hid it).
            self._awaited = awaited_targets(self.root, self.follow_symlinks)
            real_root = os.path.realpath(self.root)
            folders.update(folder for target in self._awaited
                           if (folder := nearest_folder(target)) is not None
                           and not folder.is_relative_to(real_root) and not folder.is_relative_to(self.root))
        return WatchedPaths.of(folder for folder in folders if folder.is_dir())

    def _config_file_folders(self, folders: set[Path]) -> set[Path]:
        """The folders through which the file nereid.yaml leads to is followed, given the ``folders`` watched
        for the links: those of them that are its folder, else its folder itself; sets the names its events
        come by (blocking).

        An edit of a symlinked nereid.yaml's target (in place, ``echo >>``,
        ``touch``) changes neither the link nor its folder: it was never seen
        (found by a bug hunt). inotify reports an event by the path its watch was
        given, so the target's folder watched under another name (a folder on
        the way that is a link) names the file by that name; a second watch of
        the same folder is not added, as it would rename the events of the first.
        Re-pointing a link changes the answer at the look its event brings.
        """
        target = Path(os.path.realpath(self.config_path))
        folder = identity_of(target.parent)
        same = {watched for watched in folders if folder is not None and identity_of(watched) == folder}
        through = same or {target.parent}
        self._config_files = frozenset(watched / target.name for watched in through)
        return through

    def relevant(self, change: watchfiles.Change, path: str) -> bool:
        """Whether a file event at ``path`` counts as a change (watchfiles' filter): not a hidden or editor file
        inside a model folder, except a Kubernetes volume's data link; nereid.yaml, the file it leads to, or a link
        on its way."""
        candidate = Path(path)
        if candidate == self.config_path or candidate in self._config_files:
            return True
        for target in self._awaited:  # a missing link target arriving, or a folder on its way to it
            if candidate == target or target.is_relative_to(candidate):
                return True
            if candidate.is_relative_to(target):
                return not any(ignored_name(part) for part in candidate.relative_to(target).parts)
        # A file of a symlinked model folder comes by the path of where it leads: only the part inside the model
        # folder is judged (a target inside a hidden folder of ml_backends_path, .versions/m-v1, still counts).
        for base in (*self._targets, self.root):
            if candidate.is_relative_to(base):
                parts = candidate.relative_to(base).parts
                # A ConfigMap or Secret mounted as a model folder: its files are links through its ..data link,
                # which an update replaces (nothing else but hidden names changes). A symlinked folder's target
                # is the model folder itself.
                inside = parts[1:] if base == self.root else parts
                return not any(ignored_name(part) for part in parts) or inside == (KUBERNETES_DATA_LINK,)
        # A symlink nereid.yaml or ml_backends_path goes through was replaced (a ConfigMap's ..data swap).
        return path in links_on_the_way(self.config_path) or (
            self.location is None and path in links_on_the_way(self.root))

