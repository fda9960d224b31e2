"""What the native backends read of an ELF file before they run or load it: whether it is whole, which
libraries it needs, and where the loader looks for them.

Read with ``pread`` on a descriptor opened without blocking, never through a
memory map: a file cut short under a map (a library being rewritten in place,
a copy still arriving) raises SIGBUS, which ends the whole server, where a
short read is only a short read. And a FIFO is never waited on.
"""

from __future__ import annotations

import os
import stat
import struct
from dataclasses import dataclass, field
from typing import Callable, TypeVar

T = TypeVar("T")
Read = Callable[[int, int], bytes]  # (offset, size) -> up to size bytes of the file at offset

_MAX_NAME_BYTES = 4096  # read for one name or search path (short; one without its NUL in it is skipped)


def _opened(path: str) -> int | None:
    """A descriptor of ``path`` when it is a regular file (opened without blocking: a FIFO is not waited on)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def elf_cut_short(path: str) -> str | None:
    """Why the ELF file ``path`` cannot be mapped whole (shorter than its headers say: a copy cut short, or still
    being written); None when it is whole, and when it is no ELF file (the loader says what it is then).

    Whole: its section header table (which the linker writes last) and every
    segment it loads lie inside the file. dlopen maps the segments: one past
    the file's end faults (SIGBUS) at the first touch, in the server.
    """
    fd = _opened(path)
    if fd is None:
        return None
    try:
        size = os.fstat(fd).st_size
        return _cut_short(lambda offset, count: os.pread(fd, count, offset), size)
    except (OSError, struct.error, ValueError):
        return "its ELF headers cannot be read whole: a copy cut short, or still being written"
    finally:
        os.close(fd)


def _elf_header(header: bytes) -> tuple[bool, str] | None:
    """(64-bit, struct byte order) of an ELF file whose first 64 bytes are ``header``; None for anything else."""
    if len(header) < 52 or header[:4] != b"\x7fELF" or header[4] not in (1, 2) or header[5] not in (1, 2):
        return None
    if header[4] == 2 and len(header) < 64:
        return None
    return header[4] == 2, "<" if header[5] == 1 else ">"


@dataclass(frozen=True)
class _Layout:
    """Where an ELF file's header says its program and section header tables are, and how to read its words."""

    wide: bool  # 64-bit
    order: str  # struct's byte order
    phoff: int
    phentsize: int
    phnum: int
    shoff: int
    shentsize: int
    shnum: int


def _layout(read: Read) -> _Layout | None:
    """The ELF header of the file ``read`` reads; None when it is no ELF file."""
    header = read(0, 64)
    kind = _elf_header(header)
    if kind is None:
        return None
    wide, order = kind
    phoff, shoff = struct.unpack_from(order + ("QQ" if wide else "II"), header, 0x20 if wide else 0x1C)
    phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", header, 0x36 if wide else 0x2A)
    return _Layout(wide, order, phoff, phentsize, phnum, shoff, shentsize, shnum)


def _parsed(path: str, parse: Callable[[Read], T], empty: T) -> T:
    """``parse`` of the regular file ``path``, read with ``pread``; ``empty`` for a file that is not regular, or
    cannot be read, or is cut short."""
    fd = _opened(path)
    if fd is None:
        return empty
    try:
        return parse(lambda offset, count: os.pread(fd, count, offset))
    except (OSError, ValueError, struct.error):  # unreadable, cut short
        return empty
    finally:
        os.close(fd)


def _cut_short(read: Read, size: int) -> str | None:
    layout = _layout(read)
    if layout is None:
        return None
    needed = layout.shoff + layout.shentsize * layout.shnum
    for kind, offset, _, filesz in _program_headers(read, layout):
        if kind in (1, 2):  # PT_LOAD, PT_DYNAMIC
            needed = max(needed, offset + filesz)
    if needed > size:
        return (f"it is {size} bytes, and its ELF headers say at least {needed}: a copy cut short, or still being "
                "written")
    return None


def _program_headers(read: Read, layout: _Layout) -> list[tuple[int, int, int, int]]:
    """(p_type, p_offset, p_vaddr, p_filesz) of each program header; struct.error when the table is cut short."""
    table = read(layout.phoff, layout.phentsize * layout.phnum)
    headers = []
    for index in range(layout.phnum):
        at = index * layout.phentsize
        if layout.wide:
            kind, _, offset, vaddr, _, filesz = struct.unpack_from(layout.order + "IIQQQQ", table, at)
        else:
            kind, offset, vaddr, _, filesz = struct.unpack_from(layout.order + "IIIII", table, at)
        headers.append((kind, offset, vaddr, filesz))
    return headers


@dataclass(frozen=True)
class LinkNames:
    """What the loader reads of a shared object to find the libraries it needs.

    ``needed``: the DT_NEEDED names, in order. ``runpath``: the DT_RUNPATH
    folders (None: it has none), ``rpath`` the DT_RPATH ones, as written
    (``$ORIGIN/lib`` unexpanded); the loader ignores ``rpath`` when there is a
    ``runpath``.
    """

    needed: list[str] = field(default_factory=list)
    runpath: list[str] | None = None
    rpath: list[str] = field(default_factory=list)


def needed_libraries(path: str) -> list[str]:
    """The DT_NEEDED names of the ELF shared object ``path`` (the libraries it asks the loader for); [] for a file
    that is no readable, regular ELF file, or one whose dynamic section cannot be followed.

    Only the headers, the dynamic section and the names are read, however large the library.
    """
    return link_names(path).needed


def link_names(path: str) -> LinkNames:
    """The DT_NEEDED names and the search folders of the ELF shared object ``path``; empty ones for a file that
    is no readable, regular ELF file, or one whose dynamic section cannot be followed."""
    strings = _parsed(path, _dynamic_strings, {})
    runpath = strings.get(_DT_RUNPATH)
    return LinkNames(strings.get(_DT_NEEDED, []),
                     None if runpath is None else [folder for text in runpath for folder in text.split(":")],
                     [folder for text in strings.get(_DT_RPATH, []) for folder in text.split(":")])


_DT_NEEDED, _DT_RPATH, _DT_RUNPATH = 1, 15, 29  # dynamic entries whose value is an offset into DT_STRTAB


def _dynamic_strings(read: Read) -> dict[int, list[str]]:
    """The strings of the DT_NEEDED, DT_RPATH and DT_RUNPATH entries of the dynamic section, by tag, in order."""
    layout = _layout(read)
    if layout is None:
        return {}
    wide, order = layout.wide, layout.order
    loads, dynamic = [], None  # (vaddr, offset, filesz) of each PT_LOAD; (offset, filesz) of PT_DYNAMIC
    for kind, offset, vaddr, filesz in _program_headers(read, layout):
        if kind == 1:
            loads.append((vaddr, offset, filesz))
        elif kind == 2:
            dynamic = (offset, filesz)
    if dynamic is None:
        return {}
    section = read(dynamic[0], dynamic[1])
    entry = struct.Struct(order + ("qQ" if wide else "iI"))
    named: list[tuple[int, int]] = []  # (tag, offset of its string)
    strtab = None
    for at in range(0, len(section) - entry.size + 1, entry.size):
        tag, value = entry.unpack_from(section, at)
        if tag == 0:  # DT_NULL
            break
        if tag in (_DT_NEEDED, _DT_RPATH, _DT_RUNPATH):
            named.append((tag, value))
        elif tag == 5:  # DT_STRTAB: its address, mapped to the file by the segment holding it
            strtab = next((value - vaddr + offset for vaddr, offset, size in loads if vaddr <= value < vaddr + size),
                          None)
    if strtab is None:
        return {}
    strings: dict[int, list[str]] = {}
    for tag, offset in named:
        text = read(strtab + offset, _MAX_NAME_BYTES)
        end = text.find(b"\0")
        if end >= 0:
            # As the os module decodes file names: a name that is not UTF-8 comes back whole from os.fsencode,
            # for the loader's dlopen and for the file it names (errors="replace" named another file).
            strings.setdefault(tag, []).append(os.fsdecode(text[:end]))
    return strings


_SHT_DYNSYM = 11
_STB_GNU_UNIQUE = 10  # a symbol binding of GCC's: one object for the whole process, whoever defines it
_MAX_DYNSYM_BYTES = 64 << 20  # (a section header claiming more is no real library's)


def unique_symbols(path: str) -> list[str]:
    """The names of the defined dynamic symbols of the ELF shared object ``path`` bound STB_GNU_UNIQUE (GCC's for
    the function-local statics of inline functions and templates, unless built with -fno-gnu-unique), in order;
    [] for a file that is no readable, regular ELF file, or one whose dynamic symbol table cannot be read.

    The loader binds each process-wide, and never unmaps the library that holds one: the objects of its first load
    outlive a reload of a rebuilt library, and are shared with every library defining them.
    """
    return _parsed(path, _unique_symbols, [])


def _unique_symbols(read: Read) -> list[str]:
    layout = _layout(read)
    if layout is None:
        return []
    wide, order, shentsize = layout.wide, layout.order, layout.shentsize
    table = read(layout.shoff, shentsize * layout.shnum)
    # Section header: (sh_type, sh_offset, sh_size, sh_link) of each; then the symbols' own layout.
    section = struct.Struct(order + ("4xI16xQQI" if wide else "4xI8xIII"))
    sections = [section.unpack_from(table, index * shentsize) for index in range(layout.shnum)]
    symbol = struct.Struct(order + ("IB3xQQ" if wide else "IIIB3x"))
    names: list[str] = []
    for kind, offset, size, link in sections:
        if kind != _SHT_DYNSYM or size > _MAX_DYNSYM_BYTES or link >= len(sections):
            continue
        symbols = read(offset, size)
        _, strings_at, strings_size, _ = sections[link]
        strings = read(strings_at, min(strings_size, _MAX_DYNSYM_BYTES))
        for at in range(0, len(symbols) - symbol.size + 1, symbol.size):
            fields = symbol.unpack_from(symbols, at)
            name, info = (fields[0], fields[1]) if wide else (fields[0], fields[3])
            shndx = struct.unpack_from(order + "H", symbols, at + (6 if wide else 14))[0]
            if info >> 4 == _STB_GNU_UNIQUE and shndx != 0:
                end = strings.find(b"\0", name)
                names.append(os.fsdecode(strings[name:end if end >= 0 else None]))
    return names
