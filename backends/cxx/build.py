"""Building a model's shared library from ``runtime.sources``, cached like the cpp backend's binaries.

The library goes to ``<model folder>/.cache/lib-<hash>.so`` (the cpp backend's
cache folder, compiler, flags, time limit and error reporting), where the hash
covers the compiler, the flags, nereid's header, every listed source and every
header beside them: a restart reuses the library, an edit rebuilds it.
"""

from __future__ import annotations

import hashlib
from importlib import resources
from pathlib import Path

from nereid.backends.cpp.compiler import CACHE_DIR, CXX_FLAGS, SOURCE_SUFFIXES, compile_to, find_compiler
from nereid.backends.cxx import HEADER_NAME
from nereid.errors import ConfigError

# Position-independent code, linked as a shared object; only what the header
# marks NEREID_EXPORT (and anything else left default) is visible.
SHARED_FLAGS = ("-shared", "-fPIC")
HEADER_SUFFIXES = tuple(s for s in SOURCE_SUFFIXES if s.startswith(".h"))


def header_path() -> Path:
    """Where ``nereid_cxx.h`` is installed (package data)."""
    return Path(str(resources.files("nereid.backends.cxx").joinpath(HEADER_NAME)))


def header_dir() -> Path:
    """The folder holding ``nereid_cxx.h`` (passed to the compiler with ``-I``)."""
    return header_path().parent


def library_hash(sources: tuple[Path, ...], compiler: str) -> str:
    """A key over the compiler, the flags, nereid's header, the sources and the headers beside them."""
    digest = hashlib.sha256()
    digest.update(compiler.encode() + b"\0" + " ".join((*CXX_FLAGS, *SHARED_FLAGS)).encode() + b"\0")
    digest.update((header_dir() / HEADER_NAME).read_bytes() + b"\0")
    headers = {p for folder in {s.parent for s in sources} for p in folder.iterdir()
               if p.is_file() and p.suffix in HEADER_SUFFIXES}
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
    compile_to(compiler, [*CXX_FLAGS, *SHARED_FLAGS, f"-I{header_dir()}", *map(str, sources)], library, folder,
               f"model '{model}': {', '.join(map(str, sources))}")
    for stale in cache.glob("lib-*.so"):
        if stale != library:
            stale.unlink(missing_ok=True)  # loaded models run private copies: removing this is safe
    return library
