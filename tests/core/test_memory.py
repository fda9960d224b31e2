"""The C heap: freed pages handed back after very large requests."""

from __future__ import annotations

import os
import sys

from nereid.memory import release_free_heap


def test_free_heap_is_handed_back_where_the_c_library_can():
    glibc = sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION") is not None
    assert release_free_heap() is glibc
