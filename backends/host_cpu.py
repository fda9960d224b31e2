"""This machine's CPU as native compilers target it: what keys a build for this host's instruction set.

Both the xla backend's executables (``.cache/``) and the cpp backend's
``-march=native`` builds are made for the CPU they were compiled on, and
neither loader refuses one made for another: a cached build copied from a
more capable machine (baked into an image, shared over NFS) ends its first
run with SIGILL. Each keys its builds by :func:`host_cpu`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import platform


@functools.cache
def host_cpu() -> str:
    """A digest of this machine's CPU as XLA's CPU compiler targets it (the model and its feature flags, from
    /proc/cpuinfo; the machine and processor elsewhere).

    XLA compiles for the host's own instruction set (AVX-512, AMX, ...) and
    jaxlib loads an executable built for another without refusing it (it only
    prints that this "could lead to execution errors such as SIGILL"): an
    entry made on a more capable machine, in a bundle folder baked into an
    image or shared over NFS, would end the server at its first request (a
    bug hunt). Keyed by the CPU, each kind of machine has entries of its own.
    """
    described = ""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            lines = {}
            for line in info:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("vendor_id", "model name", "flags", "Features", "CPU implementer", "CPU part"):
                    lines.setdefault(key, " ".join(sorted(value.split())) if key in ("flags", "Features")
                                     else value.strip())
                elif not line.strip() and lines:
                    break  # (the first processor's: the others are the same machine's)
            described = repr(sorted(lines.items()))
    if not described:
        described = f"{platform.machine()} {platform.processor()}"
    return hashlib.sha256(described.encode()).hexdigest()[:16]
