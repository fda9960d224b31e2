"""Handing freed heap memory back to the operating system after very large requests.

gRPC's C core receives a message into many small buffers and copies it twice
before Python sees it. Those buffers come from the C heap, and glibc keeps freed
heap pages mapped: after one rejected 1 GiB request the process stayed gigabytes
larger than before. ``malloc_trim`` returns them. Elsewhere (musl, macOS) it is
absent and this does nothing.

Large blocks are also kept out of glibc's per-thread arenas from the start (see
:func:`pin_mmap_threshold`), whose free tops ``malloc_trim`` never returns.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

log = logging.getLogger(__name__)

# Requests at least this large are followed by a trim (smaller ones are not worth the call).
TRIM_AFTER_BYTES = 32 << 20


# glibc's <malloc.h>: mallopt's parameter for the size from which a block is mmapped of its own.
M_MMAP_THRESHOLD = -3
# Blocks this large or larger are mmapped, and unmapped when freed (glibc's own default starting value is 128 KiB,
# raised at run time up to 32 MiB on 64-bit systems).
MMAP_THRESHOLD_BYTES = 1 << 20
# The operator's own glibc tuning, which a fixed threshold would override: left alone when any is set.
GLIBC_TUNING_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX",
                          "GLIBC_TUNABLES")


@functools.cache
def _libc_function(name: str):
    """A function of the C library (None: no such library or function, as on musl for some)."""
    library = ctypes.util.find_library("c")
    if library is None:
        return None
    try:
        return getattr(ctypes.CDLL(library), name, None)
    except OSError:
        return None


def pin_mmap_threshold() -> bool:
    """Have every block of 1 MiB or more mmapped, and given back to the system when freed. Call it once, before
    the server's threads start; True when the C library took it.

    glibc raises its mmap threshold to the size of each large block freed, after which blocks of that size come
    from the allocating thread's arena, whose free top stays mapped (``malloc_trim`` trims only the main
    arena's). A model's output (read on its instance's thread) is such a block, and a reload gives the model new
    threads, which land in the next of glibc's 8 x cores arenas: the server grew by one output per reload under
    traffic, up to that many arenas (150 MiB here; gigabytes on a large host), though the memory in use stayed
    flat (the memory hunt). A fixed threshold turns the raising off. Not when the operator tuned glibc's
    allocator in the environment (their setting stands).
    """
    if any(variable in os.environ for variable in GLIBC_TUNING_VARIABLES):
        return False
    mallopt = _libc_function("mallopt")
    return bool(mallopt is not None and mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def release_free_heap() -> bool:
    """Return freed C-heap pages to the OS (blocking for a few ms: call it off the event loop).

    True when the C library could do it.
    """
    trim = _libc_function("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True
