"""Compiling a model's ``main.cpp`` once, cached by the hash of its sources and compiler."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from nereid.errors import ConfigError

from nereid.backends.subprocess.runner import run_model_process

SOURCE_SUFFIXES = (".cpp", ".cc", ".cxx", ".h", ".hpp", ".hh")
CXX_FLAGS = ("-O2", "-std=c++17")
COMPILE_TIMEOUT_S = 600
CACHE_DIR = ".cache"
MESSAGE_TAIL_CHARS = 4000


def find_compiler() -> str:
    """The C++ compiler: ``$CXX``, else ``c++`` on PATH."""
    name = os.environ.get("CXX", "c++")
    path = shutil.which(name)
    if path is None:
        raise ConfigError(f"no C++ compiler: '{name}' is not on PATH (set CXX or install g++)")
    return path


def source_hash(folder: Path, compiler: str) -> str:
    """A key over every C++ source and header in the folder, the compiler and the flags."""
    digest = hashlib.sha256()
    digest.update(compiler.encode())
    digest.update(" ".join(CXX_FLAGS).encode())
    for path in sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in SOURCE_SUFFIXES):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:20]


def build_binary(folder: Path, source: str) -> Path:
    """The compiled program for ``folder/source``, compiling it only when the sources changed.

    Builds into a temporary name and renames it into place, so an interrupted
    or concurrent build never leaves a half-written binary under the final name.
    A compile error raises ConfigError carrying the compiler's message.
    """
    compiler = find_compiler()
    cache = folder / CACHE_DIR
    cache.mkdir(exist_ok=True)
    key = source_hash(folder, compiler)
    binary = cache / f"main-{key}"
    if binary.is_file() and os.access(binary, os.X_OK):
        return binary
    partial = cache / f".main-{key}.{os.getpid()}.partial"
    # The model runner's wait: the compiler's exit is noticed at once, its group killed on timeout.
    completed = run_model_process([compiler, *CXX_FLAGS, "-o", str(partial), source], cwd=folder,
                                  env=dict(os.environ), stdin=b"", timeout_s=COMPILE_TIMEOUT_S,
                                  tail_bytes=MESSAGE_TAIL_CHARS)
    if completed.timed_out:
        partial.unlink(missing_ok=True)
        raise ConfigError(f"{folder / source}: compilation took longer than {COMPILE_TIMEOUT_S} s")
    if completed.returncode != 0:
        partial.unlink(missing_ok=True)
        raise ConfigError(f"{folder / source}: compilation failed ({os.path.basename(compiler)} "
                          f"{completed.describe()}):\n{completed.output_tail}")
    os.replace(partial, binary)
    for stale in cache.glob("main-*"):
        if stale != binary:
            stale.unlink(missing_ok=True)
    return binary
