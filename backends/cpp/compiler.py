"""Compiling a model's ``main.cpp`` once, cached by the hash of its sources and compiler."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from nereid.errors import ConfigError
from nereid.leftovers import remove_stale_partials

from nereid.backends.subprocess.runner import run_model_process

# What an #include can reach: sources, headers, and the inline and template files some projects include.
HEADER_SUFFIXES = (".h", ".hh", ".hpp", ".hxx", ".h++", ".H", ".inl", ".ipp", ".tpp", ".tcc", ".inc")
SOURCE_SUFFIXES = (".cpp", ".cc", ".cxx", ".c++", ".C", ".c", *HEADER_SUFFIXES)
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
    """A key over every C++ source and header in the folder and its subfolders, the compiler and the flags."""
    digest = hashlib.sha256()
    digest.update(compiler.encode())
    digest.update(" ".join(CXX_FLAGS).encode())
    for path in code_files(folder, SOURCE_SUFFIXES):
        digest.update(str(path.relative_to(folder)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:20]


def code_files(folder: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """The files under ``folder`` (subfolders too, but not hidden ones such as ``.cache``) with these suffixes.

    An #include may reach into a subfolder (``include/factor.h``), so an edit
    there must change the key as much as one beside ``main.cpp``.
    """
    found = []
    for root, folders, files in os.walk(folder):
        folders[:] = sorted(f for f in folders if not f.startswith("."))
        found.extend(Path(root) / name for name in sorted(files)
                     if name.endswith(suffixes) and not name.startswith(".") and (Path(root) / name).is_file())
    return found


def compile_to(compiler: str, arguments: list[str], target: Path, cwd: Path, what: str) -> None:
    """Run ``compiler arguments -o TARGET`` through a temporary name renamed into place.

    An interrupted or concurrent build never leaves a half-written file under
    the final name (and a killed one's ``.partial`` is removed next time). The
    compiler's exit is noticed at once and its group killed past
    COMPILE_TIMEOUT_S. A failure raises ConfigError naming ``what`` with the
    compiler's message.
    """
    remove_stale_partials(target.parent)
    partial = target.parent / f".{target.name}.{os.getpid()}.partial"
    completed = run_model_process([compiler, *arguments, "-o", str(partial)], cwd=cwd, env=dict(os.environ),
                                  stdin=b"", timeout_s=COMPILE_TIMEOUT_S, tail_bytes=MESSAGE_TAIL_CHARS)
    if completed.timed_out or completed.returncode != 0:
        partial.unlink(missing_ok=True)
        if completed.timed_out:
            raise ConfigError(f"{what}: compilation took longer than {COMPILE_TIMEOUT_S} s")
        raise ConfigError(f"{what}: compilation failed ({os.path.basename(compiler)} {completed.describe()}):\n"
                          f"{completed.output_tail}")
    os.replace(partial, target)


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
    compile_to(compiler, [*CXX_FLAGS, source], binary, folder, str(folder / source))
    for stale in cache.glob("main-*"):
        if stale != binary:
            stale.unlink(missing_ok=True)
    return binary
