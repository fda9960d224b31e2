"""What a model name leaves on this machine once the repository forgets it, removed in the background.

Each model is given a scratch folder under the server's (a binary's link, a
warm parent's folder, a build cache), and a store repository keeps a cached
copy of each folder it fetched. A server fed versioned folder names
(``model-<sha>``) must not keep one of each per name it ever served until it
stops, so both go once nothing uses the name: the repository says which names
are still in use (:class:`FolderCleanup`'s callbacks), this module removes the
rest without holding up the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Coroutine, Iterable

from nereid.backend_calls import on_daemon_thread
from nereid.files import remove_tree
from nereid.storage import drop_mirror_folder

if TYPE_CHECKING:
    from nereid.settings import ServerSettings

log = logging.getLogger(__name__)


# The pauses before a copy that stayed is tried again (see FolderCleanup._drop_mirrors).
MIRROR_DROP_RETRIES_S = (0.25, 1.0)


def _cached(server: ServerSettings, name: str) -> bool:
    """Whether the store folder ``name`` still has a copy in the local mirror."""
    return (Path(server.ml_backends_path) / name).exists()


class FolderCleanup:
    """The scratch folders of one server's models, and the cached copies of its store's folders.

    ``scratch_kept(name)``: whether an entry or a version still finishing its
    requests was given the scratch folder ``name``. ``known_names()``: the names
    the repository knows (its entries and those versions), safe to call off
    the event loop. ``in_background(work, what)``: runs work as the
    repository's background work (awaited at its shutdown).
    """

    def __init__(self, scratch_dir: Path, scratch_kept: Callable[[str], bool], known_names: Callable[[], set[str]],
                 in_background: Callable[[Coroutine[object, object, None], str], object]) -> None:
        self.scratch_dir = scratch_dir
        self._scratch_kept = scratch_kept
        self._known_names = known_names
        self._in_background = in_background
        # Names whose cached copy is being removed, on a daemon thread each (see drop_mirrors_soon): one removal
        # per name at a time.
        self._mirror_drops: set[str] = set()
        self._mirror_drops_lock = threading.Lock()

    def drop_empty_scratch(self, name: str) -> None:
        """Remove the scratch folder ``name`` if it is empty (a model moved away in place left nothing there)."""
        try:
            (self.scratch_dir / name).rmdir()
        except OSError:
            pass

    def drop_scratch_soon(self, names: set[str]) -> None:
        """:meth:`drop_scratch` as background work, for a caller that cannot wait (a rescan)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # a rescan outside any event loop (a script, after asyncio.run): nothing runs
            asyncio.run(self.drop_scratch(names))
            return
        self._in_background(self.drop_scratch(names), "dropping the scratch folders of forgotten models")

    async def drop_scratch(self, names: set[str] | frozenset[str]) -> None:
        """Remove the scratch folders ``names`` (those of a forgotten entry or a released version) that nothing
        uses.

        One an entry was given stays: a model renamed away from this name in
        place still runs from what it made there (a new folder under the old
        name shares it). So does one an old version still finishing its
        requests was given: it is removed once that version is released.
        The folder is moved aside on the event loop, right after that check,
        and deleted on a thread (a big one would stall every RPC): an entry
        given the same name from then on makes a fresh folder, never one
        half deleted.
        """
        for name in sorted(names):
            if self._scratch_kept(name):
                continue
            doomed = self.scratch_dir / f".dropped-{uuid.uuid4().hex}"  # (no model name starts with ".")
            try:
                (self.scratch_dir / name).rename(doomed)
            except FileNotFoundError:  # never made, or dropped already
                continue
            except OSError as err:
                log.warning("model '%s': cannot remove its scratch folder: %s", name, err)
                continue
            # (What its runs left in it too: read-only folders, a tree deeper than rmtree's recursion.)
            await on_daemon_thread(functools.partial(remove_tree, doomed), f"nereid-drop-scratch-{name}")

    def drop_mirrors_soon(self, server: ServerSettings, names: Iterable[str]) -> None:
        """Remove the cached copies of the store folders ``names`` that the repository does not know (no entry,
        no old version finishing its requests), on a daemon thread (never waited for: a hanging store must not
        hold up a shutdown). Nothing to do for a local ``ml_backends_path``.

        Each is removed only once the store confirms its prefix is gone and
        no server sharing cache_dir is fetching it (its lock is free): see
        :func:`nereid.storage.drop_mirror_folder`. One that stays (the store
        could not say, another server was fetching it) is tried again after
        the next listing.
        """
        if server.ml_backends_url is None:
            return
        known = self._known_names()
        with self._mirror_drops_lock:
            names = sorted(set(names) - known - self._mirror_drops)
            self._mirror_drops.update(names)
        if names:
            threading.Thread(target=self._drop_mirrors, args=(server, names), name="nereid-drop-mirror",
                             daemon=True).start()

    def _drop_mirrors(self, server: ServerSettings, names: list[str]) -> None:
        """:meth:`drop_mirrors_soon`'s thread. A copy that stays is tried again a moment later, a few times: the
        prune a version's release starts takes the folder's lock as a removal does, neither waiting, so a copy
        forgotten as its last version was released stayed until the next listing (none, without a client)."""
        try:
            left = list(names)
            for pause_s in (*MIRROR_DROP_RETRIES_S, None):
                # (Known again: a load of the name may have started meanwhile.)
                left = [name for name in left if name not in self._known_names()
                        and not drop_mirror_folder(server, name) and _cached(server, name)]
                if not left or pause_s is None:
                    break
                time.sleep(pause_s)
        except Exception:  # a thread of its own: nothing above it would report it
            log.exception("removing the cached copies of store folders %s failed", names)
        finally:
            with self._mirror_drops_lock:
                self._mirror_drops.difference_update(names)
