"""One dlopened copy of a cxx model's shared library, and the C types of its ABI.

The dynamic loader is driven directly (``dlopen`` / ``dlsym`` / ``dlclose``
from the C library) rather than through :class:`ctypes.CDLL`, which offers no
public way to close a library: a model's unload must unmap its code so that a
changed library can be loaded in its place. Functions are called through
:func:`ctypes.CFUNCTYPE` prototypes, which release the GIL for the call.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import re
import shutil
import threading
import uuid
from pathlib import Path
from typing import BinaryIO, Callable

from nereid.backends.cxx import API_VERSION
from nereid.backends.cxx.process_guard import process_state_kept
from nereid.backends.elf_files import elf_cut_short, link_names, needed_libraries, unique_symbols
from nereid.backends.scratch import require_executable_folder, scratch_folder_refused
from nereid.errors import ConfigError
from nereid.files import not_regular_reason

log = logging.getLogger(__name__)


class CTensor(ctypes.Structure):
    """``nereid_tensor`` from nereid_cxx.h."""

    _fields_ = [
        ("name", ctypes.c_char_p),
        ("dtype", ctypes.c_char_p),
        ("rank", ctypes.c_int64),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("data", ctypes.c_void_p),
        ("byte_size", ctypes.c_uint64),
    ]


INFER_FUNCTION = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(CTensor), ctypes.c_size_t,
                                  ctypes.POINTER(CTensor), ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t)
LOAD_FUNCTION = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p),
                                 ctypes.c_char_p, ctypes.c_size_t)
UNLOAD_FUNCTION = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

_RTLD_NOW = getattr(os, "RTLD_NOW", 2)
_RTLD_LOCAL = getattr(os, "RTLD_LOCAL", 0)  # each model's symbols stay its own
_RTLD_NOLOAD = getattr(os, "RTLD_NOLOAD", 4)
_RTLD_NODELETE = getattr(os, "RTLD_NODELETE", 0x1000)
_RTLD_DI_LINKMAP = 2  # dlinfo's request for an object's struct link_map
# Runtimes whose pool threads outlive every call into them, spinning in their code: never unloaded (see
# NativeLibrary._keep_system_libraries). GNU and LLVM OpenMP, Intel's, TBB; a wheel's vendored copy carries a hash.
_THREAD_POOL_RUNTIME = re.compile(r"lib(gomp|omp|iomp5|tbb)([-.].*)?\.so")
# The content digest of each dependency copy a load of this process made, by the copy's path (and the links to it
# beside it): kept after its folder is removed, where a library of its name may stay mapped, held by another model,
# so that a later load given it can still tell whether it ships the same (see NativeLibrary._say_whose).
_COPY_DIGESTS: dict[str, str] = {}
_COPY_DIGESTS_LOCK = threading.Lock()  # (loads run on threads of their own)
_MAX_COPY_DIGESTS = 4096  # the oldest forgotten past this: a warning missed, never a wrong one


@functools.cache
def _loader() -> ctypes.CDLL:
    """The dynamic loader's functions, with their C signatures (set up once per process)."""
    libc = ctypes.CDLL(None)
    libc.dlopen.argtypes, libc.dlopen.restype = [ctypes.c_char_p, ctypes.c_int], ctypes.c_void_p
    libc.dlsym.argtypes, libc.dlsym.restype = [ctypes.c_void_p, ctypes.c_char_p], ctypes.c_void_p
    libc.dlclose.argtypes, libc.dlclose.restype = [ctypes.c_void_p], ctypes.c_int
    libc.dlerror.argtypes, libc.dlerror.restype = [], ctypes.c_char_p
    libc.dlinfo.argtypes, libc.dlinfo.restype = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)], \
        ctypes.c_int
    return libc


# ELF e_machine values of the machines a library is most often built for by mistake.
_MACHINE_NAMES = {3: "x86 (32-bit)", 8: "MIPS", 20: "PowerPC", 21: "PowerPC64", 22: "s390x", 40: "ARM (32-bit)",
                  62: "x86-64", 183: "AArch64", 243: "RISC-V", 258: "LoongArch"}


def _elf_machine(path: Path | str) -> int | None:
    """The ELF header's e_machine of ``path`` (in the file's own byte order); None when not an ELF file."""
    try:
        with open(path, "rb") as file:
            header = file.read(20)
    except OSError:
        return None
    if len(header) < 20 or header[:4] != b"\x7fELF" or header[5] not in (1, 2):
        return None
    return int.from_bytes(header[18:20], "little" if header[5] == 1 else "big")


# A C++ name as the linker sees it (Itanium ABI mangling): what the loader names an undefined symbol by.
_MANGLED = re.compile(r"\b_Z[0-9A-Za-z_]+")


def _warn_of_unique_symbols(model: str, path: Path, copy: Path) -> None:
    """Say, once per load, when the library (its loaded ``copy``) defines symbols the loader binds process-wide
    (STB_GNU_UNIQUE): a prebuilt library built without -fno-gnu-unique served the objects of its first load after
    it was rebuilt and reloaded, and two models loading it shared them, with no word (the native-models hunt)."""
    names = unique_symbols(os.fspath(copy))
    if not names:
        return
    demangle = _demangler()
    shown = ", ".join((demangle(name) if demangle is not None else None) or name for name in names[:3])
    log.warning("model '%s': shared library %s defines %d symbol(s) the loader binds process-wide (STB_GNU_UNIQUE, "
                "GCC's for the statics of inline functions and templates: %s%s): those objects outlive a reload of "
                "a rebuilt library and are shared with every model whose library defines them, and the library is "
                "never unmapped; build it with -fno-gnu-unique", model, path, len(names), shown,
                ", ..." if len(names) > 3 else "")


def _demangled(message: str) -> str:
    """``message`` with each C++ mangled name followed by its readable form, as ``c++filt`` gives it
    (``_Z20not_defined_anywherev (not_defined_anywhere())``); as it is where none can be demangled."""
    demangle = _demangler()
    if demangle is None:
        return message
    return _MANGLED.sub(lambda match: f"{match[0]} ({readable})" if (readable := demangle(match[0])) else match[0],
                        message)


@functools.cache
def _demangler() -> Callable[[str], str | None] | None:
    """The C++ runtime's own ``__cxa_demangle``, wrapped; None where there is no libstdc++ to ask."""
    try:
        runtime = ctypes.CDLL("libstdc++.so.6")
        cxa_demangle = runtime.__cxa_demangle
    except (OSError, AttributeError):
        return None
    cxa_demangle.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    cxa_demangle.restype = ctypes.c_void_p
    libc = ctypes.CDLL(None)
    libc.free.argtypes, libc.free.restype = [ctypes.c_void_p], None

    def demangle(name: str) -> str | None:
        status = ctypes.c_int(-1)
        text = cxa_demangle(name.encode(), None, None, ctypes.byref(status))
        if not text:
            return None
        try:
            return ctypes.string_at(text).decode("utf-8", errors="replace") if status.value == 0 else None
        finally:
            libc.free(text)  # (malloc'd by the runtime for the caller)
    return demangle


def _foreign_machine(path: Path) -> str | None:
    """Why ``path`` cannot load here when it was built for another machine than this server's; else None."""
    theirs, ours = _elf_machine(path), _elf_machine("/proc/self/exe")
    if theirs is None or ours is None or theirs == ours:
        return None
    def name(machine: int) -> str:
        return _MACHINE_NAMES.get(machine, f"ELF machine {machine}")
    return f"it is built for {name(theirs)}, and this server runs on {name(ours)}: build it for this machine"


_COPY_CHUNK = 1 << 20  # bytes read and written at a time by a library's copy


def _needed_or_none(path: str) -> list[str]:
    """The DT_NEEDED names of the ELF file at ``path``; none when it cannot be read as one (it is loaded: the
    loader read it)."""
    try:
        return list(needed_libraries(path))
    except (OSError, ValueError, OverflowError, MemoryError):
        return []


def _origin_folders(entries: list[str], origin: Path) -> list[Path]:
    """The folders of a RUNPATH or RPATH list that are relative to the object's own (``$ORIGIN``, ``${ORIGIN}``),
    with ``origin`` put in; the others (the system's, a build machine's) say nothing about the model's files."""
    folders = []
    for entry in entries:
        for token in ("$ORIGIN", "${ORIGIN}"):
            if entry == token or entry.startswith(token + "/"):
                folders.append(Path(os.path.normpath(str(origin) + entry[len(token):])))
                break
    return folders


def _shipped_files(library: Path) -> set[Path]:
    """The files that the shared library ``library`` (an absolute path) finds through its ``$ORIGIN`` or beside
    it, directly or through each other: the libraries that ship with it, as absolute paths.

    A DT_NEEDED name is looked for as the loader looks for it: in the folders
    of the needing object's RUNPATH, or else of its RPATH and then of its
    loaders' RPATH (a loader with a RUNPATH adds none), those relative to its
    own folder (``$ORIGIN``, ``$ORIGIN/lib``, ``$ORIGIN/../lib``), then beside
    it. A link found so is followed to the file it names (``libdep.so.1 ->
    libdep.so.1.2``, ``lib/libdep.so -> ../vendor/libdep.so``) when the link
    reads the same as a path (no ``..`` after a linked folder).
    """
    found: set[Path] = set()
    pending: list[tuple[Path, list[Path]]] = [(library, [])]  # (object, its loaders' RPATH folders)
    while pending:
        needing, inherited = pending.pop()
        names = link_names(str(needing))
        if names.runpath is not None:
            # (Then no RPATH is read for its own needs, its loaders' neither; its RPATH adds none for its children.)
            folders, chain = _origin_folders(names.runpath, needing.parent), inherited
        else:
            own = _origin_folders(names.rpath, needing.parent)
            folders, chain = own + inherited, own + inherited
        for name in names.needed:
            if "/" in name:
                continue  # a path: the loader opens it as written
            entry = next((folder / name for folder in [*folders, needing.parent] if os.path.lexists(folder / name)),
                         None)
            while entry is not None and entry not in found:
                found.add(entry)
                if not os.path.islink(entry):
                    pending.append((entry, chain))
                    break
                entry = _link_target(entry)
    return found


def _link_target(link: Path) -> Path | None:
    """The file the symlink ``link`` names, as a path built from the link's relative text (``..`` taken as
    written); None for an absolute link (to the system's library: not the model's), when that path would not lead
    where the link leads (a ``..`` after a linked folder), or when it cannot be read."""
    try:
        text = os.readlink(link)
        target = Path(os.path.normpath(os.path.join(link.parent, text)))
        return target if not os.path.isabs(text) and os.path.realpath(target) == os.path.realpath(link) else None
    except OSError:  # (replaced meanwhile: the mirror takes what it finds then)
        return None


def _mirror_folder(model: str, path: Path, root: Path, target: Path, wanted: set[str], scratch_dir: Path,
                   relative: str = ".") -> None:
    """Give ``target`` (the copy of ``root``'s folder ``relative``) every entry of that folder: copies of the
    ``wanted`` files there (paths relative to ``root``), folders of their own for the ones that lead to wanted
    files, and links to everything else.

    The libraries that the shared library ``path`` needs from its model's
    folder are copied, as the library is: mapped from the repository, a deploy
    that copies a new one over one of them (the same file, rewritten) would
    change the code under the running model and crash the server, in a
    subfolder (``lib/`` under a RUNPATH ``$ORIGIN/lib``) as well as beside it.
    A link among them (``libdep.so.1 -> libdep.so.1.2``, ``lib/libdep.so ->
    ../vendor/libdep.so``) is made again, leading to the copy. Everything else
    is linked, not copied: a library kept in a folder of thousands (a system's
    lib folder) costs no copy of them.
    """
    source, library = root / relative, os.path.relpath(path, root)
    inside = [os.path.relpath(item, relative) for item in wanted]
    inside = [item for item in inside if not _outside(item)]
    leading = {item.split(os.sep, 1)[0] for item in inside if os.sep in item}
    try:
        names = os.listdir(source)
    except OSError:
        # A folder that may be entered but not listed: what the library needs from it still goes in, without the
        # neighbours (the library loads without them).
        names = sorted({item.split(os.sep, 1)[0] for item in inside})
    for name in names:
        inner = os.path.normpath(os.path.join(relative, name))
        entry, destination = source / name, target / name
        if inner == library:
            continue  # the library's own copy, made before
        if inner in wanted and (reason := not_regular_reason(entry)) is not None:
            # (A FIFO: the loader would wait on it for ever, holding the load.)
            raise ConfigError(f"model '{model}': shared library {path} needs {inner}, and {reason}")
        if inner in wanted and entry.is_file() and not entry.is_symlink():
            _copy_library(model, entry, destination, scratch_dir)
            _require_whole(model, entry, destination, f"shared library {path} needs {inner}, but")
            continue
        try:
            if name in leading and entry.is_dir():
                # (A linked folder too, lib -> sdk-1.0/lib or current -> v1: a folder of its own in the copy, with the
                # copies of what the library needs from it.)
                destination.mkdir(exist_ok=True)  # (the library's own folder is made first)
                _mirror_folder(model, path, root, destination, wanted, scratch_dir, inner)
                continue
            link = os.readlink(entry) if inner in wanted else None  # (wanted: a file, or a link)
            if link is not None and not os.path.isabs(link) and \
                    os.path.normpath(os.path.join(relative, link)) in wanted:  # a link among them: to the copy
                os.symlink(link, destination)
            elif os.path.lexists(entry):
                os.symlink(os.path.abspath(entry), destination)
        except OSError as err:
            raise scratch_folder_refused(model, f"link the files around shared library {path} into", scratch_dir,
                                         err) from None


def _remember_copies(paths: list[Path]) -> None:
    """Record the content digest of each dependency copy (a file, or a link to one beside it) by its path and its
    real path, for :meth:`NativeLibrary._say_whose`."""
    digests: dict[str, str] = {}
    for path in paths:
        real = os.path.realpath(path)
        if real not in digests:
            try:
                with open(real, "rb") as file:
                    digests[real] = hashlib.file_digest(file, "sha256").hexdigest()
            except OSError:
                continue
        digests[os.path.abspath(path)] = digests[real]
    with _COPY_DIGESTS_LOCK:
        _COPY_DIGESTS.update(digests)
        while len(_COPY_DIGESTS) > _MAX_COPY_DIGESTS:
            del _COPY_DIGESTS[next(iter(_COPY_DIGESTS))]


def _copy_digest(path: str) -> str | None:
    """The digest recorded for the dependency copy at ``path`` (None: no copy a load made)."""
    with _COPY_DIGESTS_LOCK:
        return _COPY_DIGESTS.get(os.path.abspath(path))


def _under(path: str, folder: str) -> bool:
    """True when the real path ``path`` lies in the real folder ``folder``."""
    return os.path.commonpath([path, folder]) == folder


def _inside(path: Path, folder: Path) -> bool:
    """True when ``path`` lies in ``folder``, both as written (the loader's $ORIGIN is the path it opened)."""
    return not _outside(os.path.relpath(os.path.abspath(path), os.path.abspath(folder)))


def _outside(relative: str) -> bool:
    """True when the relative path ``relative`` leads out of the folder it is relative to."""
    return relative == os.pardir or relative.startswith(os.pardir + os.sep)


def _require_whole(model: str, path: Path, copy: Path, what: str) -> None:
    """ConfigError unless ``copy`` (of the library ``path``) is a whole ELF file: dlopen maps it, and a part
    missing (a file cut short, or still being written) faults at the first touch, ending the server (SIGBUS)."""
    if (reason := elf_cut_short(str(copy))) is not None:
        raise ConfigError(f"model '{model}': {what} {path} cannot be loaded: {reason}")


def _copy_library(model: str, path: Path, copy: Path, scratch_dir: Path) -> None:
    """Copy the shared library ``path`` to ``copy``, in ``scratch_dir``; ConfigError naming the side that failed.

    A read error is the library's (an unreadable file, a disk error under the repository); a write error is the
    scratch folder's (a full disk, a file size limit), so it names that folder, not the library. A partial copy
    is removed: it would otherwise stay in the scratch folder until the server stops.
    """
    def cannot_copy(err: OSError) -> ConfigError:
        return scratch_folder_refused(model, f"copy shared library {path} into", scratch_dir, err)

    try:
        source = open(path, "rb")
    except OSError as err:
        raise _cannot_read(model, path, err) from None
    with source:
        try:
            target = open(copy, "xb")
        except OSError as err:
            raise cannot_copy(err) from None
        try:
            with target:  # (a buffered write may fail only at the close's flush: still the copy's error)
                while chunk := _read_library(model, path, source):
                    target.write(chunk)
        except OSError as err:  # the copy's: a read error is a ConfigError already
            copy.unlink(missing_ok=True)
            raise cannot_copy(err) from None
        except BaseException:
            copy.unlink(missing_ok=True)
            raise


def _read_library(model: str, path: Path, source: BinaryIO) -> bytes:
    """The next chunk of the shared library ``path`` open as ``source`` (empty at its end); ConfigError naming it."""
    try:
        return source.read(_COPY_CHUNK)
    except OSError as err:
        raise _cannot_read(model, path, err) from None


def _cannot_read(model: str, path: Path, err: OSError) -> ConfigError:
    """The load's error when the shared library ``path`` itself cannot be read (opened, or read from)."""
    return ConfigError(f"model '{model}': cannot read shared library {path}: {err.strerror or err}")


class NativeLibrary:
    """A private copy of a shared library, dlopened with its nereid symbols looked up.

    ``dlopen`` returns the already-loaded object for a path it has seen, so a
    rebuilt library would never be picked up by a reload; loading a fresh copy
    under a unique name makes every load see the file as it is now (and makes
    rewriting the original in place harmless to the running copy).
    """

    def __init__(self, model: str, path: Path, scratch_dir: Path, model_folder: Path | None = None) -> None:
        self.path = path
        self._model_folder = model_folder
        self._scratch_dir = scratch_dir
        if (reason := not_regular_reason(path)) is not None:  # a folder, a FIFO: named as such
            raise ConfigError(f"model '{model}': shared library {reason}")
        if not path.is_file():
            raise ConfigError(f"model '{model}': shared library {path} does not exist")
        # The copy's code is mapped from the scratch folder: on a noexec mount dlopen could only say "failed to
        # map segment", of a file the user never named.
        require_executable_folder(model, scratch_dir, f"shared library {path} runs from a copy in")
        # The copy keeps its name and its place in a copy of its model's folder (of its own folder, for a library
        # outside it) in a folder of its own: copies of the libraries it needs from there, links to the rest. A
        # library that finds the libraries it needs through a RUNPATH of $ORIGIN, $ORIGIN/lib or $ORIGIN/../lib
        # finds them there.
        # (The copy's folder holds the library's own, and every folder it finds a library in through $ORIGIN, even
        # beyond the model's: $ORIGIN/../../shared of the copy leads into the copy, as of the library into the
        # repository.)
        library = Path(os.path.abspath(path))
        shipped = _shipped_files(library)
        start = model_folder if model_folder is not None and _inside(library, model_folder) else library.parent
        self._root = Path(os.path.commonpath([os.path.abspath(start), *(str(file.parent) for file in shipped)]))
        # (The stem cut: a name near the file system's limit of 255 bytes left no room for the suffix.)
        self._folder = scratch_dir / f"{path.stem[:100]}-{uuid.uuid4().hex[:12]}"
        self._library = os.path.relpath(library, self._root)
        self._copy = self._folder / self._library
        self._shipped = {os.path.relpath(file, self._root) for file in shipped}
        self.model = model
        try:
            self._folder.mkdir()
        except OSError as err:
            raise scratch_folder_refused(model, f"copy shared library {path} into", scratch_dir, err) from None
        try:
            self._copy.parent.mkdir(parents=True, exist_ok=True)
            _copy_library(model, path, self._copy, scratch_dir)
            _require_whole(model, path, self._copy, "shared library")
            _mirror_folder(model, path, self._root, self._folder, {self._library, *self._shipped}, scratch_dir)
            _remember_copies([self._folder / relative for relative in self._shipped])
        except BaseException:
            shutil.rmtree(self._folder, ignore_errors=True)
            raise
        self._libc = _loader()
        # Said first: the library's static constructors run in the server's own process, and one that exits or
        # crashes ends it (nereid check too) with no other line naming the model.
        log.info("model '%s': opening shared library %s", model, path)
        with process_state_kept(model, "opening its shared library"):  # (its static constructors run here)
            self._handle: int | None = self._libc.dlopen(os.fsencode(self._copy), _RTLD_NOW | _RTLD_LOCAL)
        if not self._handle:
            # The loader names the file it was given: name the user's instead, once, and the copy's folder,
            # which the fault may be of rather than the file's (a file system that refuses to map code).
            message = self._dlerror().removeprefix(f"{self._copy}: ").replace(str(self._copy), str(path))
            # glibc says "No such file or directory" of a library built for another machine.
            message = _foreign_machine(self._copy) or _demangled(message)
            shutil.rmtree(self._folder, ignore_errors=True)
            raise ConfigError(f"model '{model}': cannot load shared library {path} (dlopened from its copy in "
                              f"{scratch_dir}): {message}")
        self._keep_system_libraries()
        _warn_of_unique_symbols(model, path, self._copy)
        try:
            self._check_api_version(model, path)
            infer = self._symbol("nereid_infer")
            if infer is None:
                raise ConfigError(f"model '{model}': shared library {path} does not export nereid_infer "
                                  "(declare it extern \"C\"; see `nereid cxx-header`)")
            self.infer = INFER_FUNCTION(infer)
            load, unload = self._symbol("nereid_load"), self._symbol("nereid_unload")
            self.load = LOAD_FUNCTION(load) if load is not None else None
            self.unload = UNLOAD_FUNCTION(unload) if unload is not None else None
        except BaseException:
            self.close()
            raise

    def _keep_system_libraries(self) -> None:
        """Keep the libraries the copy needs from outside the model's folder (the system's: libgomp, libstdc++),
        and any thread-pool runtime it needs (OpenMP's, TBB's, even one shipped with the model), loaded for the
        server's life, as if the server itself were linked against them.

        Unloaded with the copy when nothing else held them, they left threads of theirs running unmapped code:
        OpenMP's pool (libgomp has no call to stop it, and its threads spin in its code a while after each
        parallel region) crashed the server with SIGSEGV at an unload, and ``nereid check`` at every run (the
        native-models hunt; a libgomp shipped beside the library, as wheels vendor it, the review hunt). The
        model's other libraries, beside its own or elsewhere in its folder, still unload with it, and a reload
        reads them again.
        """
        shipped = {os.path.basename(relative) for relative in self._shipped}
        needed: set[str] = set()
        for relative in [self._library, *self._shipped]:
            copy = self._folder / relative
            if copy.is_file() and not copy.is_symlink():
                needed.update(needed_libraries(str(copy)))
        # (Any model's private copies count as a model's own: a name another model ships, loaded first, is that
        # model's, and unloads with it; pinned, a rebuilt one was never read again; the review hunt.)
        model_folders = [os.path.realpath(folder) for folder in (self._scratch_dir, self._model_folder)
                         if folder is not None]
        pending, seen = sorted(needed, reverse=True), set(needed)
        while pending:
            name = pending.pop()
            loaded = self._loaded_path(name)
            if loaded is None:
                continue
            resolved = os.path.realpath(loaded)
            inside = any(_under(resolved, folder) for folder in model_folders)
            self._say_whose(name, loaded, resolved, name in shipped)
            if (name not in shipped and not inside) or _THREAD_POOL_RUNTIME.match(os.path.basename(name)):
                # (Already loaded, as a dependency: NOLOAD finds it, NODELETE marks it never to be unloaded.)
                self._libc.dlopen(os.fsencode(name), _RTLD_NOW | _RTLD_NOLOAD | _RTLD_NODELETE)
            elif inside:
                # A library of the model's own, elsewhere in its folder (lib/, under a RUNPATH $ORIGIN/lib, as SDKs
                # lay them out): what it needs is looked at too, a libgomp only it needs unloaded with the model
                # and crashed the server (the read hunt). (What a kept library needs stays with it.)
                for dependency in _needed_or_none(resolved):
                    if dependency not in seen:
                        seen.add(dependency)
                        pending.append(dependency)

    def _say_whose(self, name: str, loaded: str, resolved: str, shipped: bool) -> None:
        """Warn of a library ``name`` of a model's own that the loader did not take from this copy's folder:
        from the repository (an absolute RUNPATH, a link leading there), whose rewrite changes code under the running
        model; or, for one this copy ships (``shipped``), another copy of its name (another model's, or an earlier
        version's of this one, still loaded) that differs from this one's: the loader shares a library by its name,
        so the one shipped is not run until no loaded model holds one of that name."""
        if _under(resolved, os.path.realpath(self._folder)):
            return
        if (self._model_folder is not None and _under(resolved, os.path.realpath(self._model_folder))
                and not _under(resolved, os.path.realpath(self._scratch_dir))):
            log.warning("model '%s': shared library %s needs %s, which the loader took from the model's folder "
                        "(%s), not from the copy the server made: rewriting it while the model serves can crash the "
                        "server; have the library find it through its RUNPATH relative to itself "
                        "(-Wl,-rpath,'$ORIGIN/lib'), not an absolute path", self.model, self.path, name, loaded)
            return
        if not shipped or _THREAD_POOL_RUNTIME.match(os.path.basename(name)):
            return  # (a runtime it ships is kept loaded for good: see _keep_system_libraries)
        theirs = _copy_digest(loaded) or _copy_digest(resolved)
        ours = {_copy_digest(str(self._folder / relative)) for relative in self._shipped
                if os.path.basename(relative) == name}
        if theirs is not None and theirs not in ours:  # (None: no copy a load made, the system's: nothing to say)
            log.warning("model '%s': shared library %s ships %s, but the loader gave it the one already loaded under "
                        "that name (for another model, or a version of this one still loaded), which differs: the "
                        "loader shares a library by its name, so the one it ships runs only once no loaded model "
                        "holds one of that name (unload them, then load)", self.model, self.path, name)

    def _loaded_path(self, name: str) -> str | None:
        """Where the loader found the library ``name`` the copy needs (the path it mapped), or None when it is not
        loaded (or its path cannot be told)."""
        handle = self._libc.dlopen(os.fsencode(name), _RTLD_NOW | _RTLD_NOLOAD)
        if not handle:
            return None
        try:
            entry = ctypes.c_void_p()
            if self._libc.dlinfo(handle, _RTLD_DI_LINKMAP, ctypes.byref(entry)) != 0 or not entry.value:
                return None
            # struct link_map { ElfW(Addr) l_addr; char *l_name; ... }: its name, the second field.
            named = ctypes.c_char_p.from_address(entry.value + ctypes.sizeof(ctypes.c_void_p)).value
            return os.fsdecode(named) if named else None
        finally:
            self._libc.dlclose(handle)  # (the NOLOAD open's own reference)

    def _check_api_version(self, model: str, path: Path) -> None:
        """ConfigError when the library was built against another version of nereid_cxx.h's ABI: its functions'
        arguments would not be what this server passes (as Triton checks a backend's TRITONBACKEND_ApiVersion).
        A library without ``nereid_cxx_api_version`` (built before the header defined it) is taken as version 1.
        """
        address = self._symbol("nereid_cxx_api_version")
        if address is None:
            return
        version = ctypes.c_uint32.from_address(address).value
        if version != API_VERSION:
            raise ConfigError(f"model '{model}': shared library {path} was built against nereid_cxx.h's API version "
                              f"{version}; this server's is {API_VERSION}: build it again against the header "
                              "`nereid cxx-header` prints")

    def _symbol(self, name: str) -> int | None:
        assert self._handle, "library closed"
        return self._libc.dlsym(self._handle, name.encode()) or None

    def _dlerror(self) -> str:
        message = self._libc.dlerror()
        return message.decode("utf-8", "replace") if message else "unknown dynamic loader error"

    def close(self) -> None:
        """dlclose the copy and delete it; the function pointers must not be called afterwards."""
        self.infer = self.load = self.unload = None  # type: ignore[assignment]
        if self._handle:
            self._libc.dlclose(self._handle)
            self._handle = None
        shutil.rmtree(self._folder, ignore_errors=True)  # (its links are removed, never followed)
