"""Compiling a model's ``main.cpp`` once, cached by the hash of its sources and compiler.

A build's key covers the files in its model folder (see :func:`code_files`).
What it includes from elsewhere (``#include "../../shared/k.h"``) is known
only once it is compiled: the compiler lists it (``-MMD``), and a record
beside the build (``<build>.deps``) keeps each such file's content hash; a
build whose record no longer matches is built again. The record also holds
the build's own name, size and SHA-256, taken when it was made: a cached build
that no longer has them (a torn write, bit-rot, another build copied over it)
is named in a WARNING and built again, before any run executes it or the server
process dlopens it (a cxx library).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import stat
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Collection, Iterator, Sequence

from nereid.errors import ConfigError
from nereid.files import (MAX_FOLDER_DEPTH, atomic_write, folder_depth, fsync_folder, kind_of, not_regular_reason,
                          read_regular_file, temporary_name)
from nereid.leftovers import remove_stale_partials
from nereid.processes import new_children_stopped

from nereid.backends.subprocess.runner import DEFAULT_PATH, ProcessGroups, run_model_process
from nereid.backends.host_cpu import host_cpu

# What an #include can reach: sources, headers, and the inline and template files some projects include.
# (.def: X-macro tables; .cuh: CUDA headers; .txx / .ixx / .cppm: template and module units.)
HEADER_SUFFIXES = (".h", ".hh", ".hpp", ".hxx", ".h++", ".H", ".inl", ".ipp", ".tpp", ".tcc", ".txx", ".inc",
                   ".def", ".cuh", ".ixx", ".cppm")
COMPILED_SUFFIXES = (".cpp", ".cc", ".cxx", ".c++", ".C", ".c")  # what a compiler takes as a translation unit
SOURCE_SUFFIXES = (*COMPILED_SUFFIXES, *HEADER_SUFFIXES)
CXX_FLAGS = ("-O2", "-std=c++17")
COMPILE_TIMEOUT_S = 600
CACHE_DIR = ".cache"
# Where a model's builds go, in its scratch folder, when its .cache/ cannot be written (a read-only
# repository, a full disk): used for this server's life, built again at its next start.
SCRATCH_CACHE_DIR = "build-cache"
MESSAGE_TAIL_CHARS = 4000
# Of those, the first ones: a compiler's first error is its root cause, the cascade after it matters less.
MESSAGE_HEAD_CHARS = 3000
VERSION_PROBE_TIMEOUT_S = 30  # a compiler's --version, asked for its identity in a build's key
_COMPILE_SLOTS = threading.BoundedSemaphore(max(1, len(os.sched_getaffinity(0))))  # compilers at once
# A build of sources edited while they compiled is kept under a name of its own (hidden, with this prefix).
EDITED_PREFIX = "edited-"
# How often a compile, or its wait for a slot, looks whether its load was abandoned.
ABANDON_POLL_S = 0.2
# A source or header larger than this is refused rather than read into memory to be hashed.
MAX_CODE_FILE_BYTES = 1 << 30
# Beside each build: its name, size and sha256, and the files it included from outside its key, with their content
# hashes (see cached_build).
RECORD_SUFFIX = ".deps"
MAX_RECORD_BYTES = 16 << 20  # a record is a few lines: a larger file under its name is no record
HASH_CHUNK_BYTES = 1 << 20  # read at a time to hash a build (never mapped: a file cut short under a map is SIGBUS)
# Compiler words (in $CXX) that target the machine the compiler runs on: its instruction set, or its tuning.
NATIVE_FLAGS = ("-march=native", "-mcpu=native", "-mtune=native")

log = logging.getLogger(__name__)

# The compiler command: the program's resolved path, then the words that followed it in $CXX
# (CXX="ccache g++", as make and CMake take it).
Compiler = tuple[str, ...]


def find_compiler() -> Compiler:
    """The C++ compiler command: ``$CXX`` split as a shell would (``ccache g++``), else (unset or blank) ``c++``."""
    text = os.environ.get("CXX", "")
    try:
        words = shlex.split(text) or ["c++"]  # an empty CXX is unset, as CMake takes it
    except ValueError as err:
        raise ConfigError(f"no C++ compiler: CXX={text!r} cannot be split into words ({err})") from None
    path = shutil.which(words[0])
    if path is None:
        where = "is not an executable file" if os.sep in words[0] else "is not on PATH"
        raise ConfigError(f"no C++ compiler: '{words[0]}' {where} (set CXX or install g++)")
    # Absolute: a relative one (CXX=./cxxwrap, or "." on PATH) is the server's working directory's, and builds run
    # in the model's folder (they failed with a raw FileNotFoundError naming './cxxwrap').
    return (os.path.abspath(path), *words[1:])


def compiler_command(compiler: Compiler, arguments: Sequence[str]) -> list[str]:
    """The command that compiles with ``arguments``: nereid's own flags (CXX_FLAGS) before the flags $CXX gives,
    which then win, as GCC and Clang take an option's last value (CXX="c++ -std=c++20" built as C++17, and
    CXX="g++ -O0 -g" at -O2, the author hunt); after the words of the compiler itself (CXX="ccache g++")."""
    # After the last word that names a program: the compiler, past a launcher and the launcher's own options
    # (CXX="env -u FOO g++", "nice -n 5 g++": the review found the first option word taken for the compiler's).
    program_at = max((index for index, word in enumerate(compiler)
                      if index == 0 or (not word.startswith("-") and shutil.which(word))), default=0)
    ours = [word for word in arguments if word in CXX_FLAGS]
    return [*compiler[:program_at + 1], *ours, *compiler[program_at + 1:],
            *(word for word in arguments if word not in CXX_FLAGS)]


def flags_order_key(compiler: Compiler) -> bytes:
    """What a build key adds for a compiler whose $CXX gives flags: its builds from before they came after nereid's
    own (see :func:`compiler_command`) were built with nereid's winning, and are not reused."""
    return b"\0CXX flags last" if any(word.startswith("-") for word in compiler[1:]) else b""


def compiler_environment(**extra: str) -> dict[str, str]:
    """The server's environment plus ``extra``, for running the compiler; PATH is DEFAULT_PATH when unset or empty.

    Without a PATH (env -i, a bare init) find_compiler still finds c++ through the system's default path
    (shutil.which), but gcc's driver looks for as and ld on PATH.
    """
    env = {**os.environ, **extra}
    # (An empty PATH too: CXX=/usr/bin/g++ is found without one, and its driver would not find ld all the same.)
    if not env.get("PATH"):
        env["PATH"] = DEFAULT_PATH
    return env


# Environment variables the compiler driver reads as include and library paths or its own programs' places.
COMPILER_VARIABLES = ("CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH", "OBJC_INCLUDE_PATH", "LIBRARY_PATH",
                      "GCC_EXEC_PREFIX", "COMPILER_PATH")


def compiler_key(compiler: Compiler) -> bytes:
    """The compiler as a build key's part: its command, the file that runs and what ``--version`` says, and this
    machine's CPU when the command targets it (``CXX="g++ -march=native"``, see :data:`NATIVE_FLAGS`).

    The command alone kept a binary another compiler had built under the same name (``/usr/bin/c++``
    repointed by update-alternatives, a newer image): a server never runs a build its compiler did not make.
    A ``-march=native`` build uses the instructions of the CPU it was built on (AVX-512...): one found in a
    ``.cache/`` shipped to, or shared with, a machine without them would die of SIGILL at its first request
    (a cxx library: in the server's process, taking every model down), so each CPU gets builds of its own.
    """
    parts = (*compiler, os.path.realpath(compiler[0]), compiler_version(compiler))
    # The variables GCC and clang read as flags: a CPATH naming other headers built the same sources otherwise,
    # and the build kept under the old name was served (the cxx read hunt).
    parts += tuple(f"{name}={os.environ[name]}" for name in COMPILER_VARIABLES if os.environ.get(name))
    if any(word.startswith(NATIVE_FLAGS) for word in compiler[1:]):
        parts += (f"host cpu {host_cpu()}",)  # (as XLA's CPU executables are keyed: the model and feature flags)
    return "\0".join(parts).encode()


def compiler_version(compiler: Compiler) -> str:
    """What ``compiler --version`` prints ("" when it cannot say), asked once per version of the files it runs.

    Those are each word of the command that names a program (``ccache g++``:
    ccache and g++ both, so a g++ upgraded behind ccache is asked again). The
    probe runs like a build: in its own process group, killed whole at its
    end or time limit, and by a stopping server (a compiler wrapper's children
    too). One that says nothing (timed out, failed to start) is asked again
    next time.
    """
    stamps = []
    for word in compiler:
        found = shutil.which(word)
        if found is not None:
            try:
                status = os.stat(found)
            except OSError:
                continue
            stamps.append((os.path.realpath(found), status.st_size, status.st_mtime_ns, status.st_ino))
    key = (compiler, tuple(stamps))
    with _VERSIONS_LOCK:
        known = _VERSIONS.get(key)
    if known is not None:
        return known
    try:
        probe = run_model_process([*compiler, "--version"], cwd="/", env=compiler_environment(), stdin=b"",
                                  timeout_s=VERSION_PROBE_TIMEOUT_S)
        version = "" if probe.timed_out else probe.output_tail
    except OSError:
        version = ""
    if version:
        with _VERSIONS_LOCK:
            if len(_VERSIONS) >= 64:  # (compilers come and go rarely: a bound, not a policy)
                _VERSIONS.clear()
            _VERSIONS[key] = version
    return version


_VERSIONS: dict[tuple, str] = {}  # compiler_version's answers, by command and the stamps of its files
_VERSIONS_LOCK = threading.Lock()  # (loads compile on threads of their own)


def source_hash(folder: Path, compiler: Compiler, model: str) -> str:
    """A key over every C++ source and header in the folder and its subfolders, the compiler and the flags.

    ConfigError naming ``model`` and the file when one of them is not a regular file (see :func:`read_code_file`).
    """
    return source_key(folder, compiler, model)[0]


def source_key(folder: Path, compiler: Compiler, model: str) -> tuple[str, list[Path]]:
    """:func:`source_hash`, and the files it covers."""
    digest = hashlib.sha256()
    digest.update(compiler_key(compiler))
    digest.update(" ".join(CXX_FLAGS).encode() + flags_order_key(compiler))
    files = code_files(folder, SOURCE_SUFFIXES)
    if not files:
        raise unkeyed_build(model, folder)
    for path in files:
        content = read_code_file(path, f"model '{model}': ", "every C++ source and header in the model folder")
        digest.update(os.fsencode(path.relative_to(folder)) + b"\0" + content + b"\0")
    return digest.hexdigest()[:20], files


def unkeyed_build(model: str, folder: Path) -> ConfigError:
    """The refusal of a build whose key would hold none of its sources: no edit would ever change it.

    A bug of the walk (a model folder linked in from outside the repository was
    walked not at all: every cpp model there had one key, and an edit was never
    built), refused loudly rather than cached under a key that cannot go stale.
    """
    return ConfigError(f"model '{model}': no C++ source was found under {folder} for its build key, so no edit "
                       "would ever rebuild it (a bug of nereid's: please report it); not compiled")


def code_files(folder: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """The entries under ``folder`` (subfolders too, but not hidden ones such as ``.cache``) with these suffixes.

    An #include may reach into a subfolder (``include/factor.h``), so an edit
    there must change the key as much as one beside ``main.cpp``. ``folder``
    itself is always walked, wherever it really is (a model folder linked in
    from outside the repository, with follow_symlinks). A subfolder that is a
    symlink (``inc -> ../shared``) is followed, as the compiler follows it, when
    it leads to a folder beside the model folder (within the parent of its real
    location, or within the folder that lists it: the repository's shared
    headers), each real folder once; a link to such a parent itself or further
    out (``data -> /usr``) is not walked: it would pull unrelated trees into
    the key. Hidden files count
    (``#include ".factor.h"``), but not an editor's leftovers: a lock link
    (``.#main.cpp``), macOS's ``._`` files, a hidden link to nothing. Entries of
    every other kind are listed: an #include reaches a FIFO named ``x.h`` all the
    same, so it must be found, to be refused by :func:`read_code_file`.
    """
    found = []
    top = os.path.realpath(folder)
    # Measured from the folder's real location too: a model folder linked in from elsewhere lies outside the
    # folder that lists it, and was then skipped whole, its key holding no file at all.
    bounds = {os.path.dirname(top), os.path.realpath(folder.parent)}
    seen = {top}
    for root, folders, files in os.walk(folder, followlinks=True):
        if root != os.fspath(folder):  # a subfolder, maybe a symlink: only within the bounds, each real one once
            real = os.path.realpath(root)
            if real in seen or not any(_strictly_within(real, bound) for bound in bounds):
                folders[:] = []
                continue
            seen.add(real)
        folders[:] = sorted(f for f in folders if not f.startswith("."))
        if folder_depth(os.fspath(folder), root) >= MAX_FOLDER_DEPTH:
            folders[:] = []  # (a load under server.follow_symlinks: true, which no depth check refused first)
        found.extend(Path(root) / name for name in sorted(files)
                     if name.endswith(suffixes) and not _editor_leftover(root, name))
    return found


def _strictly_within(path: str, folder: str) -> bool:
    """Whether the real path ``path`` lies inside the real folder ``folder`` (the folder itself is not inside)."""
    return path != folder and os.path.commonpath([folder, path]) == folder


def _editor_leftover(root: str, name: str) -> bool:
    """A hidden name no #include means: an editor's lock link, macOS's ``._`` metadata, a hidden link to nothing."""
    if not name.startswith("."):
        return False
    return name.startswith((".#", "._")) or not os.path.exists(os.path.join(root, name))


def read_code_file(path: Path, prefix: str, covered: str) -> bytes:
    """The content of a source or header a build key covers; ConfigError when it is not a regular file.

    A FIFO an #include reaches would hold the compiler, and the load, until
    COMPILE_TIMEOUT_S: it is refused at once, and opened without blocking, so
    one put in place after any earlier check is refused too. The message is
    ``prefix`` (the model, the setting), the file and why, then ``covered``:
    which files the build reads.
    """
    reason = not_regular_reason(path)  # a symlink to nothing is named as such
    remedy = "make it a regular file or remove it"
    if reason is None:
        try:
            return read_regular_file(path, MAX_CODE_FILE_BYTES)
        except ConfigError as err:
            reason = str(err)
        if not os.access(path.parent, os.X_OK):  # (its folder's mode keeps every file in it from the server)
            remedy = (f"give its folder {path.parent} search permission (x) for the server's user (uid "
                      f"{os.geteuid()})")
        elif not os.access(path, os.R_OK):  # (a regular file its mode keeps from the server: the hunt of edc6865)
            remedy = f"make it readable by the server's user (uid {os.geteuid()}) or remove it"
    raise ConfigError(f"{prefix}{reason}; the build reads {covered}: {remedy}")


def compile_to(compiler: Compiler, arguments: list[str], target: Path, cwd: Path, what: str, model: str = "",
               abandoned: threading.Event | None = None, sources: tuple[str, ...] = ()) -> list[str] | None:
    """Run ``compiler arguments -o TARGET`` through a temporary name renamed into place.

    An interrupted or concurrent build never leaves a half-written file under
    the final name (and a killed one's ``.partial`` is removed next time). The
    compiler's exit is noticed at once and its group killed past
    COMPILE_TIMEOUT_S. A failure raises ConfigError naming ``what`` with the
    compiler's message; what it printed for a build that succeeded (warnings) is
    logged once as a WARNING naming ``model``. ``abandoned`` set (the server gave
    up on the load: an unload or removal of the model came) stops the compile,
    waiting for a slot or running: compilers of models no longer served held the
    slots, and every other model's build waited behind them (a bug hunt).

    ``sources``, the translation units among ``arguments``, asks for the files
    the build read, returned as the compiler named them (relative to ``cwd``,
    or absolute), system headers aside: from ``-MMD -MF``, or, for several
    sources (each would overwrite that list), from one ``-MM`` pass per source
    after the compile. None when none are asked for or the compiler wrote none.
    """
    abandoned = abandoned or threading.Event()
    remove_stale_partials(target.parent)
    partial = target.parent / temporary_name(target.name)
    # The compiler's intermediate files (.s, .o) go to TMPDIR: in a folder of its own beside the target (in the
    # server's scratch folder), so that a compile killed past the limit, or with the server, leaves none in the
    # system's /tmp, where they would stay for good.
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        # At most one compiler per CPU: a repository of many models loads them all at once, and as many
        # template-heavy compilers at once can run the machine out of memory, to finish no sooner.
        while not _COMPILE_SLOTS.acquire(timeout=ABANDON_POLL_S):
            if new_children_stopped():
                raise ConfigError(f"{what}: not compiled: the server is stopping")
            if abandoned.is_set():
                raise ConfigError(f"{what}: not compiled: its load was abandoned")
        try:
            if new_children_stopped():  # the server stopped while this load waited for a slot
                raise ConfigError(f"{what}: not compiled: the server is stopping")
            if abandoned.is_set():
                raise ConfigError(f"{what}: not compiled: its load was abandoned")
            groups = ProcessGroups()
            listing = work / "dependencies.d"
            listed = ["-MMD", "-MF", str(listing)] if len(sources) == 1 else []
            dependencies = None
            with _killed_once_set(abandoned, groups), _compiler_started(compiler, what):
                completed = run_model_process([*compiler_command(compiler, arguments), *listed, "-o", str(partial)],
                                              cwd=cwd,
                                              env=compiler_environment(TMPDIR=str(work)), stdin=b"",
                                              timeout_s=COMPILE_TIMEOUT_S, groups=groups,
                                              head_bytes=MESSAGE_HEAD_CHARS,
                                              tail_bytes=MESSAGE_TAIL_CHARS - MESSAGE_HEAD_CHARS)
                if sources and completed.returncode == 0 and not completed.timed_out:
                    text = (_read_listing(listing) if listed else
                            _list_each_source(compiler, arguments, sources, cwd, work, groups))
                    dependencies = None if text is None else make_prerequisites(text)
        finally:
            _COMPILE_SLOTS.release()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # (A listing pass killed by the abandon leaves no list: that is no compiler listing nothing.)
    if abandoned.is_set() and (completed.returncode != 0 or (len(sources) > 1 and dependencies is None)):
        partial.unlink(missing_ok=True)
        raise ConfigError(f"{what}: compilation stopped: its load was abandoned")
    if completed.timed_out or completed.returncode != 0:
        partial.unlink(missing_ok=True)
        if completed.timed_out:
            raise ConfigError(f"{what}: compilation took longer than {COMPILE_TIMEOUT_S} s")
        raise ConfigError(f"{what}: compilation failed ({os.path.basename(compiler[0])} {completed.describe()}):\n"
                          f"{completed.output_tail}{_link_hint(completed.output_tail, cwd, sources)}")
    if completed.output_tail.strip():  # warnings (a #warning, a deprecation): shown once, at the build
        log.warning("model '%s': the compiler warned (the build succeeded):\n%s", model, completed.output_tail.rstrip())
    # Readable and runnable by the server whatever its umask: root's 0177 or 0777 (which nereid refuses only for
    # another user, root reading any file) made a binary no one may run, READY with every request failing
    # "Permission denied" (the deploy hunt).
    os.chmod(partial, stat.S_IMODE(os.stat(partial).st_mode) | stat.S_IRWXU)
    os.replace(partial, target)
    return dependencies


def _link_hint(output: str, folder: Path, sources: Collection[str]) -> str:
    """What to do about a link that missed a symbol (``undefined reference to `crc32'``): nothing but the C++
    standard library is linked, which the linker's words alone did not say (the native backends hunt); and only
    ``sources`` are compiled, so a source file beside them that defines the symbol is not (the author hunt: a
    helper.cpp beside main.cpp was told to become a library)."""
    if "undefined reference to" not in output:
        return ""
    beside = uncompiled_sources(folder, sources, missing_symbols(output))
    where = (f"; only {', '.join(sources)} is compiled: {', '.join(beside)} beside it in the model folder is not, "
             "#include it from main.cpp" if beside else "")
    return ("\n(nothing beyond the C++ standard library is linked into a build: a model that needs another library "
            f"is a cxx model with a prebuilt library:, linked as it likes; see the README's cxx backend{where})")


def missing_symbols(output: str) -> set[str]:
    """The names of the functions or variables a linker's or loader's message says are undefined (``helper`` of
    `` `helper(float)' `` and of ``_Z6helperf (helper(float))``; ``crc32``), without namespaces or arguments."""
    quoted = re.findall(r"undefined (?:reference to [`']|symbol: \S+ \()([^'()]+)", output)
    plain = re.findall(r"undefined symbol: ([A-Za-z_]\w*)(?:$|\s)", output)
    return {name.rsplit("::", 1)[-1].strip() for name in (*quoted, *plain) if name.strip()}


def uncompiled_sources(folder: Path, sources: Collection[str | Path], symbols: Collection[str]) -> list[str]:
    """The C and C++ source files (not headers) in ``folder`` and beside each of ``sources``, not among them, whose
    text names one of ``symbols`` (what such a missing symbol may be defined in; one the build includes names it
    too, and is no news), by name relative to ``folder`` when within it."""
    compiled = {Path(folder, source).resolve() for source in sources}
    found: list[str] = []
    for place in dict.fromkeys([Path(folder), *(Path(folder, source).parent for source in sources)]):
        try:
            entries = sorted(os.scandir(place), key=lambda entry: entry.name)
        except OSError:
            continue
        for entry in entries:
            path = Path(entry.path)
            if (not entry.name.endswith(COMPILED_SUFFIXES) or entry.name.startswith(".") or not entry.is_file()
                    or path.resolve() in compiled or not _names_any(path, symbols)):
                continue
            found.append(os.path.relpath(path, folder) if path.is_relative_to(folder) else str(path))
    return found


def _names_any(path: Path, symbols: Collection[str]) -> bool:
    """Whether the source file at ``path`` names one of ``symbols`` as a word (its first MiB is read)."""
    try:
        with open(path, "rb") as file:
            text = file.read(1 << 20).decode("utf-8", "replace")
    except OSError:
        return False
    return any(re.search(rf"\b{re.escape(symbol)}\b", text) for symbol in symbols)


@contextlib.contextmanager
def _compiler_started(compiler: Compiler, what: str) -> Iterator[None]:
    """A ConfigError naming the compiler for a compiler that cannot be run: a file that is no program (a script
    without its ``#!`` line, a binary for another machine: ENOEXEC), one on a noexec mount, one gone since it was
    found. It was a raw OSError, "raised by the load() of built-in backend 'cpp'", as if the backend were at
    fault."""
    try:
        yield
    except OSError as err:
        if err.errno not in _NOT_A_PROGRAM or err.filename not in (compiler[0], None):
            raise
        raise ConfigError(f"{what}: the C++ compiler {compiler[0]} cannot be run: {err.strerror or err} (set CXX "
                          "to a C++ compiler, or install g++)") from None


# What exec says of a program that cannot run: no program (ENOEXEC), not allowed (EACCES: a noexec mount), gone.
_NOT_A_PROGRAM = frozenset({errno.ENOEXEC, errno.EACCES, errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EISDIR})


def _read_listing(path: Path) -> str | None:
    """A dependency list the compiler wrote, or None when it wrote none (a compiler without ``-MMD``)."""
    try:
        return os.fsdecode(path.read_bytes())  # (file names are bytes: any that are not UTF-8 survive the trip)
    except OSError:
        return None


def _list_each_source(compiler: Compiler, arguments: list[str], sources: tuple[str, ...], cwd: Path, work: Path,
                      groups: ProcessGroups) -> str | None:
    """The ``-MM`` lists of each source, preprocessed again one at a time; None when one cannot be made.

    With several sources, ``-MMD -MF`` holds the last one's list only (g++
    and clang write the file once per source).
    """
    flags = [word for word in arguments if word not in sources]
    texts = []
    for index, source in enumerate(sources):
        listing = work / f"dependencies-{index}.d"
        done = run_model_process([*compiler_command(compiler, flags), "-MM", "-MF", str(listing), source], cwd=cwd,
                                 env=compiler_environment(TMPDIR=str(work)), stdin=b"", timeout_s=COMPILE_TIMEOUT_S,
                                 groups=groups)
        text = None if done.timed_out or done.returncode != 0 else _read_listing(listing)
        if text is None:
            return None
        texts.append(text)
    return "\n".join(texts)


def make_prerequisites(text: str) -> list[str]:
    """The prerequisites of the make rules in ``text`` (what ``-MMD`` writes), each once, unescaped."""
    found: dict[str, None] = {}
    for rule in text.replace("\\\n", " ").splitlines():
        _, colon, prerequisites = rule.partition(": ")
        if colon:
            for word in re.findall(r"(?:\\.|[^\s\\])+", prerequisites):
                found[word.replace("\\ ", " ").replace("\\#", "#").replace("$$", "$")] = None
    return list(found)


@contextlib.contextmanager
def _killed_once_set(abandoned: threading.Event, groups: ProcessGroups) -> Iterator[None]:
    """For the time of the block, kill the processes of ``groups`` as soon as ``abandoned`` is set."""
    done = threading.Event()

    def watch() -> None:
        while not done.wait(ABANDON_POLL_S):
            if abandoned.is_set():
                groups.kill_all()
                return
    watcher = threading.Thread(target=watch, name="nereid-compile-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()


def cached_build(compiler: Compiler, arguments: list[str], name: str, stale: str, *, model: str, folder: Path,
                 scratch: Path, what: str, sources: tuple[str, ...], keyed: Collection[Path],
                 executable: bool = False, name_now: Callable[[], str] | None = None,
                 abandoned: threading.Event | None = None) -> Path:
    """``<folder>/.cache/<name>``, compiled only when missing; in ``scratch`` when .cache/ cannot be written.

    An up-to-date build in .cache/ is used as it is, even read-only. Otherwise
    the compiler writes into the model's scratch folder (its output never
    depends on the repository's disk), and the result is copied into .cache/
    through a temporary name renamed into place, so an interrupted or
    concurrent build (two servers on one repository) never leaves a
    half-written file under the final name. When that copy fails (EACCES,
    EROFS, ENOSPC, EDQUOT, a ``.cache`` that is no folder...) the model serves
    the scratch build and one WARNING says why. The other builds matching the
    glob ``stale`` are removed. A compile error raises ConfigError carrying the
    compiler's message. ``name_now``, asked again once the compiler has run,
    gives the name the sources have then: another name means they were edited
    while they were compiled, so the build is of no one version of them; it is
    served this once, under a name of its own, and never cached. ``abandoned``:
    see :func:`compile_to`.

    The name covers ``keyed``, the files the key was taken over; the files
    the compiler read from ``sources`` besides those (``#include
    "../../shared/k.h"``) are kept with their content hashes in a record beside
    the build (see :func:`_still_current`), and one of them edited builds it
    again: they were in no key, and their edits were never built. A compiler
    that lists no such files (no ``-MMD``) gives a build served once, not cached.

    The record also holds the build's name, size and sha256; a cached build
    that does not match them is never run nor dlopened: a WARNING names it and
    why, and it is built again (see :func:`_reusable`). The build and its
    record are published durably (each fsynced before its rename, the folder
    after it), so a crash leaves the old state or the new one.
    """
    cache = folder / CACHE_DIR
    built = cache / name
    # (Whether it is an older nereid's is kept for the WARNING of a .cache/ that cannot be written, below.)
    reusable, older = _reusable(built, folder, model, executable)
    if reusable:
        return built
    scratch_cache = scratch / SCRATCH_CACHE_DIR
    fallback = scratch_cache / name
    # (An earlier load in this server found .cache/ unwritable.)
    if _reusable(fallback, folder, model, executable)[0]:
        return fallback
    scratch_cache.mkdir(parents=True, exist_ok=True)
    started_ns = time.time_ns()
    dependencies = compile_to(compiler, arguments, fallback, folder, what, model, abandoned, sources)
    try:
        name_changed = name_now is not None and name_now() != name
    except BaseException:  # a source gone since (read again to name it): no build of those sources is kept
        fallback.unlink(missing_ok=True)
        raise
    # A file of its record (outside the key) changed while it was compiled: the record would hash the edited file
    # for a build of the earlier one, served as current for good (the cxx read hunt). Served once, as above.
    name_changed = name_changed or (dependencies is not None
                                    and _changed_since(dependencies, folder, keyed, started_ns))
    # The one-off builds of earlier loads (their versions run from links or copies of their own, and loads of one
    # model take turns): they piled up in the scratch folder for the server's life (the native hunt).
    _remove_stale(scratch_cache, f".{EDITED_PREFIX}*", fallback)
    if name_changed or dependencies is None:
        if name_changed:
            log.info("model '%s': its sources changed while they were compiled; this build is not cached", model)
        else:
            log.warning("model '%s': the compiler (%s) wrote no list of the files it included (-MMD -MF), so an "
                        "edit of one outside the model folder could not be noticed; this build is not cached",
                        model, os.path.basename(compiler[0]))
        once = scratch_cache / temporary_name(f"{EDITED_PREFIX}{name}")
        os.replace(fallback, once)
        return once
    _write_record(fallback, _outside_the_key(dependencies, folder, keyed, model), model)
    _remove_stale(scratch_cache, stale, fallback)
    try:
        # The old record gone first, the build then its record: a build found with no record is built again, where
        # one found with the record of an earlier build of its name could be kept for a record it was not built from.
        _record_path(built).unlink(missing_ok=True)
        _publish(fallback, built)
        _publish(_record_path(fallback), _record_path(built))
    except OSError as err:
        unreadable = _unreadable_cache(cache)
        if unreadable is not None:
            # Reading it is what fails first (its builds were never found): "cannot write" sent the operator to
            # the wrong permission (the deployment hunt).
            log.warning("model '%s': cannot read the build cache %s (%s), so no build in it is reused or "
                        "replaced; serving the build in the server's scratch "
                        "folder (built again at the next start): make %s/ readable, searchable and writable by the "
                        "server's user, or remove it", model, cache, unreadable, CACHE_DIR)
            return fallback
        # (mkdir's EEXIST is about a file of that name, which is no folder: "File exists" would puzzle.)
        why = "it is a file, not a folder" if cache.exists() and not cache.is_dir() else err.strerror or err
        log.warning("model '%s': cannot write the build cache %s (%s); serving the build in the server's scratch "
                    "folder (built again at the next start)%s", model, cache, why, _older_build_advice(older))
        return fallback
    fallback.unlink(missing_ok=True)
    _record_path(fallback).unlink(missing_ok=True)
    _remove_stale(cache, stale, built)
    return built


def _unreadable_cache(cache: Path) -> str | None:
    """Why the server's user cannot list or search the folder ``cache`` (its mode and owner, and the server's
    uid), or None when it can, or it is no folder (not there, a file)."""
    try:
        status = os.stat(cache)
    except OSError:
        return None
    if not stat.S_ISDIR(status.st_mode) or os.access(cache, os.R_OK | os.X_OK):
        return None
    how = ("made by another user, under umask 077, say" if status.st_uid != os.geteuid() else
           "made under a umask that takes its owner's own rights, 0177 say")
    return (f"mode {status.st_mode & 0o777:04o}, owned by uid {status.st_uid}; the server runs as uid {os.geteuid()}: "
            f"{how}")


def _older_build_advice(older: bool) -> str:
    """What the WARNING of an unwritable .cache/ adds when the build it holds is an older nereid's: that build is
    never reused, so a read-only repository (an image built with an older nereid) compiles at every start."""
    if not older:
        return ""
    return (f": {CACHE_DIR}/ holds a build an older nereid made, without the record this one checks, so it is "
            f"never reused; build the repository's {CACHE_DIR}/ again with this nereid where it can be written "
            "(nereid check on a writable copy builds every model) and ship that")


class _NotReusable(Exception):
    """Why a cached build is built again, and at which level that is logged (damage: WARNING); ``older``: the build
    is an older nereid's, which writes no record (or one without the build's checksum), or rebuilt it under a newer
    one's record."""

    def __init__(self, reason: str, level: int = logging.WARNING, older: bool = False) -> None:
        super().__init__(reason)
        self.level = level
        self.older = older


def _reusable(build: Path, folder: Path, model: str, executable: bool) -> tuple[bool, bool]:
    """Whether the cached ``build`` is served as it is: its record vouches for its content, and each file it
    included from outside its key is unchanged; and whether it is an older nereid's (see :class:`_NotReusable`).

    Checked before anything runs or dlopens it: a cxx library is mapped into
    the server's own process, where a damaged one (its code zeroed by a torn
    write, with its ELF headers whole) crashed the server at every start, and
    a cpp binary swapped for another build's answered wrong with no word. A
    build that does not match is named in a WARNING, with why, and built
    again; one without a record (an older nereid's, or one being published),
    or written after its record (an older nereid's rebuild under a newer
    one's record), is built again with an INFO line.
    """
    if not os.path.lexists(build):
        return False, False  # (nothing cached under this name: the usual first build)
    try:
        entries = _verified_record(build, executable)
    except _NotReusable as why:
        log.log(why.level, "model '%s': ignoring its cached build %s: %s; building it again", model, build, why)
        return False, why.older
    return _still_current(entries, build, folder, model), False


def _verified_record(build: Path, executable: bool) -> list[tuple[str, str]]:
    """The outside-the-key entries of ``build``'s record, once the record is read and the build checked against
    it (its name, size and sha256); _NotReusable saying why not."""
    record = _record_path(build)
    if not os.path.lexists(record):
        raise _NotReusable(f"it has no record {record.name} beside it (made by an older nereid, or its record is "
                           "still being written)", logging.INFO, older=True)
    try:
        document = json.loads(read_regular_file(record, MAX_RECORD_BYTES))
        made = document.get("build")
        entries = [(str(name), str(digest)) for name, digest in document["outside_key"]]
    except ConfigError as err:  # (its message names the record: not a regular file, unreadable, too large)
        raise _NotReusable(f"its record {err}") from None
    except (ValueError, RecursionError, KeyError, TypeError, AttributeError):
        raise _NotReusable(f"its record {record} is damaged (not the JSON a build's record holds)") from None
    if made is None:
        raise _NotReusable(f"its record {record.name} holds no checksum of it (made by an older nereid)",
                           logging.INFO, older=True)
    if not isinstance(made, dict) or made.get("name") != build.name:
        other = made.get("name") if isinstance(made, dict) else None
        raise _NotReusable(f"its record {record.name} is the record of another build ({other!r})")
    size, digest = _build_digest(build, executable)
    if (size != made.get("bytes") or digest != made.get("sha256")) and _written_after(build, record):
        # An older nereid, which writes no record, built it again under this name (a rollback) and left this one's
        # record behind (its sweep, lib-*.so, misses lib-*.so.deps): no damage to warn of.
        raise _NotReusable(f"it was written after its record {record.name} and does not match it (built again by an "
                           "older nereid, which writes no record, or copied over since)", logging.INFO, older=True)
    if size != made.get("bytes"):
        raise _NotReusable(f"it is {size} bytes, and it was {made.get('bytes')} bytes when it was built: cut short, "
                           "damaged or replaced")
    if digest != made.get("sha256"):
        raise _NotReusable(f"its content is not the one it was built with (sha256 {digest[:16]}..., built "
                           f"{str(made.get('sha256'))[:16]}...): damaged or replaced")
    return entries


def _written_after(build: Path, record: Path) -> bool:
    """Whether ``build`` was last written after its ``record`` (by modification time; False when either cannot be
    read). This nereid's own builds never are: a build is published before its record, with its compile's time
    kept, and a torn write or bit-rot leaves that time as it was."""
    try:
        return os.stat(build).st_mtime_ns > os.stat(record).st_mtime_ns
    except OSError:
        return False


def _build_digest(build: Path, executable: bool) -> tuple[int, str]:
    """The size and sha256 of the cached ``build``, read in chunks from a descriptor opened without blocking (a FIFO
    under its name is refused, not waited on); _NotReusable when it is no regular file, cannot be read, or is not
    executable where it must be."""
    try:
        fd = os.open(build, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise _NotReusable(f"it cannot be read ({err.strerror or err})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _NotReusable(f"it is {kind_of(mode)}, not a regular file")
        if executable and not os.access(build, os.X_OK):
            raise _NotReusable("it is not executable")
        digest, size = hashlib.sha256(), 0
        while chunk := os.read(fd, HASH_CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
        return size, digest.hexdigest()
    except OSError as err:
        raise _NotReusable(f"it cannot be read ({err.strerror or err})") from None
    finally:
        os.close(fd)


def _record_path(build: Path) -> Path:
    """Where the record of ``build``'s files from outside its key is kept: beside it, ``<build>.deps``."""
    return build.with_name(build.name + RECORD_SUFFIX)


def _outside_the_key(dependencies: list[str], folder: Path, keyed: Collection[Path], model: str) -> list[list[str]]:
    """``[name, sha256]`` of each file the build read that its key does not cover (by real path, so a file reached
    through a link is the file itself), named as :func:`_record_name` says; logged once, at the build."""
    covered = {os.path.realpath(path) for path in keyed}
    record: dict[str, str] = {}
    for name in dependencies:
        path = folder / name  # (an absolute name stays itself)
        kept = _record_name(name, folder)
        if kept not in record and os.path.realpath(path) not in covered:
            record[kept] = _content_hash(path, model)
    if record:
        log.info("model '%s': its build includes files outside its build key, checked for edits at each load: %s",
                 model, ", ".join(record))
    return [[name, digest] for name, digest in sorted(record.items())]


# How far past now a file's time may read and still be an edit made now (the clocks' granularity).
_FUTURE_SLACK_NS = 1_000_000_000


def _changed_since(dependencies: list[str], folder: Path, keyed: Collection[Path], since_ns: int) -> bool:
    """Whether a file the build read outside its key was modified (or replaced) after ``since_ns`` (the wall clock,
    which a file's timestamp, the kernel's coarse clock, never passes: a file written before it is never taken
    for one written after; one written in the tick after it may be missed); a file gone since counts. A time
    past now (a clock skewed, a `tar -x` of an archive made ahead) says nothing: it rebuilt the model at every
    load (the review hunt); edited, the file has the time of its edit."""
    now_ns = time.time_ns() + _FUTURE_SLACK_NS
    covered = {os.path.realpath(path) for path in keyed}
    for name in dependencies:
        path = folder / name
        if os.path.realpath(path) in covered:
            continue
        try:
            stat_result = os.stat(path)
        except OSError:
            return True
        if any(since_ns < stamp <= now_ns for stamp in (stat_result.st_mtime_ns, stat_result.st_ctime_ns)):
            return True
    return False


def _record_name(name: str, folder: Path) -> str:
    """How a build's record names ``name``, a file the compiler read: relative to the model ``folder`` when the
    compiler reached it through the folder, else as the compiler named it.

    A cpp build compiles ``main.cpp`` in its folder, so the compiler already
    names ``#include "../../shared/k.h"`` relative to it; a cxx build compiles
    ``$MODEL_FOLDER/scale.cpp`` by its absolute path, and the compiler names that
    include ``/build/path/repo/m/../../shared/k.h``: kept so, a repository copied
    elsewhere checked the original's header (an edit of its own copy never
    built), and one shipped read-only without the original was built again at
    every start. Relative, it is checked where the model folder now is (``..``
    is taken from the folder's real location either way). A file reached by
    another path (``/usr/local/include``, a source outside the folder) keeps
    its absolute name: it does not move with the repository.
    """
    path = Path(name)
    if not path.is_absolute():
        return name
    for outer in (folder, Path(os.path.realpath(folder))):  # (a source given by the folder's real path, too)
        if outer.is_absolute() and path.is_relative_to(outer):
            return path.relative_to(outer).as_posix()
    return name


def _content_hash(path: Path, model: str) -> str:
    """The sha256 of a file a build included from outside its key; "" (which matches none) when it is gone."""
    if not os.path.lexists(path):
        return ""
    content = read_code_file(path, f"model '{model}': ", "every file its last build included")
    return hashlib.sha256(content).hexdigest()


def _write_record(build: Path, record: list[list[str]], model: str) -> None:
    """Write ``build``'s record through a temporary name renamed into place: its name, size and sha256, and the
    files it included from outside its key (see :func:`_outside_the_key`).

    ConfigError naming ``model`` when it cannot be written (the build, which
    no record vouches for, is removed: it would be built again anyway).
    """
    target = _record_path(build)
    try:
        size, digest = _build_digest(build, executable=False)
    except _NotReusable as why:  # (the compiler's output, just renamed into place: gone only if removed meanwhile)
        build.unlink(missing_ok=True)
        raise ConfigError(f"model '{model}': cannot read its build {build}: {why}") from None
    made = {"name": build.name, "bytes": size, "sha256": digest}
    try:
        atomic_write(target, [(json.dumps({"build": made, "outside_key": record}, indent=1) + "\n").encode()])
    except OSError as err:
        build.unlink(missing_ok=True)
        raise ConfigError(f"model '{model}': cannot write the record of its build {target}: "
                          f"{err.strerror or err}") from None


def _still_current(entries: list[tuple[str, str]], build: Path, folder: Path, model: str) -> bool:
    """Whether each file ``build`` included from outside its key (``entries``: names and content hashes, from its
    record) still has the content it was built from.

    A relative name is taken from ``folder`` (see :func:`_record_name`); an
    absolute one, as an older nereid wrote for any file a cxx build read, as it
    is. A file of it that is no longer a regular file is refused (ConfigError
    naming it), as the key refuses one.
    """
    for name, digest in entries:
        if _content_hash(folder / name, model) != digest:
            log.info("model '%s': %s, which its build in %s included, has changed; building it again", model, name,
                     build.parent)
            return False
    return True


def _publish(source: Path, target: Path) -> None:
    """Copy ``source`` to ``target`` through a temporary name renamed into place, durably: the copy is fsynced
    before the rename, the folder after it (as atomic_write's ``durable``); OSError when it cannot.

    Without the fsyncs a crash or power loss after the rename could leave the
    new name over blocks never written (zeros under whole ELF headers): a
    build the next start would find damaged.
    """
    target.parent.mkdir(exist_ok=True)
    remove_stale_partials(target.parent)
    partial = target.parent / temporary_name(target.name)
    try:
        shutil.copy2(source, partial)
        fd = os.open(partial, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(partial, target)
    except BaseException:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        raise
    fsync_folder(target.parent)


def _remove_stale(folder: Path, pattern: str, keep: Path) -> None:
    """Remove the other builds matching ``pattern``, and their records (runs use their own links or copies: this is
    safe)."""
    for path in {*folder.glob(pattern), *folder.glob(pattern + RECORD_SUFFIX)}:
        if path not in (keep, _record_path(keep)):
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)


def build_binary(folder: Path, source: str, scratch: Path, model: str,
                 abandoned: threading.Event | None = None) -> Path:
    """The compiled program for ``folder/source``, compiling it only when the sources changed.

    Cached as ``.cache/main-<hash>`` (see :func:`cached_build`; ``scratch`` is
    the model's scratch folder, used when .cache/ cannot be written). A compile
    error raises ConfigError carrying the compiler's message.
    """
    compiler = find_compiler()

    def name_now() -> str:
        return f"main-{source_hash(folder, compiler, model)}"
    digest, keyed = source_key(folder, compiler, model)
    return cached_build(compiler, [*CXX_FLAGS, source], f"main-{digest}", "main-*", model=model, folder=folder,
                        scratch=scratch, what=str(folder / source), sources=(source,), keyed=keyed, executable=True,
                        name_now=name_now, abandoned=abandoned)
