"""A warning when the process runs short of file descriptors, which no listener says for itself.

gRPC's core only logs a listener that cannot accept for want of descriptors
("File descriptor limit reached. Retrying."), and nereid silences its logs
(GRPC_VERBOSITY=NONE: a TLS client could otherwise write lines into the log at
will), so that a gRPC port refusing every new client said nothing at all. A
daemon thread looks every few seconds at how many descriptors are open against
the soft limit and says so, once as the count crosses a threshold and once as
it falls back.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import threading
from typing import Callable

from nereid.daemon_pool import start_daemon_thread

log = logging.getLogger("nereid.server")

LOOK_EVERY_S = 5.0
SHORT_FRACTION = 0.9  # of the soft limit: past it, the next clients may be refused


def open_descriptors() -> int:
    """How many file descriptors this process has open (the listing's own left out); at the limit, the listing
    cannot open one: EMFILE, taken as the limit itself."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1
    except OSError as err:
        if err.errno in (errno.EMFILE, errno.ENFILE):
            return descriptor_limit()
        raise


def descriptor_limit() -> int:
    """The soft limit on this process's open file descriptors."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


class DescriptorWatch:
    """Logs a WARNING when open descriptors pass :data:`SHORT_FRACTION` of the limit, and an INFO when they fall
    back below it; see the module's docstring."""

    def __init__(self, look_every_s: float = LOOK_EVERY_S, count: Callable[[], int] = open_descriptors,
                 limit: Callable[[], int] = descriptor_limit) -> None:
        self._look_every_s = look_every_s
        self._count, self._limit = count, limit
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self.short = False  # whether the last look found descriptors short

    def start(self) -> None:
        """Start looking, on a daemon thread of its own."""
        self._thread = start_daemon_thread(self._watch, "nereid-descriptor-watch")

    def stop(self) -> None:
        """Stop looking (the thread ends within one look)."""
        self._stopped.set()

    def look(self) -> None:
        """One look: say a crossing of the threshold, either way."""
        try:
            count, limit = self._count(), self._limit()
        except OSError:  # (no /proc: nothing to watch)
            return
        short = limit > 0 and count >= SHORT_FRACTION * limit
        if short and not self.short:
            log.warning("%d file descriptors open of the limit of %d: new connections (gRPC's, HTTP's) and model "
                        "runs may be refused until some close; raise the limit (ulimit -n, the container's "
                        "nofile) if this is the load the server is meant to take", count, limit)
        elif self.short and not short:
            log.info("file descriptors back to %d of the limit of %d", count, limit)
        self.short = short

    def _watch(self) -> None:
        while not self._stopped.wait(self._look_every_s):
            self.look()
