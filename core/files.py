"""Reading files from model folders, which nereid does not trust.

A model folder may hold a FIFO where a file should be (opening it would block a
load forever), a symlink leading out of the repository (to ``/etc/passwd``), a
multi-gigabyte "textproto", or bytes that are not UTF-8. Every reader here
fails with a :class:`~nereid.errors.ConfigError` naming the file and the
problem, and never quotes the file's contents.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import logging
import os
import secrets
import shutil
import stat
import sys
from pathlib import Path
from typing import Callable, Iterable, Iterator

from nereid.errors import ConfigError, cap_message

log = logging.getLogger(__name__)

# The longest file name, in bytes, that the usual local file systems take (ext4, XFS, btrfs, tmpfs).
NAME_MAX = 255


def is_model_folder_name(name: str) -> bool:
    """True for a name that can be a model folder directly under ml_backends_path: not empty, not hidden (a
    hidden name is never a model), no "/" or NUL, and at most NAME_MAX bytes (a longer one cannot be looked up:
    the system refuses the path, ENAMETOOLONG)."""
    if not name or "/" in name or "\0" in name or name.startswith("."):
        return False
    try:
        return len(os.fsencode(name)) <= NAME_MAX
    except UnicodeEncodeError:  # a lone surrogate ("a\ud800b" in nereid.yaml): no file name
        return False


def warn_if_file_names_not_utf8() -> bool:
    """Log a WARNING when this process reads file names in another encoding than UTF-8 (an ASCII locale:
    ``LC_ALL=C`` with ``PYTHONUTF8=0``), where model names and folders in UTF-8 are refused as no folder name or
    skipped as "not UTF-8" (the deployment hunt); whether it did."""
    encoding = sys.getfilesystemencoding()
    if encoding.lower().replace("-", "") == "utf8":
        return False
    log.warning("file names are read as %s here (the locale: LANG/LC_ALL), not UTF-8: a model folder or name "
                "with other than ASCII characters is refused or skipped; run with LANG=C.UTF-8 or PYTHONUTF8=1",
                encoding)
    return True


# How many entries of a model folder the symlink check looks at before giving up on the folder.
MAX_FOLDER_ENTRIES = 100_000
# How deep a model folder's subfolders may nest. Python 3.11's os.walk calls itself once per level: one folder
# nested 1,500 deep failed every scan of the repository with RecursionError, so that no model loaded at start and
# the watcher applied no change (the path-safety hunt). Walks of model folders go no deeper; a load refuses one.
MAX_FOLDER_DEPTH = 100


def folder_depth(folder: str, directory: str) -> int:
    """How many levels below ``folder`` the walked ``directory`` (a path os.walk gave, under ``folder``) lies."""
    return directory.count(os.sep, len(folder.rstrip(os.sep)))


def descriptor_path(fd: int) -> str:
    """A path to what the descriptor ``fd`` of this process leads to (Linux's ``/proc/self/fd``), for a child
    to enter or open before it execs: it follows a rename, outlives a delete, and never leads elsewhere."""
    return f"/proc/self/fd/{fd}"


def kind_of(mode: int) -> str:
    """What a file of this ``st_mode`` is, for messages (``a FIFO``, ``a directory``...)."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "not a regular file"


def not_regular_reason(path: Path) -> str | None:
    """Why ``path`` cannot be read as a file (``None`` when it is a regular file, or is absent).

    A symlink to nothing is there, so it is named as one ("missing" would send
    an author looking for the wrong problem), without its target: that may
    name a path outside ml_backends_path, and reasons reach clients.
    """
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return f"{path}: is a symlink to a file that does not exist" if path.is_symlink() else None
    except OSError:
        return None
    return None if stat.S_ISREG(mode) else f"{path}: is {kind_of(mode)}, not a regular file"


def read_regular_file(path: Path, limit: int) -> bytes:
    """The bytes of ``path``, which must be a regular file of at most ``limit`` bytes.

    Opened without blocking, so a FIFO is refused rather than waited on.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err.strerror or err}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{path}: is {kind_of(info.st_mode)}, not a regular file")
        if info.st_size > limit:
            raise ConfigError(f"{path}: is {info.st_size} bytes, more than the {limit}-byte limit for this file")
        chunks: list[bytes] = []
        remaining = limit + 1  # the file may have grown since fstat
        while remaining > 0 and (chunk := os.read(fd, min(remaining, 1 << 20))):
            chunks.append(chunk)
            remaining -= len(chunk)
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err.strerror or err}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        raise ConfigError(f"{path}: is more than the {limit}-byte limit for this file")
    return data


def decode_text(data: bytes, path: Path) -> str:
    """``data`` as UTF-8; ConfigError with the offset of the first bad byte (not the byte) otherwise."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (invalid byte at offset {err.start}); "
                          "is it a binary file?") from None


def read_text_file(path: Path, limit: int) -> str:
    """:func:`read_regular_file` decoded as UTF-8."""
    return decode_text(read_regular_file(path, limit), path)


def escaping_link(folder: Path, root: Path, config_name: str = "nereid.yaml") -> tuple[Path, Path] | None:
    """The first symlink in ``folder`` (the folder itself included) that leads outside ``root``.

    Returns (the link, where it leads), or None when every link stays inside.
    Raises ConfigError when the folder has more than :data:`MAX_FOLDER_ENTRIES`, nests folders deeper than
    :data:`MAX_FOLDER_DEPTH`, or a subfolder cannot be listed
    but can be searched (its refusal names ``config_name``, see :func:`check_confined`).
    A linked folder that stays inside ``root`` is walked too, for a link in it may lead out (the hunt of the
    symlink check: ``v2 -> ../.shared``, ``.shared/w.safetensors -> /elsewhere``, loaded through the two hops);
    each real folder once, so that a link back to a folder walked already ends the walk there.
    """
    root = root.resolve()
    if folder.is_symlink():
        target = _link_target(folder)
        if target is None:
            raise ConfigError(f"{folder}: is a symlink loop (it leads back to itself, through one link or more); "
                              "replace it with the model's folder")
        if not _inside(target, root):
            return folder, target
    seen = 0
    real_of = {str(folder): os.path.realpath(folder)}  # each folder still to walk: where it really is
    walked = set(real_of.values())
    # os.walk passes over a subfolder it cannot list (see _refuse_unlisted_reachable for those a model can reach).
    refuse = functools.partial(_refuse_unlisted_reachable, config_name=config_name)
    for directory, subdirs, files in os.walk(folder, onerror=refuse, followlinks=True):
        if subdirs and folder_depth(os.fspath(folder), directory) >= MAX_FOLDER_DEPTH:
            raise ConfigError(f"{folder}: nests folders more than {MAX_FOLDER_DEPTH} deep "
                              f"({cap_message(os.path.relpath(os.path.join(directory, subdirs[0]), folder), 200)})")
        real_directory = real_of.pop(directory, None) or os.path.realpath(directory)
        links_in = set()  # the names here that are links (inside the root: the others end the walk)
        for name in (*subdirs, *files):
            seen += 1
            if seen > MAX_FOLDER_ENTRIES:
                raise ConfigError(f"{folder}: holds more than {MAX_FOLDER_ENTRIES} files and folders")
            path = Path(directory, name)
            try:
                linked = path.is_symlink()
            except PermissionError:
                # In a subfolder the server's user can list but not search: nothing in it can be reached through
                # it either, by the server or a model (a folder it cannot list at all os.walk passes over alike).
                continue
            if linked:
                target = _link_target(path)
                if target is None:
                    continue  # a loop leads nowhere, so not out: what opens it fails (it was a raw RuntimeError)
                if not _inside(target, root):
                    return path, target
                links_in.add(name)
        entered = []
        for name in subdirs:
            path = os.path.join(directory, name)
            real = os.path.realpath(path) if name in links_in else os.path.join(real_directory, name)
            if real not in walked:
                walked.add(real)
                real_of[path] = real
                entered.append(name)
        subdirs[:] = entered
    return None


def _link_target(link: Path) -> Path | None:
    """Where the symlink ``link`` leads (resolved, as far as it exists); None for a loop (Python 3.11 raises
    RuntimeError for one, later versions OSError ELOOP)."""
    try:
        target = link.resolve()
    except RuntimeError:
        return None
    except OSError as err:
        if err.errno == errno.ELOOP:
            return None
        raise
    try:  # 3.13's non-strict resolve() no longer stat()s the result, so a loop comes back as the link itself
        target.stat()
    except OSError as err:
        if err.errno == errno.ELOOP:
            return None
    return target


def _refuse_unlisted_reachable(error: OSError, config_name: str) -> None:
    """os.walk's ``onerror``: ConfigError for a subfolder the server's user cannot list but can search (mode 311):
    a model opens what it holds by name, a symlink leading out included, which the walk cannot see (the operator
    hunt). One that cannot be searched either holds nothing anyone here can reach, and is passed over."""
    if not isinstance(error, PermissionError) or error.filename is None:
        return
    if _search_refused(error.filename) is not None:
        return  # (no search permission: nothing in it can be opened)
    raise ConfigError(f"the folder {error.filename} cannot be listed by the server's user (uid {os.geteuid()}), but "
                      "what it holds can be opened by name: its symlinks cannot be checked (give it read permission, "
                      f"r, or set server.follow_symlinks: true in {config_name})")


def folder_gone(folder: Path) -> bool:
    """Whether ``folder`` is not there as a folder. One the server's user cannot look at (its parent not
    searchable: an ``ml_backends_path`` mounted with the wrong owner) is not gone: its load says why it cannot be
    read (see :func:`check_readable`), where ``is_dir`` raised PermissionError (the deploy hunt)."""
    try:
        return not folder.is_dir()
    except PermissionError:
        return False


def check_readable(folder: Path) -> None:
    """ConfigError when the server's user cannot list ``folder``, or open what it lists: said so, where each
    backend's claim failed on it apart (a plugin fault logged, then "no backend claims the folder"), and the load
    blamed a file the folder does not hold (the operator hunt). Nothing for a folder that is gone or no folder:
    each load path says that its own way."""
    try:
        os.scandir(folder).close()
    except PermissionError as err:
        raise ConfigError(f"the folder {folder} cannot be read by the server's user (uid {os.geteuid()}): "
                          f"{err.strerror}") from None
    except OSError:  # (gone, or not a folder: each load path says that its own way)
        return
    # Listed, but its files may still be out of reach: a folder without search (x) permission, as `chmod -R 644`
    # leaves one, lists its names and opens none (a bare errno on main.py; the hunt of edc6865).
    refused = _search_refused(folder)
    if refused is not None:
        raise ConfigError(f"the files of the folder {folder} cannot be opened by the server's user (uid "
                          f"{os.geteuid()}): {refused.strerror} (a folder needs search permission, x, as well as "
                          "read)")


def _search_refused(folder: Path | str) -> PermissionError | None:
    """The refusal of a look-up inside ``folder`` when the server's user has no search permission (x) on it; None
    when it has. A name the folder does not hold tells, an empty folder too: EACCES without x, ENOENT with it."""
    try:
        os.stat(os.path.join(folder, ".nereid-search-probe"), follow_symlinks=False)
    except PermissionError as err:
        return err
    except OSError:
        pass
    return None


def check_confined(folder: Path, root: Path, follow_symlinks: bool, config_name: str = "nereid.yaml") -> None:
    """ConfigError when ``folder`` (or a file in it) is a symlink leading outside ``root``.

    ``config_name``: the configuration file where ``server.follow_symlinks`` is set, as the error names it (the
    server's Settings.config_name; settings.DEFAULT_CONFIG_NAME by default, which this module cannot import).

    ``follow_symlinks`` (``server.follow_symlinks``) turns the check off. A folder the server's user cannot read
    is said to be (:func:`check_readable`) rather than fail the walk with a bare errno naming a file in it.
    """
    if follow_symlinks:
        return
    check_readable(folder)
    escape = escaping_link(folder, root, config_name)
    if escape is not None:
        link, target = escape
        # The target is for the operator's log only: the error reaches clients (RepositoryIndex, load
        # replies), where only paths relative to ml_backends_path may appear.
        log.info("%s leads to %s, outside ml_backends_path %s", link, target, root)
        raise ConfigError(f"{link} is a symlink to a path outside ml_backends_path; set "
                          f"server.follow_symlinks: true in {config_name} to allow it")


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def atomic_write(path: Path, parts: Iterable[bytes | memoryview], *, durable: bool = False, mode: int | None = None,
                 check: Callable[[Path], None] | None = None) -> None:
    """Write ``parts`` to ``path`` so that no reader ever sees a half-written file.

    The data goes to ``.<name>.<token>.<pid>.partial`` beside the target (a
    killed writer's leftover is removed at the next start, see
    :mod:`nereid.leftovers`) and is renamed over ``path``; two writers never
    interleave. The file is created with mode 0o666, so the umask applies as
    for any file (or with ``mode``). ``durable`` fsyncs the file before the
    rename and the folder after it. ``check(temporary)`` runs before the
    rename; raising there leaves ``path`` untouched. A legal name too long
    for that temporary name (over 230 bytes or so) has a hash of it in its
    place.
    """
    temporary = staged_write(path, parts, durable=durable, mode=mode)
    try:
        if check is not None:
            check(temporary)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    if durable:
        fsync_folder(path.parent)


def staged_write(path: Path, parts: Iterable[bytes | memoryview], *, durable: bool = False,
                 mode: int | None = None) -> Path:
    """Write ``parts`` to a temporary file beside ``path``, named as :func:`atomic_write` names it, and return
    it, for the caller to rename over ``path`` (or remove): several files replaced together once all are
    written (a bundle's export). Nothing is left when writing fails."""
    temporary = path.parent / temporary_name(path.name)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            for part in parts:
                f.write(part)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        if mode is not None:
            os.chmod(temporary, mode)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return temporary


def temporary_name(name: str) -> str:
    """``.<name>.<token>.<pid>.partial``, or ``.<hash of name>.<token>.<pid>.partial`` past NAME_MAX (255 bytes).

    The random token keeps apart two writers whose pids are the same (servers in
    two containers, each with its own PID namespace, sharing a repository).
    """
    suffix = f".{secrets.token_hex(4)}.{os.getpid()}.partial"
    if len(os.fsencode(name)) + 1 + len(suffix) > NAME_MAX:
        name = hashlib.sha256(os.fsencode(name)).hexdigest()[:32]
    return f".{name}{suffix}"


def fsync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_tree(path: Path | str) -> bool:
    """Remove the folder ``path`` and all it holds, even the folders in it that a run made read-only; never raises.

    Returns whether it is gone. A model's program may leave a folder of mode 0555 in its TMPDIR (a ``tar``
    extraction, Go's module cache): a server that is not root (without CAP_DAC_OVERRIDE) cannot remove what is in
    it, and ``shutil.rmtree(..., ignore_errors=True)`` left the whole tree on disk for good. As
    ``tempfile.TemporaryDirectory`` does, a removal refused for want of permission makes the folder holding the
    entry writable by its owner and tries once more. Symlinks are removed, never followed (nor changed through),
    and nothing outside ``path`` is changed. What still cannot be removed is logged at DEBUG and left.

    However deep the tree: each folder's subfolders are moved up to ``path`` before it is emptied, so the walk
    holds two descriptors and no recursion. ``shutil.rmtree`` recurses once per level: a run that left 3,000
    nested folders in its TMPDIR raised RecursionError out of its cleanup, failing its request, the server's
    stop, and every later start on that TMPDIR, which removes stale scratch folders (a bug hunt).
    """
    root = os.fspath(path)
    try:
        _remove_tree(root)
    except Exception as err:  # (a bug of its own, or of the platform's: still never raised)
        log.debug("cannot remove %s: %s", root, err)
    return not os.path.lexists(root)


def _remove_tree(root: str) -> None:
    """Empty the folder ``root`` breadth-wise through descriptors (see :func:`remove_tree`), then remove it."""
    try:
        root_fd = _open_folder(root, None, root)
    except FileNotFoundError:
        return
    except OSError as err:  # a symlink (never followed), a file, a folder that cannot be opened
        log.debug("cannot remove %s: %s", root, err)
        return
    moved = 0  # folders moved up into root so far (their names: .nereid-removing-<token>-N)
    token = secrets.token_hex(4)  # (a tree may hold such names of an earlier removal: they never collide)
    try:
        pending = [None]  # folders in root to empty and remove (None: root itself)
        while pending:
            name = pending.pop()
            shown = root if name is None else os.path.join(root, name)
            try:
                fd = root_fd if name is None else _open_folder(name, root_fd, shown)
            except OSError as err:
                log.debug("cannot remove %s: %s", shown, err)
                continue
            try:
                for entry in list(os.scandir(fd)):
                    if not entry.is_dir(follow_symlinks=False):
                        _unlink(entry.name, fd, os.path.join(shown, entry.name))
                    elif name is None:
                        pending.append(entry.name)
                    else:
                        moved, up, refused = _moved_up(entry.name, fd, root_fd, moved, token,
                                                       os.path.join(shown, entry.name))
                        if up is not None:
                            pending.append(up)
                        elif refused == errno.EXDEV:  # (overlayfs refuses to move a lower layer's folder) in place
                            _remove_in_place(entry.name, fd, os.path.join(shown, entry.name))
                        # (Anything else, a mount point's EBUSY, is left, and logged: not a mounted file system.)
            except OSError as err:
                log.debug("cannot list %s: %s", shown, err)
            finally:
                if fd != root_fd:
                    os.close(fd)
            if name is not None:
                _with_write_access(lambda: os.rmdir(name, dir_fd=root_fd), root_fd, shown)
    finally:
        os.close(root_fd)
    with contextlib.suppress(FileNotFoundError):
        try:
            os.rmdir(root)
        except OSError as err:
            log.debug("cannot remove %s: %s", root, err)


def _open_folder(name: str, dir_fd: int | None, shown: str) -> int:
    """A descriptor of the folder ``name`` (in ``dir_fd``), never through a symlink; one that cannot be listed
    (mode 0000 or 0111, for a server that is not root) is given to its owner first and opened once more."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except PermissionError:
        _allow_owner(name, dir_fd)
        return os.open(name, flags, dir_fd=dir_fd)


def _unlink(name: str, dir_fd: int, shown: str) -> None:
    """Remove the file (or symlink, or other non-folder) ``name`` in the folder ``dir_fd``."""
    _with_write_access(lambda: os.unlink(name, dir_fd=dir_fd), dir_fd, shown)


def _moved_up(name: str, dir_fd: int, root_fd: int, moved: int, token: str,
              shown: str) -> tuple[int, str | None, int | None]:
    """Move the folder ``name`` (in ``dir_fd``) up into the tree's root as ``.nereid-removing-<token>-N``; (the count
    of folders moved, its new name or None when it could not be moved, and then why: an errno)."""
    for _ in range(8):  # (a name taken already: the next number)
        moved += 1
        up = f".nereid-removing-{token}-{moved}"
        try:
            # Moving a folder rewrites its ".." entry: its own write access is needed, as its parent's.
            _with_write_access(lambda: os.rename(name, up, src_dir_fd=dir_fd, dst_dir_fd=root_fd), dir_fd, shown,
                               then=lambda: (_allow_owner(name, dir_fd), _allow_owner_of(root_fd)), quiet=True)
            return moved, up, None
        except (FileExistsError, IsADirectoryError):
            continue
        except OSError as err:
            if err.errno == errno.ENOTEMPTY:
                continue
            if err.errno != errno.EXDEV:  # (that one is removed where it is)
                log.debug("cannot remove %s: %s", shown, err)
            return moved, None, err.errno
    return moved, None, None


def _remove_in_place(name: str, dir_fd: int, shown: str) -> None:
    """Remove the folder ``name`` (in ``dir_fd``) where it is, one that cannot be moved up: recursively, through
    descriptors (``shutil.rmtree``), its depth what an image's layer holds; what it cannot is logged and left."""
    def failed(function: object, path: str, error: BaseException) -> None:
        log.debug("cannot remove %s: %s", os.path.join(shown, os.path.relpath(path, name)), error)
    try:
        if sys.version_info >= (3, 12):
            shutil.rmtree(name, dir_fd=dir_fd, onexc=failed)
        else:
            shutil.rmtree(name, dir_fd=dir_fd, onerror=lambda function, path, info: failed(function, path, info[1]))
    except RecursionError:  # (deeper than an interpreter's recursion: left)
        log.debug("cannot remove %s: nested too deep to remove where it is", shown)


def _with_write_access(change: Callable[[], object], dir_fd: int, shown: str, *,
                       then: Callable[[], None] | None = None, quiet: bool = False) -> None:
    """``change()``, something done in the folder ``dir_fd``; refused for want of permission, that folder (and
    with ``then``, whatever else it does) is given to its owner and it is tried once more. Other failures are
    logged at DEBUG, or raised with ``quiet``."""
    try:
        try:
            change()
        except PermissionError:
            _allow_owner_of(dir_fd)
            if then is not None:
                then()
            change()
    except FileNotFoundError:  # (removed meanwhile)
        pass
    except OSError as err:  # not its owner, a read-only file system, an immutable file...
        if quiet:
            raise
        log.debug("cannot remove %s: %s", shown, err)


def _allow_owner_of(fd: int) -> None:
    """Give the owner of the folder open as ``fd`` read, write and search on it."""
    os.fchmod(fd, stat.S_IMODE(os.fstat(fd).st_mode) | stat.S_IRWXU)


def _allow_owner(folder: str, dir_fd: int | None) -> None:
    """Give the owner of ``folder`` (in ``dir_fd``) read, write and search on it; OSError when it is not a folder
    (a symlink put in a folder's place is never followed: the mode of what it leads to stays)."""
    fd = os.open(folder, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        # chmod through /proc/self/fd changes the very folder opened, whatever its path leads to now.
        os.chmod(descriptor_path(fd), stat.S_IMODE(os.fstat(fd).st_mode) | stat.S_IRWXU)
    finally:
        os.close(fd)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if absent, and its folder; not the folders above that, which
    may have been removed meanwhile, a model folder say): processes on one machine take turns."""
    import fcntl  # POSIX only: imported where a lock is taken, so the module imports anywhere

    path.parent.mkdir(exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
