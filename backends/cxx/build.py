"""Building a model's shared library from ``runtime.sources``, cached like the cpp backend's binaries.

The library goes to ``<model folder>/.cache/lib-<hash>.so`` (the cpp backend's
cache folder, compiler, flags, time limit, error reporting and fallback to the
model's scratch folder when .cache/ cannot be written), where the hash covers
the compiler, the flags, nereid's header, every listed source and every header
beside them: a restart reuses the library, an edit rebuilds it, and a copied,
moved or remounted repository reuses it (sources inside the model folder are
keyed by their relative path; any outside it, by their absolute path).
A header included from anywhere else is kept, with its content hash, in a
record beside the library, and its edit rebuilds it too (see the cpp
backend's ``cached_build``); the record names one a source in the model folder
includes relative to that folder, so a copy of the repository checks its own.
That record also holds the library's size and sha256: a cached library that
no longer matches them (a torn write, another build copied over it) is named in a WARNING and built again before it is
dlopened, in the server's own process. A header there that is not a regular file (a FIFO, a socket, a symlink to
nothing) is refused at once: an #include of a FIFO would hold the compiler,
and the load, until the compile's time limit.
"""

from __future__ import annotations

import hashlib
import os
import threading
from importlib import resources
from pathlib import Path

from nereid.backends.cpp.compiler import (CXX_FLAGS, SOURCE_SUFFIXES, Compiler, cached_build, code_files,
                                          compiler_key, compiler_version, find_compiler, flags_order_key,
                                          read_code_file, unkeyed_build)
from nereid.backends.cxx import HEADER_NAME
from nereid.errors import ConfigError
from nereid.files import not_regular_reason

# Position-independent code, linked as a shared object; only what the header
# marks NEREID_EXPORT (and anything else left default) is visible.
SHARED_FLAGS = ("-shared", "-fPIC")


def shared_flags(compiler: Compiler) -> tuple[str, ...]:
    """The flags that make a shared library of the sources, for this compiler.

    GCC marks function-local statics of inline functions and templates
    STB_GNU_UNIQUE, which glibc binds process-wide whatever RTLD_LOCAL says and
    which keeps the library from ever being unloaded: they would outlive a
    reload and be shared by two models. ``-fno-gnu-unique`` keeps them private.
    Clang emits no such symbols (and has no such flag).
    """
    return SHARED_FLAGS if "clang" in compiler_version(compiler).lower() else (*SHARED_FLAGS, "-fno-gnu-unique")


def header_path() -> Path:
    """Where ``nereid_cxx.h`` is installed (package data)."""
    return Path(str(resources.files("nereid.backends.cxx").joinpath(HEADER_NAME)))


def header_dir() -> Path:
    """The folder holding ``nereid_cxx.h`` (passed to the compiler with ``-I``)."""
    return header_path().parent


def library_hash(sources: tuple[Path, ...], compiler: Compiler, folder: Path, *, model: str) -> str:
    """A key over the compiler, the flags, nereid's header, the sources and the C++ files (headers and sources)
    beside and below them, and every C++ file of the model folder when a source is in it (``src/model.cpp`` may
    include ``../include/factor.h``, or a unity build ``impl.cc``: an edit there must rebuild, as it does a cpp
    model).

    Files in the model folder are keyed by their path relative to it (and
    their content), so a repository copied, moved or mounted elsewhere reuses
    its library; a file outside the folder is keyed by its absolute path.
    ConfigError, naming ``model`` and the file, when one of them is not a
    regular file or cannot be read.
    """
    return library_key(sources, compiler, folder, model=model)[0]


def library_key(sources: tuple[Path, ...], compiler: Compiler, folder: Path, *, model: str) -> tuple[str, list[Path]]:
    """:func:`library_hash`, and the files it covers."""
    digest = hashlib.sha256()
    digest.update(compiler_key(compiler) + b"\0" + " ".join((*CXX_FLAGS, *shared_flags(compiler))).encode() +
                  flags_order_key(compiler) + b"\0")
    header = header_dir() / HEADER_NAME
    digest.update(header.read_bytes() + b"\0")
    parents = {s.parent for s in sources}
    if any(_key_name(source, folder) != str(source) for source in sources):  # a source in the model folder
        parents.add(folder)
    # Sources too, not only headers: a listed source may #include another (a unity build's "impl.cc").
    headers = {p for parent in parents for p in code_files(parent, SOURCE_SUFFIXES)}
    # Each source's own folder is walked, so a source with a C++ suffix missing from the walk is a bug of it (a
    # model folder linked in from outside the repository was not walked: its headers were in no key).
    if any(source.name.endswith(SOURCE_SUFFIXES) and source not in headers for source in sources):
        raise unkeyed_build(model, folder)
    keyed = [(_key_name(path, folder), path) for path in sources]
    keyed += sorted((_key_name(path, folder), path) for path in headers - set(sources))
    for name, path in keyed:
        content = read_code_file(path, f"model '{model}': runtime.sources: ", "the sources and every C++ file beside "
                                 "and below them (and in the model folder when a source is in it)")
        digest.update(os.fsencode(name) + b"\0" + content + b"\0")  # (a file name need not be UTF-8)
    return digest.hexdigest()[:20], [header, *(path for _, path in keyed)]


def _key_name(path: Path, folder: Path) -> str:
    """``path`` relative to the model folder when it is inside (symbolic links resolved if need be), else absolute."""
    for inner, outer in ((path, folder), (path.resolve(), folder.resolve())):
        if inner.is_relative_to(outer):
            return inner.relative_to(outer).as_posix()
    return str(path)


def build_library(model: str, folder: Path, sources: tuple[Path, ...], scratch: Path,
                  abandoned: threading.Event | None = None) -> Path:
    """The shared library built from ``sources``, compiling only when they changed.

    Cached as ``.cache/lib-<hash>.so`` (see the cpp backend's ``cached_build``;
    ``scratch`` is the model's scratch folder, used when .cache/ cannot be
    written). ConfigError carries the compiler's message on failure. ``abandoned``
    set stops the compile (see the cpp backend's ``compile_to``).
    """
    for source in sources:
        if (reason := not_regular_reason(source)) is not None:  # a folder, a FIFO: named as such
            raise ConfigError(f"model '{model}': runtime.sources: {reason}")
        if not source.is_file():
            raise ConfigError(f"model '{model}': runtime.sources: no such file {source}")
    compiler = find_compiler()
    arguments = [*CXX_FLAGS, *shared_flags(compiler), f"-I{header_dir()}", *map(str, sources)]

    def name_now() -> str:
        return f"lib-{library_hash(sources, compiler, folder, model=model)}.so"
    digest, keyed = library_key(sources, compiler, folder, model=model)
    # Loaded models run private copies of the library: replacing or removing it is safe.
    return cached_build(compiler, arguments, f"lib-{digest}.so", "lib-*.so", model=model, folder=folder,
                        scratch=scratch, what=f"model '{model}': {', '.join(map(str, sources))}",
                        sources=tuple(map(str, sources)), keyed=keyed, name_now=name_now, abandoned=abandoned)
