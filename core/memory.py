"""Handing freed heap memory back to the operating system after very large requests; the address-space limit
that messages about memory name.

gRPC's C core receives a message into many small buffers and copies it twice
before Python sees it. Those buffers come from the C heap, and glibc keeps freed
heap pages mapped: after one rejected 1 GiB request the process stayed gigabytes
larger than before. ``malloc_trim`` returns them. Elsewhere (musl, macOS) it is
absent and this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import resource

log = logging.getLogger(__name__)


def address_space_limit_mib() -> int | None:
    """The process's address-space limit (``ulimit -v``, RLIMIT_AS) in MiB, None when it has none.

    Under it, a thread's stack or a library's mapping fails long before memory is short: messages about a
    refused thread or a MemoryError name it, where they named only the usual causes (the deploy hunt)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY else soft >> 20


# Requests at least this large are followed by a trim (smaller ones are not worth the call).
TRIM_AFTER_BYTES = 32 << 20


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None)
    except OSError:
        return None


def release_free_heap() -> bool:
    """Return freed C-heap pages to the OS (blocking for a few ms: call it off the event loop).

    True when the C library could do it.
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
