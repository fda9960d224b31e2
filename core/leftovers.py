"""Files that a killed nereid process left behind: removed at the next start, a live process's never.

A server SIGKILLed (or out of memory) never runs its clean-up: its scratch
folder (``nereid-<pid>-*`` in the temporary directory) and half-written build
outputs (``*.<pid>.partial``) stay. The next start removes those whose owner is
gone. A scratch folder's owner holds advisory locks on the folder itself and
on a file in it for its whole life (the kernel releases them when the process
ends, however it ends): a process id says nothing across PID namespaces (two
containers sharing a temporary directory each have a pid 7), a lock does. The
folder's own lock is asked first: a /tmp cleaner's age rule removes the file
(never touched after it is made), and the file's lock with it; the file stays
for older nereid versions, which look only at it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import signal
import tempfile
import time
from pathlib import Path

from nereid.files import remove_tree

log = logging.getLogger(__name__)

SCRATCH_PREFIX = "nereid-"
_SCRATCH = re.compile(rf"^{SCRATCH_PREFIX}(\d+)-")
_PARTIAL = re.compile(r"\.(\d+)\.partial$")
OWNER_LOCK = ".owner.lock"  # in a scratch folder: locked by its owner for as long as it runs
# A folder changed this recently is left alone: its owner may be between creating it and taking its lock.
SETTLED_S = 60.0
# This process's scratch folders, each with the descriptors it holds locked: OWNER_LOCK's, and the folder's own
# (absent where the folder cannot be locked: flock on a directory on NFS, say).
_held: dict[Path, tuple[int, ...]] = {}


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


class ScratchFolderError(OSError):
    """The scratch folder cannot be made in the TMPDIR the operator set; ``str()`` names it and says why."""


def make_scratch_folder(kind: str = "") -> Path:
    """A new scratch folder ``nereid-<pid>-<kind>*`` in the temporary directory, locked as this process's.

    Give it back with :func:`remove_scratch_folder`; one left by a process that
    was killed is removed by the next server start. ScratchFolderError when
    TMPDIR is set but cannot be used (see :func:`scratch_parent`).
    """
    folder = Path(tempfile.mkdtemp(prefix=f"{scratch_prefix()}{kind}", dir=scratch_parent()))
    refusal = _umask_refusal(folder)
    if refusal is not None:
        os.rmdir(folder)
        raise ScratchFolderError(refusal)
    _hold_lock(folder)
    return folder


def _umask_refusal(folder: Path) -> str | None:
    """Why the server's user cannot use ``folder``, just made (mode 0700 less the umask), when the umask took its
    own read, write or search permission (``umask 0277``); None when it can.

    Everything the server makes (the folder's .owner.lock, every run's folder)
    would then fail, and the first failure said only ``Permission denied:
    .../.owner.lock`` (the deployment hunt). Root, whom permission bits do not
    stop, is never refused.
    """
    if os.access(folder, os.R_OK | os.W_OK | os.X_OK):
        return None
    mode = folder.stat().st_mode & 0o777
    umask = _umask_text() or f"one masking {0o700 & ~mode:04o}"
    return (f"the server's umask ({umask}) takes its own user's permissions from the folders and files it makes: "
            f"its scratch folder {folder} was made mode {mode:04o}, where it writes its lock file ({OWNER_LOCK}) "
            "and each model's run folders; start it under a umask that leaves the owner read, write and search "
            "permission (umask 0077, or 0022)")


def _umask_text() -> str | None:
    """This process's umask as ``0277``, read from /proc (setting it to read it is not safe beside other threads);
    None where /proc does not say it."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def scratch_parent() -> Path:
    """The temporary directory, where scratch folders are made: TMPDIR, else /tmp (``tempfile.gettempdir()``).

    Python's tempfile tries TMPDIR with a small write and, when that fails (a
    full disk, a folder that is not there or not writable), silently takes the
    next candidate: /tmp, /var/tmp, the working directory. That may be the very
    folder the operator set TMPDIR to avoid (mounted noexec, where cpp and cxx
    models cannot run; or small), so a TMPDIR passed over is a
    ScratchFolderError naming it and why, as the server starts. With TMPDIR not
    set, /tmp passed over is a WARNING naming the folder used instead (a
    container without a usable /tmp served before, from that folder).
    """
    chosen = os.environ.get("TMPDIR")
    asked = str(asked_temporary_directory())
    try:
        used = tempfile.gettempdir()
    except FileNotFoundError as err:  # no candidate is writable: Python's message lists them, says no remedy
        raise ScratchFolderError(f"no temporary directory is writable (TMPDIR={chosen or 'unset'}: "
                                 f"{_unusable_reason(asked) or 'no room'}; {err.strerror}): set TMPDIR to a writable "
                                 "folder with free space, on a file system that allows executables (cpp and cxx "
                                 "models run code from it)") from None
    if os.path.abspath(asked) == os.path.abspath(used):
        return Path(used)
    reason = _unusable_reason(asked)
    if reason is None:  # usable: tempfile.tempdir was set by the program (a test), or room came back since it looked
        return Path(used)
    if chosen:
        raise ScratchFolderError(f"TMPDIR={chosen}: the server cannot make its scratch folder there: {reason} "
                                 "(TMPDIR must be a writable folder with free space, on a file system that allows "
                                 "executables: cpp and cxx models run code from it)")
    log.warning("the temporary directory %s cannot be used (%s) and TMPDIR is not set: the server's scratch folder "
                "is made in %s instead; set TMPDIR to choose the folder (on a file system that allows executables)",
                asked, reason, used)
    return Path(used)


def asked_temporary_directory() -> Path:
    """The temporary directory the operator asked for: TMPDIR, else /tmp (where tempfile looks first), whether
    or not tempfile passed it over. Dead servers' scratch folders are looked for there: they may be what fills it.
    """
    chosen = os.environ.get("TMPDIR")
    if chosen:
        return Path(chosen)
    return Path("/tmp") if os.name == "posix" else Path(tempfile.gettempdir())


def _unusable_reason(folder: str) -> str | None:
    """Why files cannot be written in ``folder`` (the system's reason), tried as tempfile tries it; None if they can."""
    probe = os.path.join(folder, f".nereid-probe-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        descriptor = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as err:
        return err.strerror or str(err)
    try:
        os.write(descriptor, b"nereid")  # a full disk still lets an empty file be made: a write finds it out
    except OSError as err:
        return err.strerror or str(err)
    finally:
        os.close(descriptor)
        with contextlib.suppress(OSError):
            os.unlink(probe)
    return None


def make_private_folder(folder: Path) -> None:
    """Make ``folder`` (mode 0700) unless it is there, and the folders above it that are missing, each 0700.

    A run's folder is in the server's scratch folder, which a /tmp cleaner
    (systemd-tmpfiles' age rule, an operator's ``rm``) may have removed while the
    server runs: made again, runs go on rather than all failing from then on.
    A scratch folder of this process's made again is locked again as its own,
    or a server in another PID namespace would take it for a dead one's.
    Concurrent calls are safe: whichever makes a folder first, the others find it.
    """
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        return
    except FileNotFoundError:
        make_private_folder(folder.parent)
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:
            return
    if folder in _held:
        _hold_lock(folder)


def _hold_lock(folder: Path) -> None:
    """Lock ``folder`` itself and its OWNER_LOCK (a new file nobody else has opened: taken at once) as this
    process's, for its whole life; the locks of a folder of that path made before (and removed since) are let go."""
    descriptor = os.open(folder / OWNER_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(descriptor, fcntl.LOCK_EX)
    itself = _lock_folder_itself(folder)
    old = _held.get(folder, ())
    _held[folder] = (descriptor,) if itself is None else (descriptor, itself)
    for held in old:
        os.close(held)  # (the locks of the folder that was removed)


def _lock_folder_itself(folder: Path) -> int | None:
    """A descriptor of ``folder`` holding a shared lock on it, or None where it cannot be locked.

    A cleaner that removes files in the folder cannot take this lock away, as
    it takes OWNER_LOCK's. Shared: a folder opens for reading only, and on NFS
    flock is a POSIX lock, whose exclusive kind needs a descriptor open for
    writing; another server's exclusive try conflicts with it all the same.
    """
    try:
        descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as err:
        log.debug("cannot open the scratch folder %s to lock it (%s): its OWNER_LOCK alone says it is held",
                  folder, err)
        return None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH)
    except OSError as err:
        os.close(descriptor)
        log.debug("cannot lock the scratch folder %s itself (%s): its OWNER_LOCK alone says it is held", folder, err)
        return None
    return descriptor


def remove_scratch_folder(folder: Path) -> None:
    """Remove a folder :func:`make_scratch_folder` made, and let its locks go."""
    remove_tree(folder)
    for descriptor in _held.pop(folder, ()):
        os.close(descriptor)


def _owner_gone(folder: str, pid: int) -> bool:
    """True when the process that made ``folder`` has ended: the folder's own lock and its OWNER_LOCK's are free
    (or, for a folder without OWNER_LOCK, made by an older nereid or its file removed by a /tmp cleaner, no process
    has its id); False when it runs or cannot be told."""
    if _folder_itself_locked(folder):  # held: its owner runs, whatever a cleaner removed inside
        return False
    try:
        # (Read-write: on NFS, flock is a POSIX lock, whose exclusive kind needs a descriptor open for writing.)
        descriptor = os.open(os.path.join(folder, OWNER_LOCK), os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        return not process_alive(pid)
    except OSError:
        return False
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: its owner runs, in this PID namespace or another
        return False
    finally:
        os.close(descriptor)  # (the lock goes with it: the folder is removed next, or left to its owner)
    return True


def _folder_itself_locked(folder: str) -> bool:
    """True when a process holds a lock on ``folder`` itself (its owner, in this PID namespace or another); False
    when it is free or cannot be told (an older nereid's folder has no such lock: OWNER_LOCK tells then)."""
    try:
        descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # (not lockable here, as on NFS: OWNER_LOCK tells)
        return False
    finally:
        os.close(descriptor)  # (a lock taken goes with it)
    return False


def remove_stale_scratch(parent: Path) -> int:
    """Remove the scratch folders of nereid processes that no longer run; returns how many."""
    removed = 0
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return 0
    settled = time.time() - SETTLED_S
    for entry in entries:
        match = _SCRATCH.match(entry.name)
        try:
            if not (match and entry.is_dir(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_mtime
                    < settled):
                continue
        except OSError:
            continue
        if _owner_gone(entry.path, int(match.group(1))):
            killed = _kill_programs_run_from(entry.path)
            if killed:
                log.info("ended %d process(es) still running a program from %s, a scratch folder of a nereid "
                         "process that no longer runs (a model's run it could not end)", killed, entry.path)
            if remove_tree(entry.path):
                removed += 1
            else:  # (what could not be removed is named at DEBUG: a start must not say it was)
                log.warning("cannot remove all of %s, a scratch folder of a nereid process that no longer runs",
                            entry.path)
    if removed:
        log.info("removed %d scratch folder(s) left by nereid processes that no longer run", removed)
    return removed


def _kill_programs_run_from(folder: str) -> int:
    """SIGKILL the process group of each process whose program file is in ``folder``; returns how many.

    A ``cpp`` model's run executes its binary from the server's scratch folder,
    in a session of its own. A server that was SIGKILLed could not end its runs:
    one that hangs, or ignores SIGTERM, ran on past its ``timeout_s`` for good,
    from a folder this start then removed. Only this PID namespace's processes
    are seen (/proc), and only programs under a dead server's own folder match.
    """
    # /proc gives the program's real path: a TMPDIR through a symlink, or relative, matched none.
    inside = os.path.join(os.path.realpath(folder), "")
    try:
        entries = os.listdir("/proc")
    except OSError:
        return 0
    # All found first: killing one's group makes the others in it zombies, whose program can no longer be read.
    found = [int(entry) for entry in entries if entry.isdigit() and _program_of(entry).startswith(inside)]
    for pid in found:
        if not _program_of(str(pid)).startswith(inside):  # (ended since, its id perhaps another's now; or a zombie
            continue  # of a group killed already)
        with contextlib.suppress(OSError):
            group = os.getpgid(pid)
            if group != os.getpgrp():  # (a run has a session of its own; this server's group is never ended)
                os.killpg(group, signal.SIGKILL)  # (the run's group: what it started too)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return len(found)


def _program_of(pid: str) -> str:
    """The program file the process ``pid`` runs; "" when that cannot be read (gone, a kernel thread, a zombie,
    another user's)."""
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return ""


def remove_stale_partials(folder: Path) -> int:
    """Remove ``*.<pid>.partial`` files in ``folder`` whose writing process no longer runs; returns how many.

    One written within the last minute stays, whatever its pid: in a
    repository that servers in other PID namespaces share, that pid may be a
    live writer's there.
    """
    removed = 0
    settled = time.time() - SETTLED_S
    try:
        found = list(folder.glob("*.partial"))
    except OSError:  # (a folder the server cannot read: the model's load says so, not this clean-up)
        return 0
    for path in found:
        match = _PARTIAL.search(path.name)
        try:
            if not match or path.lstat().st_mtime >= settled or process_alive(int(match.group(1))):
                continue
        except OSError:  # (gone already: renamed into place, or removed by another server)
            continue
        try:
            path.unlink(missing_ok=True)
        except OSError:  # (a read-only repository: its leftovers stay, and harm nothing but space)
            continue
        removed += 1
    return removed


def remove_model_leftovers(folder: Path, cache: str = ".cache") -> int:
    """Remove the stale ``.partial`` files in a model folder and in its executable cache (``cache``), as a
    model loads: a server killed while it wrote a cache entry or migrated weights left them; returns how many."""
    return remove_stale_partials(folder) + remove_stale_partials(folder / cache)
