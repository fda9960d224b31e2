"""Run one of nereid's own scripts from its bytecode, as ``python file.pyc`` does, when that bytecode is fresh.

The interpreter never caches the code of the script it is given to run: it
compiles ``warm_parent.py`` (about 68 KB) from source at every warm parent's
start, some 10 ms of CPU on the 2-core test machine, which each model load and
each parent restart pays. Given a ``.pyc`` file instead, it runs the code
straight from it and imports nothing more. The bytecode is the one the
import system keeps for the file (``__pycache__``, or ``sys.pycache_prefix``),
which ``pip install`` writes; it is checked here against the source as the
import system checks it, since the interpreter running a ``.pyc`` checks
nothing. Its code keeps the source's path, so tracebacks still quote the source.
A bytecode file whose header is right but whose code is not (cut short, damaged
on disk) is compiled again, as a stale one is: run, it failed every warm parent's
start and every cold run with "Bad code object in .pyc file".
"""

from __future__ import annotations

import functools
import importlib.util
import marshal
import os
import py_compile
import sys
import types
from pathlib import Path

HEADER_BYTES = 16
FLAG_HASH_BASED = 0b01
FLAG_CHECK_SOURCE = 0b10


def runnable_script(source: Path) -> Path:
    """The file to give the interpreter to run ``source`` as a script: its cached bytecode when that is up to
    date (compiled here first, unless the interpreter writes no bytecode: PYTHONDONTWRITEBYTECODE), else
    ``source`` itself (no bytecode, a stale one that cannot be rewritten, a read-only install)."""
    # The plain bytecode even under `python -O`: the interpreter it is given to runs without -O (asserts kept).
    cached = Path(importlib.util.cache_from_source(str(source), optimization=""))
    if bytecode_is_fresh(cached, source) and holds_code(cached):
        return cached
    if sys.dont_write_bytecode:
        return source
    try:
        py_compile.compile(str(source), cfile=str(cached), doraise=True)
    except (OSError, py_compile.PyCompileError):  # (a read-only site-packages: the source still runs)
        return source
    return cached if bytecode_is_fresh(cached, source) and holds_code(cached) else source


def holds_code(cached: Path) -> bool:
    """Whether ``cached`` holds a whole code object after its header (checked once per version of the file: by
    its inode, size and modification time). The header says only which source it was made from."""
    try:
        status = os.stat(cached)
    except OSError:
        return False
    return _unmarshals(str(cached), status.st_ino, status.st_size, status.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _unmarshals(path: str, inode: int, size: int, mtime_ns: int) -> bool:
    """(The version of the file ``path`` is part of the key: a file compiled again is read again.)"""
    try:
        with open(path, "rb") as file:
            data = file.read()
        return isinstance(marshal.loads(memoryview(data)[HEADER_BYTES:]), types.CodeType)
    except (OSError, ValueError, EOFError, TypeError):  # (marshal's "bad marshal data", a file cut short)
        return False


def bytecode_is_fresh(cached: Path, source: Path) -> bool:
    """Whether ``cached`` holds this interpreter's bytecode of ``source`` as it is now, by the rules the import
    system applies (PEP 552): the source's modification time and size, or its hash, recorded in the header."""
    try:
        with open(cached, "rb") as file:
            header = file.read(HEADER_BYTES)
        status = source.stat()
    except OSError:
        return False
    if len(header) < HEADER_BYTES or header[:4] != importlib.util.MAGIC_NUMBER:
        return False
    flags = int.from_bytes(header[4:8], "little")
    if flags & FLAG_HASH_BASED:
        if not flags & FLAG_CHECK_SOURCE:
            return True  # an unchecked hash: the import system does not look at the source either
        try:
            return header[8:16] == importlib.util.source_hash(source.read_bytes())
        except OSError:
            return False
    if flags:
        return False  # flags this interpreter does not know
    recorded_time = int.from_bytes(header[8:12], "little")
    recorded_size = int.from_bytes(header[12:16], "little")
    return recorded_time == int(status.st_mtime) & 0xFFFFFFFF and recorded_size == status.st_size & 0xFFFFFFFF
