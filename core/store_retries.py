"""Dynamic mode over an object store: loads the store failed, tried again at later polls, ever less often.

A folder whose load (or reload) the store failed (objects refused or gone at
fetch, a listing that failed) is tried again after ``watch_poll_s``, then twice
as long after each failure, up to :data:`STORE_RETRY_CAP_S` (or
``watch_poll_s``, if longer), until it loads or its objects change. The first
failure is a WARNING, and so is one for another reason than the last; a try
that fails as the last one did is DEBUG (a key the local disk cannot hold
fails every 5 minutes for ever). The watcher (:mod:`nereid.watch`) decides
when a folder is due; this module keeps the count and the backoff.

Without a watcher, one listing is tried again the same way (:class:`StartupListing`): a store that could not be
listed at start with no ``models:`` key, where the server would otherwise be ready serving nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping

from nereid.folder_states import FolderState
from nereid.storage import failure_kind

log = logging.getLogger("nereid.watch")  # (the watcher's lines, as an operator follows them)

# An outage of an hour costs a dozen tries, not 360.
STORE_RETRY_CAP_S = 300.0


@dataclass(frozen=True)
class StoreRetry:
    """A store's folder whose load the store failed in this state: the wait before its next try, how many
    of its tries the store failed, and the last one's reason (its :func:`~nereid.storage.failure_kind`)."""

    state: FolderState
    delay_s: float
    failures: int
    reason: str


class StoreRetries:
    """The folders whose last load the store failed, by name, each with its backoff."""

    def __init__(self, poll_s: float) -> None:
        # watch_poll_s, fixed for the watcher's life: an edit of nereid.yaml's server: section needs a restart.
        self.poll_s = poll_s
        self._retries: dict[str, StoreRetry] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._retries

    def get(self, name: str) -> StoreRetry | None:
        """The retry of ``name``, if the store failed its last load."""
        return self._retries.get(name)

    def forget(self, name: str) -> StoreRetry | None:
        """Stop trying ``name`` again (it loaded, failed for its own fault, or is no longer wanted)."""
        return self._retries.pop(name, None)

    def forget_changed(self, current: Mapping[str, FolderState]) -> None:
        """Forget the folders changed or gone since the store failed them: a change is a new start, if any."""
        for name in [name for name, retry in self._retries.items() if current.get(name) != retry.state]:
            del self._retries[name]

    def failed(self, name: str, state: FolderState, fault: str, reloading: bool) -> StoreRetry:
        """The store failed the load (``reloading``: the reload) of ``name`` seen in ``state``, for the reason
        ``fault``: count it, log it, and return when to try again."""
        cap_s = max(self.poll_s, STORE_RETRY_CAP_S)
        last = self._retries.get(name)
        kind = failure_kind(fault)
        if last is None:
            retry = StoreRetry(state, self.poll_s, 1, kind)
            log.warning("dynamic repository: folder '%s' did not %s because of the store (%s); trying again in "
                        "%g s, then less often (at most every %g s), until it loads or its objects change", name,
                        "reload" if reloading else "load", fault, retry.delay_s, cap_s)
        else:
            retry = StoreRetry(state, min(last.delay_s * 2, cap_s), last.failures + 1, kind)
            level = logging.DEBUG if kind == last.reason else logging.WARNING
            log.log(level, "dynamic repository: folder '%s': the store failed it again%s (%s); trying again in %g s",
                    name, "" if level == logging.DEBUG else ", for another reason", fault, retry.delay_s)
        self._retries[name] = retry
        return retry


# A server whose store could not be listed at start, with no models: key, would serve nothing: it lists the store
# again after STARTUP_LISTING_FIRST_S, then twice as long after each failure, at most every STARTUP_LISTING_CAP_S.
# Shorter than a load's cap: the server is not ready meanwhile, and one listing costs the store little.
STARTUP_LISTING_FIRST_S = 1.0
STARTUP_LISTING_CAP_S = 30.0


class StartupListing:
    """The listing of a store's model folders that failed at start (no ``models:`` key, no ``server.watch``):
    the wait before its next try and how many were made, logged as the store's load failures are (the first
    failure and one for another reason at WARNING, one that fails as the last did at DEBUG)."""

    def __init__(self, url: str, failure: Exception) -> None:
        self.url = url
        self.delay_s = STARTUP_LISTING_FIRST_S
        self.tries = 1
        self._kind = failure_kind(str(failure))
        # (The repository has logged the store's error, at ERROR.)
        _startup_log.warning("%s: the server is not ready until its model folders can be listed: listing them again "
                             "in %g s, then less often (at most every %g s); every folder found then loads, as at "
                             "start", url, self.delay_s, max(STARTUP_LISTING_CAP_S, STARTUP_LISTING_FIRST_S))

    def failed(self, failure: Exception) -> float:
        """Another try failed with ``failure``: count and log it; returns the wait before the next one."""
        self.tries += 1
        self.delay_s = min(self.delay_s * 2, max(STARTUP_LISTING_CAP_S, STARTUP_LISTING_FIRST_S))
        kind = failure_kind(str(failure))
        level = logging.DEBUG if kind == self._kind else logging.WARNING
        self._kind = kind
        _startup_log.log(level, "%s; the server is still not ready (its model folders cannot be listed%s): listing "
                         "them again in %g s", failure, "" if level == logging.DEBUG else ", for another reason",
                         self.delay_s)
        return self.delay_s


_startup_log = logging.getLogger("nereid.repository")
