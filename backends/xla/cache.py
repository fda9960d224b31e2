"""``<bundle>/.cache/``: compiled executables, so a restart skips compilation.

Each entry is one serialized executable, keyed by the program file's content
hash, the jaxlib version, the device (platform, platform version, device
kind) and the ``XLA_FLAGS`` that change what XLA compiles (see
:func:`compilation_flags`). An entry carries its key and a checksum of its payload; one that does
not match (corrupt, truncated, stale, or refused by jaxlib) is ignored and
rebuilt. ``mlirhashes.json`` records the content hash each program file had
when it was last compiled, so that entries of a program file that has since
changed are removed rather than left to pile up. Deleting ``.cache/`` is always
safe, and a bundle directory that cannot be written still loads (uncached).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shlex
import stat
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Generic, Mapping, TypeVar

from nereid.files import atomic_write, kind_of, locked, not_regular_reason, remove_tree

log = logging.getLogger(__name__)

HASHES_FILE = "mlirhashes.json"
# Held while the record of hashes is read and written again (see ExecutableCache._record_hash).
HASHES_LOCK_FILE = "mlirhashes.lock"
ENTRY_SUFFIX = ".xlaexe"
_MAGIC = b"NEREID-XLA-EXECUTABLE 1\n"
_LENGTH = struct.Struct("<Q")

Executable = TypeVar("Executable")

# XLA_FLAGS that say where and how XLA dumps what it compiles (and jax's count of fake CPU devices), not what it
# compiles: the flags jax's own compilation cache leaves out of its key (jax/_src/cache_key.py,
# xla_flags_to_exclude_from_cache_key), so that dumping a program's HLO does not recompile it.
OUTPUT_NEUTRAL_XLA_FLAGS = frozenset({
    "--xla_dump_compress_protos", "--xla_dump_module_metadata", "--xla_dump_max_hlo_modules",
    "--xla_dump_include_timestamp", "--xla_dump_hlo_pass_re", "--xla_dump_hlo_module_re", "--xla_dump_hlo_snapshots",
    "--xla_dump_fusion_visualization", "--xla_dump_hlo_as_url", "--xla_dump_hlo_as_proto", "--xla_dump_hlo_as_text",
    "--xla_dump_hlo_as_long_text", "--xla_dump_hlo_as_html", "--xla_dump_hlo_as_dot", "--xla_dump_to",
    "--xla_force_host_platform_device_count", "--xla_dump_disable_metadata", "--xla_dump_hlo_pipeline_re",
    "--xla_gpu_cuda_data_dir", "--xla_gpu_experimental_autotune_cache_mode",
})


# The most of a file of XLA flags (XLA_FLAGS naming one) read for the key.
MAX_FLAGS_FILE_BYTES = 1 << 20


def compilation_flags(environ: Mapping[str, str]) -> str:
    """The flags of ``XLA_FLAGS`` in ``environ`` that change the compiled program, in their order, space-separated.

    XLA reads ``XLA_FLAGS`` (``--xla_cpu_*``, ``--xla_gpu_*``, optimisation and
    autotuning switches) when it compiles, so an executable compiled under one
    set is not the program another set would give. The order is kept: of a flag
    given twice, the last wins. A value that does not start with ``-`` names a
    file of flags, as XLA reads it: its flags are the key, not its name (keyed by
    the path, an edit of the file served the executables of the old flags). Values
    quoted as XLA takes them (``--xla_dump_to="/tmp/a b"``) are one flag.
    """
    text = environ.get("XLA_FLAGS", "").strip()
    if text and not text.startswith("-"):
        try:
            text = Path(text).read_bytes()[:MAX_FLAGS_FILE_BYTES].decode("utf-8", "replace")
        except OSError:
            return f"<unreadable flags file {text}>"  # (XLA refuses it: no bundle loads; see device.check_xla_flags)
    try:
        flags = shlex.split(text)
    except ValueError:  # (an unbalanced quote: as whitespace parts)
        flags = text.split()
    return " ".join(flag for flag in flags if flag.split("=", 1)[0] not in OUTPUT_NEUTRAL_XLA_FLAGS)


@dataclass(frozen=True)
class CacheKey:
    """What a compiled executable depends on."""

    module_sha256: str
    jaxlib_version: str
    platform: str
    platform_version: str
    device_kind: str
    xla_flags: str = ""  # compilation_flags() of the environment the program is compiled in
    host_cpu: str = ""  # for the cpu platform, host_cpu() of the machine it is compiled on ("": none)

    def fields(self) -> dict[str, str]:
        """The key as written in an entry's header; without ``xla_flags`` or ``host_cpu`` when empty, so that entries
        written before they were part of the key are still found where they do not apply."""
        fields = asdict(self)
        for optional in ("xla_flags", "host_cpu"):
            if not fields[optional]:
                del fields[optional]
        return fields

    @property
    def digest(self) -> str:
        """A short hex digest of the whole key, used in the entry's file name."""
        text = json.dumps(self.fields(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:24]


@dataclass
class CacheStats:
    """What happened to the programs of one load: reused, compiled, or rebuilt over a bad entry."""

    hits: int = 0
    compiled: int = 0
    rebuilt: int = 0


@dataclass(frozen=True)
class CompileFunctions(Generic[Executable]):
    """How to compile, serialize and deserialize executables (the PJRT client's methods)."""

    compile: Callable[[], Executable]
    serialize: Callable[[Executable], bytes]
    deserialize: Callable[[bytes], Executable]


class ExecutableCache:
    """The executable cache of one bundle directory (``enabled=False``: always compile)."""

    def __init__(self, directory: Path, enabled: bool = True) -> None:
        self.directory = Path(directory)
        self.enabled = enabled
        self.stats = CacheStats()
        self._write_failed = False  # said once per load, not once per program file

    def entry_path(self, module_name: str, key: CacheKey) -> Path:
        """Where the entry for a program file and key lives."""
        return self.directory / f"{module_name}.{key.digest}{ENTRY_SUFFIX}"

    def load_or_compile(self, module_name: str, key: CacheKey,
                        functions: CompileFunctions[Executable]) -> Executable:
        """The executable for ``key``: from the cache when a valid entry exists, else compiled and stored."""
        if not self.enabled or self._not_a_folder():
            self.stats.compiled += 1
            return functions.compile()
        path = self.entry_path(module_name, key)
        payload, problem = self._read_entry(path, key)
        if payload is not None:
            try:
                executable = functions.deserialize(payload)
            except Exception as err:  # jaxlib refuses entries from other builds in many ways
                problem = f"jaxlib could not deserialize it ({type(err).__name__}: {err})"
            else:
                self.stats.hits += 1
                log.debug("%s: executable for %s loaded from the cache", self.directory.parent.name, module_name)
                return executable
        if problem:
            log.warning("%s: ignoring cache entry %s: %s; recompiling", self.directory.parent.name, path.name,
                        problem)
            self.stats.rebuilt += 1
        self.stats.compiled += 1
        executable = functions.compile()
        try:
            self._store(module_name, key, path, functions.serialize(executable))
        except FileNotFoundError:
            # The bundle folder was removed or renamed during the compile: nothing to cache into (and making it
            # again, as mkdir(parents=True) did, brought back a folder of one .cache/ that no backend claims).
            log.debug("%s: not cached: the bundle folder is gone", self.directory.parent.name)
        except Exception as err:  # a read-only bundle still serves, it just recompiles next time
            if not self._write_failed:
                log.warning("%s: cannot write the executable cache (%s: %s); its programs will be compiled again "
                            "next time", self.directory.parent.name, type(err).__name__, err)
            self._write_failed = True
        return executable

    def _not_a_folder(self) -> bool:
        """Whether the cache's path holds something other than a folder (a file, a FIFO): said once per load, where
        each program's entry said "Not a directory" and the write "File exists", four WARNINGs for one cause."""
        try:
            mode = self.directory.stat().st_mode
        except OSError:
            return False  # (absent: made at the first write; another failure is said by the read or the write)
        if stat.S_ISDIR(mode):
            return False
        if not self._write_failed:
            log.warning("%s: cannot use the executable cache %s (it is %s, not a folder); its programs will be "
                        "compiled at every load until it is removed", self.directory.parent.name, self.directory,
                        kind_of(mode))
        self._write_failed = True
        return True

    def _read_entry(self, path: Path, key: CacheKey) -> tuple[bytes | None, str]:
        """The payload of a valid entry, or None and what is wrong with it ("" when there is none)."""
        if (reason := not_regular_reason(path)) is not None:
            # A FIFO would block the load for ever, /dev/zero fill memory: never opened, rebuilt over.
            return None, reason.removeprefix(f"{path}: ")
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None, ""
        except OSError as err:
            return None, f"cannot read it: {err.strerror or err}"
        if not data.startswith(_MAGIC) or len(data) < len(_MAGIC) + _LENGTH.size:
            return None, "not a cache entry (bad magic)"
        start = len(_MAGIC) + _LENGTH.size
        (length,) = _LENGTH.unpack_from(data, len(_MAGIC))
        try:
            header = json.loads(data[start:start + length])
        except (ValueError, RecursionError):  # (deeply nested JSON exhausts the parser's recursion)
            return None, "corrupt header"
        if not isinstance(header, dict) or header.get("key") != key.fields():
            return None, "stale (written for another program, jaxlib, device or XLA_FLAGS)"
        payload = data[start + length:]
        if len(payload) != header.get("payload_bytes") or hashlib.sha256(payload).hexdigest() != header.get(
                "payload_sha256"):
            return None, "corrupt payload (size or checksum mismatch)"
        return payload, ""

    def _store(self, module_name: str, key: CacheKey, path: Path, payload: bytes) -> None:
        self.directory.mkdir(exist_ok=True)  # (inside the bundle folder, never the folder itself: see above)
        if path.is_dir() and not path.is_symlink():
            remove_tree(path)  # (a folder of an entry's name: in its way, which compiled the program at every load)
        header = json.dumps({"key": key.fields(), "module": module_name, "payload_bytes": len(payload),
                             "payload_sha256": hashlib.sha256(payload).hexdigest()}).encode()
        atomic_write(path, [_MAGIC, _LENGTH.pack(len(header)), header, payload])
        self._record_hash(module_name, key.module_sha256)

    def _record_hash(self, module_name: str, sha256: str) -> None:
        """Note the program's new hash; drop entries compiled from an older version of the file.

        The record is read, changed and written again under a lock: two servers
        sharing the folder (replicas, blue/green) compiling other programs each
        wrote back what it had read, without the other's note, and the entries of
        a program whose note was lost were never dropped when it changed.
        """
        lock = self.directory / HASHES_LOCK_FILE
        if not_regular_reason(lock) is not None:
            lock.unlink()  # (a FIFO put there would block the open for ever: the cache's own file, made again)
        with locked(lock):
            previous = self._note_hash(module_name, sha256)
        if previous and previous != sha256:
            self._remove_entries(module_name, previous)

    def _note_hash(self, module_name: str, sha256: str) -> str | None:
        """Write ``sha256`` as ``module_name``'s in the record; the hash the record had for it (None: none)."""
        modules = self._read_notes() or {}  # (missing or corrupt: rebuilt from this compile on)
        previous = modules.get(module_name)
        modules[module_name] = sha256
        self._write_notes(modules)
        return previous if isinstance(previous, str) else None

    def _read_notes(self) -> dict | None:
        """The record's notes, program file name -> hash; None when it is missing, not a regular file (never
        opened: a FIFO would block), or corrupt."""
        hashes_path = self.directory / HASHES_FILE
        if not_regular_reason(hashes_path) is not None:
            return None
        try:
            document = json.loads(hashes_path.read_text())
        except (OSError, ValueError, RecursionError):
            return None
        modules = document.get("modules") if isinstance(document, dict) else None
        return modules if isinstance(modules, dict) else None

    def _write_notes(self, modules: dict) -> None:
        document = json.dumps({"modules": modules}, indent=1, sort_keys=True).encode()
        atomic_write(self.directory / HASHES_FILE, [document])

    def forget_absent(self, folder: Path) -> None:
        """Remove the entries, and the notes, of program files no longer in ``folder``, the bundle's (under the
        record's lock); what cannot be read or removed is left.

        Only a changed program's entries were removed: a release that dropped a
        batch size or renamed a program left its executables in ``.cache/`` for
        good, tens to hundreds of MB each (the long-life hunt). The folder holds
        one release, so no server sharing it needs them.
        """
        if not self.enabled or not self.directory.is_dir() or self.directory.is_symlink():
            return
        try:
            present = {path.name for path in folder.iterdir()}
        except OSError:
            return
        lock = self.directory / HASHES_LOCK_FILE
        try:
            if not_regular_reason(lock) is not None:
                return
            with locked(lock):
                for path in self.directory.glob(f"*{ENTRY_SUFFIX}"):
                    module = path.name[:-len(ENTRY_SUFFIX)].rpartition(".")[0]
                    if module and module not in present and not path.is_symlink():
                        path.unlink(missing_ok=True)
                self._forget_notes(present)
        except OSError as err:  # (a read-only bundle: nothing to forget there)
            log.debug("%s: stale executables not removed: %s", folder.name, err)

    def _forget_notes(self, present: set[str]) -> None:
        """Drop the record's notes of program files not in ``present`` (under the lock)."""
        modules = self._read_notes()
        if modules is None or all(name in present for name in modules):
            return
        self._write_notes({name: sha for name, sha in modules.items() if name in present})

    def _remove_entries(self, module_name: str, sha256: str) -> None:
        for path in self.directory.glob(f"{module_name}.*{ENTRY_SUFFIX}"):
            if not_regular_reason(path) is not None:
                continue  # opening a FIFO would block; it is replaced when that entry is next needed
            try:
                with open(path, "rb") as f:
                    head = f.read(len(_MAGIC) + _LENGTH.size)
                    (length,) = _LENGTH.unpack_from(head, len(_MAGIC))
                    header = json.loads(f.read(min(length, 1 << 16)))
                if header["key"]["module_sha256"] == sha256:
                    path.unlink()
            except (OSError, ValueError, KeyError, TypeError, RecursionError, struct.error):
                continue  # not ours to judge; a bad entry is rebuilt when it is next needed


def file_sha256(data: bytes) -> str:
    """Hex SHA-256 of a program file's contents."""
    return hashlib.sha256(data).hexdigest()
