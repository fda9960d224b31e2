"""When a changed folder is acted on: once it has looked the same for the settle time.

Files are copied into a model folder one by one, so dynamic mode acts on a
change only once the folder has looked the same for ``server.watch_settle_ms``.
A transfer that writes each file under a hidden temporary name (rsync's
``.name.XXXXXX``) makes no event that counts while a large file fills, so a
folder with a hidden file written just now waits longer. Pure bookkeeping over
states and times: the watcher scans and says when; nothing here reads a file.
"""

from __future__ import annotations

import time
from typing import AbstractSet, Iterator, Mapping

from nereid.folder_states import FolderState

MAX_GROUPING_FACTOR = 20  # changes that never stop are still acted on after this many settle times


class SettlingFolders:
    """The folders seen changed and not yet acted on: the state each was last seen in, since when, and how
    long a transfer still holds it."""

    def __init__(self, settle_s: float) -> None:
        self.settle_s = settle_s
        self._seen: dict[str, tuple[FolderState | None, float]] = {}  # name -> (state, seen so since)
        self._busy_until: dict[str, float] = {}  # settled, but a hidden file in it was written just now

    def __contains__(self, name: object) -> bool:
        return name in self._seen

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._seen))

    def __len__(self) -> int:
        return len(self._seen)

    def state(self, name: str) -> FolderState | None:
        """The state the folder ``name``, settling, was last seen in (None: gone; KeyError: not settling)."""
        return self._seen[name][0]

    def settled(self, name: str, state: FolderState | None, now: float) -> bool:
        """Whether the folder ``name``, seen in ``state`` (None: gone) at ``now``, is due to be acted on.

        A state not seen before, or different from the last one, starts its
        settle time again. A folder unchanged for the settle time waits longer
        while a hidden file in it was written less than the settle time ago,
        unless it has waited :data:`MAX_GROUPING_FACTOR` settle times already.
        A folder found due stays settling until :meth:`done`.
        """
        seen = self._seen.get(name)
        if seen is None or seen[0] != state:
            self._seen[name] = (state, now)
            self._busy_until.pop(name, None)
            return False
        waited_s = now - seen[1]
        if waited_s < self.settle_s:
            return False
        busy_s = self._transfer_wait_s(state, waited_s)
        if busy_s > 0:
            self._busy_until[name] = now + busy_s
            return False
        return True

    def done(self, name: str) -> None:
        """The folder ``name`` was acted on (or is known as it is): no longer settling."""
        self._seen.pop(name, None)
        self._busy_until.pop(name, None)

    def drop_undone(self, known: Mapping[str, FolderState], current: Mapping[str, FolderState]) -> list[str]:
        """Stop waiting for the folders back in the state ``known`` for them (a change undone before it
        settled), as ``current`` shows them; returns their names."""
        undone = [name for name in self._seen if known.get(name) == current.get(name)]
        for name in undone:
            self.done(name)
        return undone

    def due_at(self, name: str, state: FolderState, when: float) -> None:
        """Hold the folder ``name`` settling in ``state`` until ``when`` (a monotonic time): the scan after that
        acts on it (a load the store failed, tried again after a backoff)."""
        self._seen[name] = (state, when - self.settle_s)
        self._busy_until.pop(name, None)

    def next_due(self, held: AbstractSet[str] = frozenset()) -> float | None:
        """When the first folder settling, not one of ``held`` (waiting for something else), is due (a monotonic
        time; None: none settles)."""
        return min((max(since + self.settle_s, self._busy_until.get(name, 0.0))
                    for name, (_, since) in self._seen.items() if name not in held), default=None)

    def _transfer_wait_s(self, state: FolderState | None, waited_s: float) -> float:
        """How much longer a folder unchanged for ``waited_s`` waits because a hidden file in it was written just
        now (0: none)."""
        if state is None or not state.hidden_mtime_ns or waited_s >= self.settle_s * MAX_GROUPING_FACTOR:
            return 0.0
        age_s = (time.time_ns() - state.hidden_mtime_ns) / 1e9
        return min(self.settle_s, max(0.0, self.settle_s - age_s))
