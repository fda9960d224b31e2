"""Pausing Python's cyclic garbage collector, which is process-wide, from several threads at once.

The collector is paused around work that must not meet a collection: reading other threads' frames (a collection
there can deadlock the process on Python 3.11, see :func:`nereid.loop_watch.current_frames`), or a large decode
that would otherwise trigger collection after collection. Each part that pauses it turning it back on as it ends
would turn it on under another still relying on the pause; here the last pause to end turns it back on, and only
if it was on when the first began.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator

_lock = threading.Lock()
_pauses = 0  # pauses under way, all threads together
_resume = False  # whether the collector was on when the first of them began


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Run the body with the collector off; on again once the last pause ends, if it was on before the first."""
    global _pauses, _resume
    with _lock:
        if _pauses == 0:
            _resume = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _lock:
            _pauses -= 1
            if _pauses == 0 and _resume:
                gc.enable()
