"""Migrating legacy weights to the program's axis order (``runtime.weights_migration``).

Legacy weights files hold each tensor column-major, so every load transposes
every tensor. Migration writes them once in the program's axis order:

* ``copy``: write ``weights.T.safetensors`` (``axis_order: xla``) beside the
  untouched ``weights.safetensors`` and add ``weights_file:
  weights.T.safetensors`` to manifest.yaml, so rolling back to a server that
  cannot read the copy needs nothing;
* ``replace``: the copy first, then ``format_version: "2.1"``, the copy swapped
  in under ``weights.safetensors`` in one rename, and the ``weights_file`` line
  and the extra name removed.

Nothing is accepted without proof: a copy must hold the original's tensor
names, dtypes, byte counts, argument order and metadata, each header shape
reversed, and every tensor equal byte for byte (NaN payloads and signed zeros
count) to the array the legacy path reads, which is read twice, by the
server's pread loader and independently by the safetensors library (its own
header parser and reader). The copy records the original's SHA-256, and its
size, modification time, change time and inode, which spare a load the hash
while none of them changed. Before the swap the copy is proved again against
the original, and after it the file under the original's name is proved
against the original, still open, before anything else is removed.

Files are written under temporary names, fsynced, proved from disk and renamed
into place, and manifest edits change only the ``weights_file`` and
``format_version`` lines, so a crash at any point leaves a bundle that loads
correctly, and the migration resumes at the next load. Workers take turns on a
lock in ``.cache/``. A migration that cannot run (no space, a read-only folder,
a copy that fails its proof) is logged and the bundle loads as it was.

A copy whose original has changed since (a redeployed ``weights.safetensors``)
is stale: the server loads the original instead and, with migration on,
rebuilds the copy, or removes it (and its ``weights_file`` line) when the
original was redeployed in the program's axis order. A manifest that names
``weights.safetensors`` itself is migrated like one that names no file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from nereid.backends.xla.bundle import (CACHE_DIR, DEFAULT_WEIGHTS_FILE, BundleLayout, not_a_folder_reason, open_bundle,
                                        require_manifest)
from nereid.backends.xla.manifest import CURRENT_FORMAT_VERSION, MANIFEST_NAME, parse_manifest_text
from nereid.backends.xla.safetensors import (AXIS_ORDER_KEY, AXIS_ORDER_XLA, SAFETENSORS_DTYPES,
                                             SafetensorsHeader, TensorEntry,
                                             encode_header, read_entry, read_header, read_header_fd)
from nereid.backends.xla.weights import INDEX_FILE, LocalBundleFiles, WeightSet, resolve_weights
from nereid.errors import ConfigError, describe_exception
from nereid.files import atomic_write, descriptor_path, fsync_folder, locked

log = logging.getLogger(__name__)

MIGRATION_MODES = ("off", "copy", "replace")
COPY_FILE = "weights.T.safetensors"
# The files of a bundle folder a migration may write or remove (hidden temporary names apart).
MIGRATED_FILES = frozenset({MANIFEST_NAME, DEFAULT_WEIGHTS_FILE, COPY_FILE})
LOCK_FILE = "weights-migration.lock"
FROM_SIZE = "migrated_from_size"
FROM_MTIME = "migrated_from_mtime_ns"
FROM_SHA256 = "migrated_from_sha256"
FROM_CTIME = "migrated_from_ctime_ns"
FROM_INODE = "migrated_from_inode"
_ADDED_KEYS = frozenset({AXIS_ORDER_KEY, FROM_SIZE, FROM_MTIME, FROM_SHA256, FROM_CTIME, FROM_INODE})
_HASH_CHUNK = 8 * 1024 * 1024
_KEEP = object()


class MigrationError(Exception):
    """A migration step that could not be done or proved; the bundle is left loadable."""


@dataclass(frozen=True)
class FileStamp:
    """What a copy records about its original.

    ``sha256`` says which file it is; the stat fields only let a load skip
    hashing the original when none of them changed (see :func:`_is_stale`).
    """

    size: int
    mtime_ns: int
    sha256: str
    ctime_ns: int
    inode: int

    def recorded(self) -> dict[str, str]:
        """The copy's metadata entries for this stamp."""
        return {FROM_SIZE: str(self.size), FROM_MTIME: str(self.mtime_ns), FROM_SHA256: self.sha256,
                FROM_CTIME: str(self.ctime_ns), FROM_INODE: str(self.inode)}


def weights_to_load(layout: BundleLayout) -> Path | None:
    """The weights file to serve: the manifest's, unless it is a migrated copy whose original changed since."""
    path = layout.weights_path
    original = layout.folder / DEFAULT_WEIGHTS_FILE
    if path is None or layout.manifest.weights_file is None or not original.is_file() or _same(path, original):
        return path
    header = read_header(path)
    if FROM_SHA256 in header.metadata and _is_stale(header, original):
        log.warning("%s: %s was made from an earlier %s; loading %s", layout.folder.name, path.name,
                    DEFAULT_WEIGHTS_FILE, DEFAULT_WEIGHTS_FILE)
        return original
    return path


def local_weight_set(layout: BundleLayout) -> WeightSet | None:
    """The weights a local bundle serves: its one file (see :func:`weights_to_load`), or its shards."""
    chosen = weights_to_load(layout) if layout.manifest.weights_file is not None else None
    # Its path in the bundle, not its name: a weights_file in a sub-folder (v2/weights.safetensors) read the
    # top-level file of that name (found by a bug hunt: another version's weights, served without a word).
    weight_set = resolve_weights(LocalBundleFiles(layout.folder),
                                 chosen.relative_to(layout.folder).as_posix() if chosen is not None else None)
    if weight_set is not None and chosen is not None and chosen != layout.weights_path:
        weight_set = replace(weight_set, fallback=True)  # (the original, its copy stale)
    return weight_set


def open_local_bundle(folder: Path, largest_only: bool = False) -> tuple[BundleLayout, WeightSet | None]:
    """A local bundle's layout and the weights it serves (see :func:`local_weight_set`).

    Read again, once, when the first read fails while ``manifest.yaml`` is replaced or edited: a migration's
    ``replace`` on another server sharing the folder (or a redeploy) switched ``weights_file`` after the
    manifest was read, and the file it named is gone.
    """
    before = _manifest_stamp(folder)
    try:
        layout = open_bundle(folder, largest_only)
        return layout, local_weight_set(layout)
    except ConfigError as err:
        if before is None or _manifest_stamp(folder) == before:
            raise
        log.info("%s: %s changed while the bundle was read (%s); reading it again", folder.name, MANIFEST_NAME,
                 err)
    layout = open_bundle(folder, largest_only)
    return layout, local_weight_set(layout)


def _manifest_stamp(folder: Path) -> tuple[int, int, int, int] | None:
    """What changes when manifest.yaml is replaced (its inode) or edited in place; None when it cannot be read."""
    try:
        stat = os.stat(folder / MANIFEST_NAME)
    except OSError:
        return None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns


def migrate_for_load(folder: Path, mode: str, model: str) -> bool:
    """Run the migration at load; log instead of raising. True when the bundle's files changed."""
    if mode == "off":
        return False
    try:
        outcome = migrate_bundle(folder, mode)
    except Exception as err:  # an unforeseen failure too is the migration's, not the load's
        log.error("model '%s': weights migration (%s) did not run: %s; the bundle loads as it is", model, mode,
                  failure_reason(err))
        return True  # a step may have completed before the failure: re-read the bundle
    if outcome.blocked:  # (said at each load: a load is rare, and the migration asked for is not done)
        log.warning("model '%s': weights migration (%s): %s", model, mode, outcome.what)
    elif outcome.changed:
        log.info("model '%s': weights migration (%s): %s", model, mode, outcome.what)
    return outcome.changed


def failure_reason(err: Exception) -> str:
    """Why a migration failed: nereid's own reasons as they are, any other error with its type, on one line."""
    if isinstance(err, (MigrationError, ConfigError, OSError)):
        return str(err)
    return describe_exception(err, one_line=True)


@dataclass(frozen=True)
class Outcome:
    """What a migration did; ``blocked``: it could not do what was asked until the user acts (said as a WARNING at
    a load, and an exit status of 1 offline)."""

    what: str
    changed: bool
    blocked: bool = False


def migrate_bundle(folder: Path | str, mode: str) -> Outcome:
    """Migrate one bundle's legacy weights (``mode``: copy or replace), resuming an interrupted run.

    Raises MigrationError, ConfigError or OSError when a step cannot be done;
    the bundle loads correctly whatever step it stopped at.
    """
    folder = Path(folder)
    if mode not in ("copy", "replace"):
        raise ValueError(f"mode must be copy or replace, got {mode!r}")
    # Before the lock, which writes .cache/ into the folder: a folder that is no bundle is left as it was (the
    # offline tool named on a python model's folder left a lock there; the config hunt).
    if (problem := not_a_folder_reason(folder, "a bundle's folder")) is not None:
        raise ConfigError(f"{folder}: {problem}")
    require_manifest(folder)
    with locked(folder / CACHE_DIR / LOCK_FILE):
        # Read under the lock: another worker may have just migrated the bundle.
        layout = open_bundle(folder)
        manifest_path = folder / MANIFEST_NAME
        original, copy = folder / DEFAULT_WEIGHTS_FILE, folder / COPY_FILE
        declared = layout.manifest.weights_file
        if declared is None or declared == DEFAULT_WEIGHTS_FILE:  # the manifest may name the original itself
            if declared is None and (folder / INDEX_FILE).exists():
                # The index picks the weights, not a weights.safetensors beside it: the copy's
                # weights_file line would win over the index and serve that file's tensors instead.
                return Outcome(f"a sharded bundle ({INDEX_FILE}); left alone", False)
            if copy.is_file() and original.is_file() and _same(copy, original):
                copy.unlink()  # a replace that stopped just before removing the extra name
                fsync_folder(folder)
                return Outcome("finished an interrupted replace", True)
            if not original.is_file():
                return Outcome("no weights file", False)
            if not read_header(original).legacy:
                return Outcome("weights already in the program's axis order", False)
            if _up_to_date_copy(copy, original):
                # Written and proved by a run whose manifest edit then failed: retrying the edit is enough.
                what = f"kept the up-to-date {COPY_FILE}"
            elif (foreign := _not_a_migration_copy(copy)) is not None:
                # Someone's own file under the copy's name, which the manifest does not name: overwritten, it was
                # lost (the exporter hunt).
                return Outcome(f"{COPY_FILE} is there and {foreign}: left alone, and the weights too; move it away "
                               "to migrate", False, blocked=True)
            else:
                make_copy(original, copy)
                what = f"wrote {COPY_FILE}"
            _edit_manifest(manifest_path, weights_file=COPY_FILE)
        elif declared == COPY_FILE:
            if original.is_file() and _same(copy, original):
                _finish_replace(folder, manifest_path, copy)
                return Outcome("finished an interrupted replace", True)
            header = read_header(copy)
            if FROM_SHA256 not in header.metadata:
                return Outcome(f"{COPY_FILE} is not a migration copy; left alone", False)
            if not original.is_file():
                return Outcome(f"{DEFAULT_WEIGHTS_FILE} is gone; {COPY_FILE} kept", False)
            if not read_header(original).legacy:
                # Redeployed in the program's axis order (so it changed since the copy, made from a legacy
                # file): nothing to migrate any more, and the stale copy must not stay named in the manifest.
                _finish_replace(folder, manifest_path, copy)
                return Outcome(f"removed the stale {COPY_FILE}: {DEFAULT_WEIGHTS_FILE} is already in the "
                               "program's axis order", True)
            if _is_stale(header, original):
                make_copy(original, copy)
                what = f"rebuilt the stale {COPY_FILE}"
            elif mode == "copy":
                return Outcome(f"{COPY_FILE} is up to date", False)
            else:
                what = f"{COPY_FILE} is up to date"
        else:
            return Outcome(f"weights_file {declared} is not a migration copy; left alone", False)
        if mode == "replace":
            _replace(folder, manifest_path, original, copy)
            what += f", swapped in as {DEFAULT_WEIGHTS_FILE}"
        return Outcome(what, True)


def _up_to_date_copy(copy: Path, original: Path) -> bool:
    """Whether ``copy``, not named by the manifest yet, is a faithful copy of the original as it is now.

    Proved again, not trusted: it is about to be served. A proof reads the
    files but writes nothing, so it is still much cheaper than rewriting them.
    """
    if not copy.is_file():
        return False
    fd = os.open(original, os.O_RDONLY)
    try:
        prove_copy(fd, original, copy)
    except (MigrationError, ConfigError):
        return False  # someone else's file, a copy of an earlier original, or damaged: rewritten
    finally:
        os.close(fd)
    return True


def _not_a_migration_copy(copy: Path) -> str | None:
    """Why the file at ``copy`` is no migration's copy (one made from another original, or of an earlier one, is
    one: rewritten); None when it is one, or when there is none."""
    if not os.path.lexists(copy):
        return None
    try:
        header = read_header(copy)
    except ConfigError:
        return "is no safetensors file a migration wrote"
    return None if FROM_SHA256 in header.metadata else "is no migration's copy (its metadata holds no source)"


def make_copy(original: Path, copy: Path) -> None:
    """Write the program-order copy of a legacy file under a temporary name, prove it, rename it into place."""
    folder = copy.parent
    size = original.stat().st_size
    stats = os.statvfs(folder)
    free = stats.f_bavail * stats.f_frsize
    if free < size + (1 << 20):
        raise MigrationError(f"not enough free space in {folder} for {copy.name}: need {size} bytes, {free} free")
    fd = os.open(original, os.O_RDONLY)
    try:
        header = read_header_fd(fd, original)
        if not header.legacy:
            raise MigrationError(f"{original} is not in the legacy layout")
        stamp = _stamp(fd)
        metadata = {**header.metadata, AXIS_ORDER_KEY: AXIS_ORDER_XLA, **stamp.recorded()}
        in_file_order = sorted(header.tensors, key=lambda e: e.start)  # keeps the argument order without the key

        def parts():
            yield encode_header([(e.name, e.dtype, tuple(reversed(e.shape)), e.nbytes) for e in in_file_order],
                                metadata)
            for entry in in_file_order:
                program = np.asarray(read_entry(fd, entry, original).transpose(), order="C")
                yield memoryview(program.reshape(-1).view(np.uint8))

        # Proved against the original before it takes its name: a wrong copy never appears.
        # (With the original's mode: under a umask of 027 the offline tool, run as root, wrote one a server of
        # another user could not read; the exporter hunt.)
        atomic_write(copy, parts(), durable=True, mode=os.fstat(fd).st_mode & 0o7777,
                     check=lambda temporary: prove_copy(fd, original, temporary))
    finally:
        os.close(fd)


def prove_copy(original_fd: int, original: Path, copy: Path) -> None:
    """Raise MigrationError unless ``copy`` is exactly the program-order form of the open original."""
    source = read_header_fd(original_fd, original)
    target = read_header(copy)
    stamp = _stamp(original_fd)

    def fail(problem: str) -> None:
        raise MigrationError(f"{copy} is not a faithful copy of {original}: {problem}")

    if [e.name for e in target.tensors] != [e.name for e in source.tensors]:
        fail(f"tensors (in argument order) {[e.name for e in target.tensors]}, expected "
             f"{[e.name for e in source.tensors]}")
    if target.metadata.get(AXIS_ORDER_KEY) != AXIS_ORDER_XLA:
        fail(f"{AXIS_ORDER_KEY} is {target.metadata.get(AXIS_ORDER_KEY)!r}")
    kept = {k: v for k, v in target.metadata.items() if k not in _ADDED_KEYS}
    if kept != {k: v for k, v in source.metadata.items() if k != AXIS_ORDER_KEY}:
        fail(f"metadata {kept}, expected {dict(source.metadata)}")
    # Not the ctime: the swap itself changes the open original's (its link count drops) before the last proof.
    # The inode only where recorded: a copy an earlier nereid made records size, mtime and hash alone.
    expected = {k: v for k, v in stamp.recorded().items()
                if k != FROM_CTIME and (k != FROM_INODE or k in target.metadata)}
    recorded = {k: target.metadata.get(k) for k in expected}
    if recorded != expected:
        fail(f"it records the original as {recorded}, but the original is {expected}")
    copy_fd = os.open(copy, os.O_RDONLY)
    try:
        with _ReferenceRead(original_fd, original) as reference:
            for s, t in zip(source.tensors, target.tensors):
                if s.dtype is not t.dtype or s.nbytes != t.nbytes or t.shape != tuple(reversed(s.shape)):
                    fail(f"tensor '{s.name}' is {t.dtype.name}{list(t.shape)} ({t.nbytes} bytes), expected "
                         f"{s.dtype.name}{list(reversed(s.shape))} ({s.nbytes} bytes)")
                served = read_entry(original_fd, s, original).transpose()  # the server's legacy read
                expected = np.asarray(served, order="C").tobytes()
                if reference.program_bytes(s) != expected:
                    fail(f"the two reads of the original's tensor '{s.name}' disagree (nereid's reader and the "
                         "safetensors library)")
                if read_entry(copy_fd, t, copy).tobytes() != expected:
                    fail(f"tensor '{s.name}' differs from the original")
    finally:
        os.close(copy_fd)


class _ReferenceRead:
    """The independent read of the original: the safetensors library's own parser and reader.

    It opens the file through ``/proc/self/fd``, so it reads the open original
    even after a new file took its name. Names, dtypes and header shapes come
    from the library's parse and must match nereid's; tensor data comes from
    the library's numpy reader, or, for the dtypes numpy lacks (bf16, fp8),
    from its raw deserializer (which reads the whole file into memory once).
    """

    def __init__(self, fd: int, path: Path) -> None:
        try:
            import safetensors
        except ImportError:
            raise MigrationError("the migration proves every copy against a second read by the safetensors "
                                 "library, which is not installed (pip install safetensors)") from None
        self._library = safetensors
        self._path = path
        self._fd_path = descriptor_path(fd)
        self._opened = None
        self._handle = None
        self._raw: dict[str, bytes] | None = None

    def __enter__(self) -> "_ReferenceRead":
        try:
            self._opened = self._library.safe_open(self._fd_path, "np")
            self._handle = self._opened.__enter__()
        except Exception as err:  # the library refuses the file: no second read, no proof
            raise MigrationError(f"the safetensors library cannot read {self._path}: {err}") from None
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._opened is not None:
            self._opened.__exit__(*exc_info)

    def program_bytes(self, entry: TensorEntry) -> bytes:
        """The legacy tensor as the library reads it, transposed to the program's shape, as bytes."""
        assert self._handle is not None
        try:
            view = self._handle.get_slice(entry.name)
            token, shape = view.get_dtype(), tuple(view.get_shape())
        except Exception as err:
            raise MigrationError(f"the safetensors library finds no tensor '{entry.name}' in {self._path}: "
                                 f"{err}") from None
        if SAFETENSORS_DTYPES.get(token) is not entry.dtype or shape != entry.shape:
            raise MigrationError(f"{self._path}: the safetensors library reads tensor '{entry.name}' as {token} "
                                 f"{list(shape)}, nereid as {entry.dtype.name} {list(entry.shape)}")
        if entry.dtype.numpy.name in _LIBRARY_NUMPY_DTYPES:
            array = np.asarray(self._handle.get_tensor(entry.name))
        else:
            if self._raw is None:
                with open(self._fd_path, "rb") as f:
                    self._raw = {name: bytes(info["data"]) for name, info in self._library.deserialize(f.read())}
            array = np.frombuffer(self._raw[entry.name], dtype=entry.dtype.numpy.newbyteorder("<")).reshape(shape)
        return np.asarray(array.transpose(), order="C").tobytes()


# What the library's numpy reader returns as numpy arrays (numpy has no bf16 or fp8).
_LIBRARY_NUMPY_DTYPES = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                                   "uint64", "float16", "float32", "float64"})


def _replace(folder: Path, manifest_path: Path, original: Path, copy: Path) -> None:
    fd = os.open(original, os.O_RDONLY)  # kept open: the original stays readable after the swap
    try:
        prove_copy(fd, original, copy)
        _edit_manifest(manifest_path, format_version=CURRENT_FORMAT_VERSION)
        swap = folder / f".{original.name}.{os.getpid()}.swap"
        swap.unlink(missing_ok=True)
        os.link(copy, swap)  # the copy keeps its own name (the manifest's weights_file) until the end
        os.replace(swap, original)
        fsync_folder(folder)
        try:
            prove_copy(fd, original, original)
        except MigrationError:
            _restore(fd, original)
            raise
        _finish_replace(folder, manifest_path, copy)
    finally:
        os.close(fd)


def _finish_replace(folder: Path, manifest_path: Path, copy: Path) -> None:
    _edit_manifest(manifest_path, weights_file=None)
    copy.unlink()
    fsync_folder(folder)


def _restore(fd: int, original: Path) -> None:
    """Put the original's bytes back under its name (the manifest still points at the proved copy)."""
    def chunks():
        offset, size = 0, os.fstat(fd).st_size
        while offset < size:
            chunk = os.pread(fd, min(_HASH_CHUNK, size - offset), offset)
            if not chunk:
                break
            yield chunk
            offset += len(chunk)

    atomic_write(original, chunks(), durable=True, mode=os.fstat(fd).st_mode & 0o7777)  # (the original's mode)


def _edit_manifest(path: Path, *, weights_file: object = _KEEP, format_version: object = _KEEP) -> None:
    """Change only the weights_file / format_version lines; comments and formatting stay.

    The edited text replaces the manifest only once it parses to the same
    manifest with just these fields changed. A new weights_file line goes at
    the end of the document (before a document-end marker ``...``), else
    right after the format_version line, indented like the top-level keys.
    """
    with open(path, encoding="utf-8", newline="") as file:  # (line ends as written)
        text = file.read()
    # A byte-order mark (Windows Notepad's) hid the first line from the edits, and the migration never finished
    # (the exporter hunt): kept aside, and written back. So are one kind of line ends throughout (Windows' "\r\n",
    # old Mac's "\r"), which the edit rewrote as "\n"; mixed ones are edited and written as "\n", as before.
    bom = "\ufeff" if text.startswith("\ufeff") else ""
    ends = _line_ends(text)
    text = text[len(bom):].replace("\r\n", "\n").replace("\r", "\n")
    try:
        before = parse_manifest_text(text, path)
    except ConfigError as err:
        raise MigrationError(f"the manifest does not parse: {err}") from None
    wanted = replace(before, weights_file=before.weights_file if weights_file is _KEEP else weights_file,
                     format_version=before.format_version if format_version is _KEEP else format_version)
    indent = _top_level_indent(text)  # spaces only: nothing to escape in a pattern
    edited = text
    if format_version is not _KEEP:
        edited, count = re.subn(rf"^({indent})format_version:[ \t]*(\"[^\"\n]*\"|'[^'\n]*'|[^\s#]+)",
                                rf'\g<1>format_version: "{format_version}"', edited, count=1, flags=re.M)
        if count != 1:
            raise MigrationError(f"{path}: no top-level format_version line to change")
    candidates = [edited] if weights_file is _KEEP else _weights_file_edits(edited, indent, weights_file)
    problem = "changes more than the weights_file / format_version lines"
    for candidate in candidates:
        try:
            after = parse_manifest_text(candidate, path)
        except ConfigError as err:
            problem = f"does not parse: {err}"
            continue
        if after == wanted:
            written = candidate.replace("\n", ends)
            atomic_write(path, [(bom + written).encode("utf-8")], durable=True, mode=path.stat().st_mode & 0o7777)
            return
    raise MigrationError(f"{path}: could not change only the weights_file / format_version lines: the edited "
                         f"manifest {problem}")


def _line_ends(text: str) -> str:
    """The line end ``text`` uses throughout ("\r\n", "\r" or "\n"); "\n" for mixed ones, or none."""
    crlf, cr, lf = text.count("\r\n"), text.count("\r"), text.count("\n")
    if crlf and crlf == cr == lf:
        return "\r\n"
    if cr and not lf:
        return "\r"
    return "\n"


def _top_level_indent(text: str) -> str:
    """The indentation of the manifest's top-level keys: that of its first line holding YAML content."""
    for line in text.splitlines():
        if not re.match(r"[ \t]*(#.*)?$|%|---[ \t]*(#.*)?$", line):
            return line[:len(line) - len(line.lstrip(" "))]
    return ""


def _weights_file_edits(text: str, indent: str, weights_file: object) -> list[str]:
    """Ways to set (or, for None, remove) the weights_file line, the most natural first."""
    existing = re.compile(rf"^{indent}weights_file:[^\n]*(?:\n|$)", flags=re.M)
    if weights_file is None:
        return [existing.sub("", text, count=1)]
    line = f"{indent}weights_file: {weights_file}\n"
    if existing.search(text):
        return [existing.sub(lambda _: line, text, count=1)]
    # The end of the document: before a trailing document-end marker, which nothing may follow but comments
    # (a key after it would start a second document and the manifest would no longer parse).
    end = re.search(r"^\.\.\.[ \t]*(?:#[^\n]*)?(?:\n[ \t]*(?:#[^\n]*)?)*\Z", text, flags=re.M)
    if end is not None:
        at_end = text[:end.start()] + line + text[end.start():]
    else:
        at_end = text + ("" if text.endswith("\n") or not text else "\n") + line
    after_version = re.sub(rf"^{indent}format_version:[^\n]*(?:\n|\Z)",
                           lambda m: m.group(0).rstrip("\n") + "\n" + line, text, count=1, flags=re.M)
    return [at_end] if after_version == text else [at_end, after_version]


def _is_stale(copy_header: SafetensorsHeader, original: Path) -> bool:
    """True when the original no longer is the file the copy was made from."""
    stat = original.stat()
    metadata = copy_header.metadata
    # Size and mtime alone are not enough: cp -p, rsync -a, tar and reproducible builds redeploy new weights of
    # the same size with the same mtime. With the ctime and inode they are: no tool can set a ctime (utime()
    # sets it to now), and a file written in place gets a new ctime, one written anew a new inode too (the rule
    # the dynamic repository's watcher uses). So the hash is read only when one of the four changed, which also
    # happens to an unchanged file (chmod, a bundle copied with cp -a): it is then hashed at each load. Hashing
    # every load would be simpler, but costs a read of the whole original through SHA-256: 1.1 s per GiB on a
    # 2-core machine with SHA instructions, page-cached, against 0.2 s for the read the load does anyway. A
    # copy made before the ctime and inode were recorded is always hashed.
    now = (str(stat.st_size), str(stat.st_mtime_ns), str(stat.st_ctime_ns), str(stat.st_ino))
    if now == tuple(metadata.get(key) for key in (FROM_SIZE, FROM_MTIME, FROM_CTIME, FROM_INODE)):
        return False
    fd = os.open(original, os.O_RDONLY)
    try:
        return _stamp(fd).sha256 != metadata.get(FROM_SHA256)  # touched, copied or moved but unchanged: not stale
    finally:
        os.close(fd)


def _stamp(fd: int) -> FileStamp:
    stat = os.fstat(fd)
    digest = hashlib.sha256()
    offset = 0
    while True:
        chunk = os.pread(fd, _HASH_CHUNK, offset)
        if not chunk:
            break
        digest.update(chunk)
        offset += len(chunk)
    return FileStamp(stat.st_size, stat.st_mtime_ns, digest.hexdigest(), stat.st_ctime_ns, stat.st_ino)


def _same(copy: Path, original: Path) -> bool:
    """Whether ``copy`` is the original under a second name, as a replace leaves it just before it removes that
    name: a hard link. A symlink is never a replace's (one made by hand was taken for one, and removed)."""
    try:
        return not copy.is_symlink() and os.path.samefile(copy, original)
    except OSError:
        return False


