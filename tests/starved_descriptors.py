"""Runs made with few file descriptors left, under a real open-file limit (imported by subprocess scripts)."""

from __future__ import annotations

import errno
import os
import resource
from typing import Callable


def runs_short_of_descriptors(run: Callable[[], int], most_free: int) -> list[list[object]]:
    """Lower this process's open-file limit to 64 and, for each number of free descriptors from 0 to
    ``most_free`` (all others held open), call ``run`` once; ``[free, returncode or errno name, descriptors left
    open after it beyond those at rest]`` each."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    at_rest = len(os.listdir("/proc/self/fd"))
    outcomes: list[list[object]] = []
    for free in range(most_free + 1):
        held = []
        try:
            while True:
                held.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
        except OSError:
            pass
        for _ in range(free):
            os.close(held.pop())
        try:
            outcome: object = run()
        except OSError as err:
            outcome = errno.errorcode[err.errno]
        for fd in held:
            os.close(fd)
        outcomes.append([free, outcome, len(os.listdir("/proc/self/fd")) - at_rest])
    return outcomes
