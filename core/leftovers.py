"""Files that a killed nereid process left behind, recognised by the process id in their names.

A server SIGKILLed (or out of memory) never runs its clean-up: its scratch
folder (``nereid-<pid>-*`` in the temporary directory) and half-written build
outputs (``*.<pid>.partial``) stay. The next start removes those whose process
is gone; a live process's files are never touched.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

SCRATCH_PREFIX = "nereid-"
_SCRATCH = re.compile(rf"^{SCRATCH_PREFIX}(\d+)-")
_PARTIAL = re.compile(r"\.(\d+)\.partial$")


def scratch_prefix() -> str:
    """The prefix of this process's scratch folder: ``nereid-<pid>-``."""
    return f"{SCRATCH_PREFIX}{os.getpid()}-"


def process_alive(pid: int) -> bool:
    """True when a process with this id exists (another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_scratch(parent: Path) -> int:
    """Remove the scratch folders of nereid processes that no longer run; returns how many."""
    removed = 0
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return 0
    for entry in entries:
        match = _SCRATCH.match(entry.name)
        if match and entry.is_dir(follow_symlinks=False) and not process_alive(int(match.group(1))):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed += 1
    if removed:
        log.info("removed %d scratch folder(s) left by nereid processes that no longer run", removed)
    return removed


def remove_stale_partials(folder: Path) -> int:
    """Remove ``*.<pid>.partial`` files in ``folder`` whose writing process no longer runs; returns how many."""
    removed = 0
    for path in folder.glob("*.partial"):
        match = _PARTIAL.search(path.name)
        if match and not process_alive(int(match.group(1))):
            path.unlink(missing_ok=True)
            removed += 1
    return removed
