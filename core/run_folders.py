"""A run's own folder (its TMPDIR): private, short, and the same length whatever the model is called.

Each run of a python or cpp model gets a fresh folder, mode 0700, removed
after the run. Programs make AF_UNIX sockets in TMPDIR (multiprocessing's
forkserver and ``Manager()``: ``pymp-XXXXXXXX/listener-XXXXXXXX``), whose path
holds at most 107 bytes: a TMPDIR that named the model
(``<scratch>/<model>/run-<32 hex>``) left no room for one under a model name
of 13 characters or more. So the runs of every model share one folder of the
server's scratch folder, :data:`RUNS_FOLDER`, each under a 12-hex-digit name:
``<TMPDIR>/nereid-<pid>-<8>/.r/<12 hex>``, at most 40 bytes past the server's
TMPDIR. A python model's warm parent has such a folder too, its TMPDIR the
``tmp`` folder in it (its preloaded imports make sockets as runs do). The
server's stop removes it with the scratch folder, a later start removes a dead
server's.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from nereid.leftovers import make_private_folder

log = logging.getLogger(__name__)

# In a scratch folder: where its runs' folders are made ("."-named: no model's scratch folder has such a name).
RUNS_FOLDER = ".r"
# A run folder's name: this many random bytes, in hex (48 bits; a name taken already is drawn again).
RUN_NAME_BYTES = 6
# The longest path an AF_UNIX socket may have (sun_path's 108 bytes, less its NUL).
AF_UNIX_PATH_MAX = 107
# What multiprocessing puts under TMPDIR for its sockets: "/pymp-XXXXXXXX/listener-XXXXXXXX".
MULTIPROCESSING_SOCKET_BYTES = 32
# A python model's warm parent has its run folder's "/tmp" as TMPDIR: its preloaded imports' sockets go there.
WARM_PARENT_TMPDIR_EXTRA = 4
# The room a run's TMPDIR must leave, exactly: a run's TMPDIR that leaves less is said at start. (It was 40, "a
# little more" than the sockets' 32: the WARNING said runs "will fail" for server TMPDIRs of 30-37 bytes, whose runs
# all made their sockets; the deploy hunt.)
SOCKET_ROOM = MULTIPROCESSING_SOCKET_BYTES + WARM_PARENT_TMPDIR_EXTRA


def runs_folder(scratch_dir: Path) -> Path:
    """Where the runs of the server whose scratch folder is ``scratch_dir`` have their folders."""
    return scratch_dir / RUNS_FOLDER


def make_run_folder(parent: Path) -> Path:
    """A new folder (mode 0700) of a short random name in ``parent``, for one run; ``parent`` and the folders
    above it are made again (0700) if a /tmp cleaner removed them (see :func:`make_private_folder`)."""
    while True:
        folder = parent / os.urandom(RUN_NAME_BYTES).hex()
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:  # (another run's: a fresh name; never a folder two runs share)
            continue
        except FileNotFoundError:
            make_private_folder(parent)
            continue
        return folder


def longest_run_folder(parent: Path) -> Path:
    """A path as long as any :func:`make_run_folder` makes in ``parent`` (for bounds computed at load)."""
    return parent / ("0" * 2 * RUN_NAME_BYTES)


def warn_if_sockets_cannot_fit(scratch_dir: Path) -> None:
    """Log a WARNING when the runs' TMPDIR in ``scratch_dir`` (the server's scratch folder, in the server's
    TMPDIR) is too long for the AF_UNIX sockets programs make under it, saying how long TMPDIR may be."""
    tmpdir = len(os.fsencode(str(longest_run_folder(runs_folder(scratch_dir)))))
    if tmpdir + SOCKET_ROOM <= AF_UNIX_PATH_MAX:
        return
    server_tmpdir = scratch_dir.parent
    allowed = AF_UNIX_PATH_MAX - SOCKET_ROOM - (tmpdir - len(os.fsencode(str(server_tmpdir))))
    where = ("" if tmpdir + MULTIPROCESSING_SOCKET_BYTES > AF_UNIX_PATH_MAX
             else " in a warm parent's preloaded imports (its TMPDIR is the run folder's /tmp; runs still fit)")
    log.warning("a run's TMPDIR (%s/<12 hex digits>) is %d bytes, too long for the AF_UNIX sockets programs make "
                "under it (at most %d bytes a path): a python model's multiprocessing forkserver or Manager() will "
                "fail%s (OSError: AF_UNIX path too long); set the server's TMPDIR (now %s, %d bytes) to a folder of "
                "at most %d bytes", runs_folder(scratch_dir), tmpdir, AF_UNIX_PATH_MAX, where, server_tmpdir,
                len(os.fsencode(str(server_tmpdir))), max(allowed, 1))
