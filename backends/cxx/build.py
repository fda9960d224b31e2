"""Building a model's shared library from ``runtime.sources``, cached like the cpp backend's binaries.

The library goes to ``<model folder>/.cache/lib-<hash>.so`` (the cpp backend's
cache folder, compiler, flags, time limit and error reporting), where the hash
covers the compiler, the flags, nereid's header, every listed source and every
header beside them: a restart reuses the library, an edit rebuilds it.
"""

from __future__ import annotations

import functools
import hashlib
import subprocess
from importlib import resources
from pathlib import Path

from nereid.backends.cpp.compiler import CACHE_DIR, CXX_FLAGS, HEADER_SUFFIXES, code_files, compile_to, find_compiler
from nereid.backends.cxx import HEADER_NAME
from nereid.errors import ConfigError

# Position-independent code, linked as a shared object; only what the header
# marks NEREID_EXPORT (and anything else left default) is visible.
SHARED_FLAGS = ("-shared", "-fPIC")


@functools.lru_cache(maxsize=8)
def shared_flags(compiler: str) -> tuple[str, ...]:
    """The flags that make a shared library of the sources, for this compiler.

    GCC marks function-local statics of inline functions and templates
    STB_GNU_UNIQUE, which glibc binds process-wide whatever RTLD_LOCAL says and
    which keeps the library from ever being unloaded: they would outlive a
    reload and be shared by two models. ``-fno-gnu-unique`` keeps them private.
    Clang emits no such symbols (and has no such flag).
    """
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    return SHARED_FLAGS if "clang" in version.lower() else (*SHARED_FLAGS, "-fno-gnu-unique")


def header_path() -> Path:
    """Where ``nereid_cxx.h`` is installed (package data)."""
    return Path(str(resources.files("nereid.backends.cxx").joinpath(HEADER_NAME)))


def header_dir() -> Path:
    """The folder holding ``nereid_cxx.h`` (passed to the compiler with ``-I``)."""
    return header_path().parent


def library_hash(sources: tuple[Path, ...], compiler: str) -> str:
    """A key over the compiler, the flags, nereid's header, the sources and the headers beside and below them."""
    digest = hashlib.sha256()
    digest.update(compiler.encode() + b"\0" + " ".join((*CXX_FLAGS, *shared_flags(compiler))).encode() + b"\0")
    digest.update((header_dir() / HEADER_NAME).read_bytes() + b"\0")
    headers = {p for folder in {s.parent for s in sources} for p in code_files(folder, HEADER_SUFFIXES)}
    for path in (*sources, *sorted(headers - set(sources))):
        digest.update(str(path).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:20]


def build_library(model: str, folder: Path, sources: tuple[Path, ...]) -> Path:
    """The shared library built from ``sources``, compiling only when they changed.

    Builds into a temporary name and renames it into place, so an interrupted or
    concurrent build never leaves a half-written library under the final name.
    ConfigError carries the compiler's message on failure.
    """
    for source in sources:
        if not source.is_file():
            raise ConfigError(f"model '{model}': runtime.sources: no such file {source}")
    compiler = find_compiler()
    cache = folder / CACHE_DIR
    cache.mkdir(exist_ok=True)
    library = cache / f"lib-{library_hash(sources, compiler)}.so"
    if library.is_file():
        return library
    arguments = [*CXX_FLAGS, *shared_flags(compiler), f"-I{header_dir()}", *map(str, sources)]
    compile_to(compiler, arguments, library, folder, f"model '{model}': {', '.join(map(str, sources))}")
    for stale in cache.glob("lib-*.so"):
        if stale != library:
            stale.unlink(missing_ok=True)  # loaded models run private copies: removing this is safe
    return library
