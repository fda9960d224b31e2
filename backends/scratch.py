"""What a backend checks before it puts a program into the server's scratch folder, and its error when it cannot.

The cpp and python backends put a model's program (or a link to it) there,
and cxx copies its shared library there: a file system mounted noexec, or one
that is full, must make the model UNAVAILABLE with a reason that names the
folder and TMPDIR, rather than fail every request later.
"""

from __future__ import annotations

import os
from pathlib import Path

from nereid.errors import ConfigError


def require_executable_folder(model: str, folder: Path, what: str) -> None:
    """ConfigError naming ``model`` when ``folder`` (in the server's scratch folder) is on a file system mounted
    noexec, where files can be written but never run (nor mapped as code by dlopen).

    ``what`` says what would run from there, in the words before the folder: "its binary runs from".
    Hardened containers and hosts often mount /tmp noexec: checked at load, such a model is UNAVAILABLE
    saying so, instead of loading READY and failing every request with "Permission denied" (cpp), or
    failing to dlopen with a message about a file elsewhere (cxx). A folder that cannot be looked at is
    let through: what writes into it next fails, naming it.
    """
    try:
        flags = os.statvfs(folder).f_flag
    except OSError:
        return
    if flags & getattr(os, "ST_NOEXEC", 0):  # (Linux's flag; elsewhere nothing is known, so nothing is refused)
        raise ConfigError(f"model '{model}': {what} the server's scratch folder {folder}, which is on a file "
                          "system mounted noexec, where nothing may run; set TMPDIR to a folder on a file system "
                          "that allows executables (the server makes its scratch folder in TMPDIR)")


def scratch_folder_refused(model: str, what: str, scratch_dir: Path, err: OSError) -> ConfigError:
    """The load's error when the server's scratch folder refuses a write (a full disk, a file size limit):
    ``what`` the model could not do, in the words before the folder ("put its binary PATH into"), and why."""
    return ConfigError(f"model '{model}': cannot {what} the server's scratch folder {scratch_dir}: "
                       f"{err.strerror or err} (the server makes its scratch folder in TMPDIR)")


# Below this much free space, a failed run's file system is called full: the write that failed may have asked for
# more than was left, so the space left need not be zero.
NEARLY_FULL_BYTES = 1 << 20


def full_scratch_hint(folder: Path) -> str:
    """``"; the file system of ... is full ..."`` for the failure of a run whose folder ``folder`` (its
    NEREID_OUTPUT_PATH's and its TMPDIR's, in the server's scratch folder) lies on a file system without space or
    inodes left for the server's user; "" otherwise, or when it cannot be looked at.

    A run whose writes failed on a full disk says only how it ended (a program's own exit code, a missing or
    short output file): the deploy hunt's full /tmp made the cpp example say "exited with code 4" and no more.
    Looked at only once a run failed.
    """
    try:
        fs = os.statvfs(folder)
    except OSError:
        return ""
    root = os.geteuid() == 0  # (root may use the blocks a file system reserves)
    free = (fs.f_bfree if root else fs.f_bavail) * fs.f_frsize
    inodes = fs.f_ffree if root else fs.f_favail
    if free >= NEARLY_FULL_BYTES and (inodes > 0 or fs.f_files == 0):  # (f_files 0: no inode count kept)
        return ""
    left = "no inodes left" if free >= NEARLY_FULL_BYTES else f"{free >> 10} KiB left"
    return (f"; the file system of the server's scratch folder is full ({left}), and this run's output file "
            f"(NEREID_OUTPUT_PATH) and TMPDIR are there, in {folder.parent}: free space there, or set TMPDIR to a "
            "folder with room (the server makes its scratch folder in TMPDIR)")
