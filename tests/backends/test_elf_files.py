"""What the native backends read of an ELF file (backends/elf_files.py): whether it is whole, and which libraries
it needs; read without a memory map and never waiting on a FIFO.

Hand-made ELF files cover the four layouts (32/64-bit, either byte order) the
reader parses; a library the system's compiler links covers what a real
linker writes.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from nereid.backends.elf_files import LinkNames, elf_cut_short, link_names, needed_libraries, unique_symbols

CC = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("c++")

BASE = 0x400000  # the address the hand-made files' one PT_LOAD segment is mapped at


def hand_made_elf(wide: bool, big: bool, needed: list[str]) -> bytes:
    """A minimal shared object: the ELF header, a PT_LOAD of the whole file, a PT_DYNAMIC listing ``needed``
    (DT_NEEDED offsets into a DT_STRTAB), the string table; no section headers."""
    order = ">" if big else "<"
    header_size, entry_size = (64, 56) if wide else (52, 32)
    strings = b"\0" + b"".join(os.fsencode(name) + b"\0" for name in needed)
    offsets = [1 + sum(len(os.fsencode(n)) + 1 for n in needed[:i]) for i in range(len(needed))]
    dynamic_at = header_size + 2 * entry_size
    dynamic_entry = struct.Struct(order + ("qQ" if wide else "iI"))
    count = len(needed) + 2  # the names, DT_STRTAB, DT_NULL
    strtab_at = dynamic_at + count * dynamic_entry.size
    size = strtab_at + len(strings)
    ident = b"\x7fELF" + bytes([2 if wide else 1, 2 if big else 1, 1]) + bytes(9)
    if wide:
        header = ident + struct.pack(order + "HHIQQQIHHHHHH", 3, 62, 1, 0, header_size, 0, 0, header_size,
                                     entry_size, 2, 64, 0, 0)
        program = b"".join(struct.pack(order + "IIQQQQQQ", kind, 4, offset, BASE + offset, BASE + offset, filesz,
                                       filesz, 8) for kind, offset, filesz in ((1, 0, size),
                                                                               (2, dynamic_at, count * 16)))
    else:
        header = ident + struct.pack(order + "HHIIIIIHHHHHH", 3, 3, 1, 0, header_size, 0, 0, header_size,
                                     entry_size, 2, 40, 0, 0)
        program = b"".join(struct.pack(order + "IIIIIIII", kind, offset, BASE + offset, BASE + offset, filesz,
                                       filesz, 4, 4) for kind, offset, filesz in ((1, 0, size),
                                                                                  (2, dynamic_at, count * 8)))
    dynamic = b"".join(dynamic_entry.pack(1, offset) for offset in offsets)
    dynamic += dynamic_entry.pack(5, BASE + strtab_at) + dynamic_entry.pack(0, 0)
    data = header + program + dynamic + strings
    assert len(data) == size
    return data


LAYOUTS = [(wide, big) for wide in (True, False) for big in (False, True)]
LAYOUT_IDS = [f"{64 if wide else 32}-bit {'big' if big else 'little'}-endian" for wide, big in LAYOUTS]


@pytest.mark.parametrize("wide,big", LAYOUTS, ids=LAYOUT_IDS)
def test_the_needed_libraries_of_each_layout_are_read_in_order(tmp_path: Path, wide: bool, big: bool) -> None:
    path = tmp_path / "libm.so"
    path.write_bytes(hand_made_elf(wide, big, ["libhelper.so.1", "libc.so.6"]))
    assert needed_libraries(str(path)) == ["libhelper.so.1", "libc.so.6"]
    assert elf_cut_short(str(path)) is None  # whole


def test_a_name_that_is_not_utf_8_is_read_as_the_os_module_reads_file_names(tmp_path: Path) -> None:
    """os.fsencode gives its bytes back, for dlopen and for the file it names (errors="replace" named another)."""
    path = tmp_path / "libm.so"
    path.write_bytes(hand_made_elf(True, False, [os.fsdecode(b"libhelper\xff.so")]))
    assert [os.fsencode(name) for name in needed_libraries(str(path))] == [b"libhelper\xff.so"]


@pytest.mark.parametrize("wide,big", LAYOUTS, ids=LAYOUT_IDS)
def test_a_file_shorter_than_its_headers_say_is_cut_short(tmp_path: Path, wide: bool, big: bool) -> None:
    """A copy still arriving: mapped, its missing part would fault (SIGBUS) in the server at the first touch."""
    whole = hand_made_elf(wide, big, ["libhelper.so.1"])
    path = tmp_path / "libm.so"
    path.write_bytes(whole[:-1])
    assert elf_cut_short(str(path)) == (f"it is {len(whole) - 1} bytes, and its ELF headers say at least "
                                        f"{len(whole)}: a copy cut short, or still being written")
    path.write_bytes(whole[:70])  # its program headers themselves cut short
    assert elf_cut_short(str(path)) == ("its ELF headers cannot be read whole: a copy cut short, or still being "
                                        "written")
    assert needed_libraries(str(path)) == []


def test_a_string_table_outside_every_loaded_segment_gives_no_names(tmp_path: Path) -> None:
    """DT_STRTAB is an address: with no segment mapping it, the names cannot be found, and none is guessed."""
    data = bytearray(hand_made_elf(True, False, ["libhelper.so.1"]))
    strtab_entry = 64 + 2 * 56 + 16  # after the header, the two program headers and the one DT_NEEDED
    assert struct.unpack_from("<q", data, strtab_entry) == (5,)  # DT_STRTAB
    struct.pack_into("<Q", data, strtab_entry + 8, 0x10)  # below BASE: in no PT_LOAD
    path = tmp_path / "libm.so"
    path.write_bytes(bytes(data))
    assert needed_libraries(str(path)) == []


@pytest.mark.parametrize("kind", ["missing", "not ELF", "too short for a header", "folder"])
def test_what_is_no_elf_file_needs_nothing_and_is_left_to_the_loader_to_name(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "libm.so"
    if kind == "not ELF":
        path.write_text("this is not an ELF file\n" * 10)
    elif kind == "too short for a header":
        path.write_bytes(hand_made_elf(True, False, ["libc.so.6"])[:40])
    elif kind == "folder":
        path.mkdir()
    assert needed_libraries(str(path)) == []
    assert elf_cut_short(str(path)) is None


@pytest.mark.timeout(30)
def test_a_fifo_is_never_waited_on(tmp_path: Path) -> None:
    """No writer will ever come: a blocking open would hold the load (and the test) for good."""
    fifo = tmp_path / "libm.so"
    os.mkfifo(fifo)
    assert needed_libraries(str(fifo)) == []
    assert elf_cut_short(str(fifo)) is None


@pytest.mark.skipif(CC is None, reason="no C compiler")
def test_a_linked_library_needs_what_it_was_linked_with_and_is_whole(tmp_path: Path) -> None:
    (tmp_path / "helper.c").write_text("int helper_value(void) { return 5; }\n")
    (tmp_path / "model.c").write_text("int helper_value(void);\nint model_value(void) { return helper_value(); }\n")
    for argv in ([CC, "-shared", "-fPIC", "-Wl,-soname,libhelper.so.1", "-o", str(tmp_path / "libhelper.so"),
                  str(tmp_path / "helper.c")],
                 [CC, "-shared", "-fPIC", "-o", str(tmp_path / "libmodel.so"), str(tmp_path / "model.c"),
                  f"-L{tmp_path}", "-lhelper"]):
        subprocess.run(argv, check=True, capture_output=True, timeout=120)
    library = tmp_path / "libmodel.so"
    needed = needed_libraries(str(library))
    assert needed[0] == "libhelper.so.1", needed  # (by its soname, as the loader looks for it; then libc...)
    assert elf_cut_short(str(library)) is None
    whole = library.read_bytes()
    library.write_bytes(whole[:len(whole) // 2])
    assert elf_cut_short(str(library)).startswith(f"it is {len(whole) // 2} bytes, and its ELF headers say at least ")


@pytest.mark.skipif(CC is None, reason="no C compiler")
@pytest.mark.parametrize("tags,kind", [("--enable-new-dtags", "runpath"), ("--disable-new-dtags", "rpath")])
def test_the_search_folders_a_library_was_linked_with_are_read_as_written(tmp_path: Path, tags: str,
                                                                         kind: str) -> None:
    """DT_RUNPATH (what the linker writes by default on most systems) or DT_RPATH (the older tag), split at ':',
    with $ORIGIN left for the reader to put in."""
    (tmp_path / "model.c").write_text("int model_value(void) { return 5; }\n")
    subprocess.run([CC, "-shared", "-fPIC", "-o", str(tmp_path / "libmodel.so"), str(tmp_path / "model.c"),
                    f"-Wl,{tags}", "-Wl,-rpath,$ORIGIN/lib:/opt/vendor/lib"], check=True, capture_output=True,
                   timeout=120)
    names = link_names(str(tmp_path / "libmodel.so"))
    folders = ["$ORIGIN/lib", "/opt/vendor/lib"]
    assert (names.runpath, names.rpath) == ((folders, []) if kind == "runpath" else (None, folders))
    assert link_names(str(tmp_path / "model.c")) == LinkNames()  # no ELF file: nothing needed, nowhere


CXX = shutil.which(os.environ.get("CXX", "c++"))
INLINE_STATIC = """#include <vector>
inline std::vector<float>& table() { static std::vector<float> t(8, 1.5f); return t; }
extern "C" float first() { return table()[0]; }
"""


def _gcc(compiler: str | None) -> bool:
    return compiler is not None and "clang" not in subprocess.run([compiler, "--version"], capture_output=True,
                                                                  text=True).stdout.lower()


@pytest.mark.skipif(not _gcc(CXX), reason="needs GCC's C++ compiler (clang makes no STB_GNU_UNIQUE symbols)")
def test_the_symbols_bound_process_wide_are_those_gcc_made_unique(tmp_path: Path) -> None:
    """The statics of inline functions, which GCC binds STB_GNU_UNIQUE unless told -fno-gnu-unique (the
    native-models hunt: a reload of such a library kept serving its first load's objects, unsaid)."""
    (tmp_path / "table.cpp").write_text(INLINE_STATIC)
    for flags, name in (([], "libunique.so"), (["-fno-gnu-unique"], "libplain.so")):
        subprocess.run([CXX, "-shared", "-fPIC", *flags, "-o", str(tmp_path / name), str(tmp_path / "table.cpp")],
                       check=True, capture_output=True, timeout=120)
    assert sorted(unique_symbols(str(tmp_path / "libunique.so"))) == ["_ZGVZ5tablevE1t", "_ZZ5tablevE1t"]
    assert unique_symbols(str(tmp_path / "libplain.so")) == []
    assert unique_symbols(str(tmp_path / "table.cpp")) == []  # no ELF file
    whole = (tmp_path / "libunique.so").read_bytes()
    (tmp_path / "libunique.so").write_bytes(whole[:len(whole) // 3])  # cut short, its section headers gone
    assert unique_symbols(str(tmp_path / "libunique.so")) == []
