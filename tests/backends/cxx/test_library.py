"""backends/cxx/library.py: a library is copied into the scratch folder (its dependencies beside it), checked,
and dlopened; every fault of the copy or the loader names the model and the file."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nereid.backends.cxx.build import header_dir
from nereid.backends.elf_files import needed_libraries
from nereid.cli import main as nereid_main
from nereid.errors import ConfigError
from support import NEREID, run_with_tmpdir_mounted_noexec
from tests.backends.cxx.cxx_support import CXX, ROWS, TRIPLE, entry, index_of, scale_model, tensor

pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler")


def test_a_library_built_with_the_header_exports_the_api_version_the_server_calls(libs) -> None:
    """What the load checks (test_model.py's refusals include a library of another version); one built before the
    header exported it (the version-less ones here) is taken as version 1."""
    from nereid.backends.cxx import API_VERSION
    header = (header_dir() / "nereid_cxx.h").read_text()
    assert f"#define NEREID_CXX_API_VERSION {API_VERSION}\n" in header
    library = ctypes.CDLL(str(libs["multi"]))
    assert ctypes.c_uint32.in_dll(library, "nereid_cxx_api_version").value == API_VERSION


def test_a_changed_library_is_picked_up_on_reload(repo, serve, libs):
    scale_model(repo, "scale")
    library = repo.root / "build" / "libscale.so"
    library.parent.mkdir()
    shutil.copyfile(libs["noload"], library)
    server = serve(repo.write_config(entry("scale", '{library: "build/libscale.so"}')))  # relative to nereid.yaml
    assert server.client.infer("scale", [tensor("input", ROWS)]).as_numpy("output").tolist() == (ROWS * 2).tolist()
    # Rewritten in place: harmless to the loaded copy, and the next load sees it.
    shutil.copyfile(libs["triple"], library)
    assert server.client.infer("scale", [tensor("input", ROWS)]).as_numpy("output").tolist() == (ROWS * 2).tolist()
    server.client.load_model("scale")
    assert server.client.infer("scale", [tensor("input", ROWS)]).as_numpy("output").tolist() == (ROWS * 3).tolist()


def test_a_scratch_folder_on_a_noexec_mount_makes_the_model_unavailable_saying_so(repo, libs, tmp_path):
    """Defect: with TMPDIR (/tmp) mounted noexec, dlopen of the library's copy there failed "failed to map
    segment from shared object", and the reason blamed the user's library, on a file system that runs code."""
    scale_model(repo, "scale")
    noexec = tmp_path / "noexec"
    config = repo.write_config(entry("scale", f'{{library: "{libs["multi"]}"}}'))
    result = run_with_tmpdir_mounted_noexec(noexec, [*NEREID, "check", "--config", str(config)])
    assert result.returncode == 1, result.stdout + result.stderr
    [line] = [line for line in result.stdout.splitlines() if line.startswith("scale: ")]
    assert line.startswith(f"scale: UNAVAILABLE: model 'scale': shared library {libs['multi']} runs from a copy in "
                           f"the server's scratch folder {noexec}/nereid-"), line
    assert "which is on a file system mounted noexec" in line and "set TMPDIR to a folder" in line, line


# A child whose files may not grow past 4 KiB (RLIMIT_FSIZE, SIGXFSZ ignored so that a write fails with EFBIG): a
# full scratch folder, without a disk to fill. It prints the load's error, then what the scratch folder holds.
_LOAD_WITH_FULL_DISK = """
import os, resource, signal, sys
from pathlib import Path
from nereid.backends.cxx.library import NativeLibrary
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    NativeLibrary("full", Path(sys.argv[1]), Path(sys.argv[2]))
except Exception as err:
    print(type(err).__name__, err)
print(sorted(os.listdir(sys.argv[2])))
"""


def test_a_full_scratch_folder_is_named_and_keeps_no_partial_copy(libs, tmp_path):
    """Defect: a library copy that a full scratch folder cut short said "cannot read shared library ...: No space
    left on device" (the copy's side was full, not the library unreadable), and the partial copy stayed in the
    scratch folder until the server stopped."""
    library = libs["multi"]
    assert library.stat().st_size > 4096
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    child = subprocess.run([sys.executable, "-c", _LOAD_WITH_FULL_DISK, str(library), str(scratch)],
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    assert child.stdout.splitlines() == [
        f"ConfigError model 'full': cannot copy shared library {library} into the server's scratch folder "
        f"{scratch}: File too large (the server makes its scratch folder in TMPDIR)", "[]"], child.stdout


HELPER = 'extern "C" float nereid_test_factor() { return 5.0f; }\n'


def test_a_library_finding_its_dependencies_beside_it_through_origin_loads(repo, serve):
    """Defect: the private copy was made alone in the scratch folder, so a library linked with a RUNPATH of $ORIGIN
    (its dependencies shipped beside it, as a prebuilt library usually is) could not find them: 'libhelper.so:
    cannot open shared object file'."""
    folder = scale_model(repo, "shipped")
    lib = folder / "lib"
    lib.mkdir()
    (lib / "helper.cpp").write_text(HELPER)
    (lib / "model.cpp").write_text('extern "C" float nereid_test_factor();\n' + TRIPLE.replace(
        "* 3.0f", "* nereid_test_factor()"))
    for argv in ([CXX, "-shared", "-fPIC", "-o", str(lib / "libhelper.so"), str(lib / "helper.cpp")],
                 [CXX, "-shared", "-fPIC", "-std=c++17", f"-I{header_dir()}", "-o", str(lib / "libmodel.so"),
                  str(lib / "model.cpp"), f"-L{lib}", "-lhelper", "-Wl,-rpath,$ORIGIN"]):
        subprocess.run(argv, check=True, capture_output=True, timeout=120)
    server = serve(repo.write_config(entry("shipped", '{library: "$MODEL_FOLDER/lib/libmodel.so"}')))
    assert index_of(server)["shipped"][0] == "READY", index_of(server)["shipped"]
    assert server.client.infer("shipped", [tensor("input", ROWS)]).as_numpy("output").tolist() == \
        (ROWS * 5).tolist()


_DEPENDENT_MODEL = """#include <cstdint>
#include "nereid_cxx.h"
extern "C" int64_t helper_value();
extern "C" int nereid_infer(void*, const nereid_tensor*, size_t, nereid_tensor* out, size_t, char*, size_t) {
    *static_cast<int64_t*>(out[0].data) = helper_value();
    return 0;
}
"""


_REWRITE_DEPENDENCY = """import shutil, sys
from pathlib import Path
from nereid.backend import ModelContext
from nereid.backends.cxx.model import CxxModel
from nereid.settings import ModelSettings
folder, new_helper, scratch = map(Path, sys.argv[1:])
settings = ModelSettings("m", runtime={"library": str(folder / "lib" / "libmodel.so")})
model = CxxModel(ModelContext("m", folder, settings, scratch, "test"))
model.load()
print(int(model.infer([])[0].data[0]), flush=True)
(private,) = [path for path in scratch.glob("libmodel-*") if path.is_dir()]
private = private / "lib"  # (in a copy of the model's folder: lib/ a folder of its own)
print(" ".join(f"{path.name}:{'link' if path.is_symlink() else 'file'}" for path in sorted(private.iterdir())))
shutil.copyfile(new_helper, folder / "lib" / "libhelper.so.1.2")  # a deploy's cp: the same file, rewritten
print(int(model.infer([])[0].data[0]), flush=True)
model.unload()
"""


def test_rewriting_a_dependency_beside_the_library_leaves_the_running_model_alone(tmp_path):
    """Defect (found by a bug hunt): the shared objects beside the library were linked into its private folder, not
    copied, so a deploy copying a new dependency over the old one (cp rewrites the same file) changed the code
    under the running model: it answered garbage, then the server died of a segmentation fault. A versioned
    name's link (libhelper.so -> libhelper.so.1) still leads to the copy."""
    folder = tmp_path / "m"
    lib = folder / "lib"
    lib.mkdir(parents=True)
    (folder / "model_inference.textproto").write_text('output { name: "v" data_type: "INT64" dims: [1] }\n')
    (tmp_path / "helper.cpp").write_text('#include <cstdint>\nextern "C" int64_t helper_value() { return VALUE; }\n')
    (lib / "model.cpp").write_text(_DEPENDENT_MODEL)
    (tmp_path / "v2").mkdir()
    for value, out in ((5, lib / "libhelper.so.1.2"), (7, tmp_path / "v2" / "libhelper.so.1.2")):
        subprocess.run([CXX, "-shared", "-fPIC", f"-DVALUE={value}", "-Wl,-soname,libhelper.so.1", "-o", str(out),
                        str(tmp_path / "helper.cpp")], check=True, capture_output=True, timeout=120)
    (lib / "libhelper.so.1").symlink_to("libhelper.so.1.2")  # as libraries ship: the soname, then the file
    (lib / "libhelper.so").symlink_to("libhelper.so.1")
    shutil.copy(lib / "libhelper.so.1.2", lib / "libunrelated.so")  # beside it, but not needed: linked, not copied
    subprocess.run([CXX, "-shared", "-fPIC", "-std=c++17", f"-I{header_dir()}", "-o", str(lib / "libmodel.so"),
                    str(lib / "model.cpp"), f"-L{lib}", "-lhelper", "-Wl,-rpath,$ORIGIN"],
                   check=True, capture_output=True, timeout=120)
    assert needed_libraries(str(lib / "libmodel.so"))[0] == "libhelper.so.1"  # (then libstdc++, libc...)
    (tmp_path / "scratch").mkdir()
    done = subprocess.run([sys.executable, "-c", _REWRITE_DEPENDENCY, str(folder), str(tmp_path / "v2" /
                           "libhelper.so.1.2"), str(tmp_path / "scratch")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    # The library and the one it needs are copies; the soname's links lead to the copy; the rest stays linked.
    assert done.stdout.splitlines() == [
        "5", "libhelper.so:link libhelper.so.1:link libhelper.so.1.2:file libmodel.so:file libunrelated.so:link "
        "model.cpp:link", "5"], done.stdout


_REWRITE_DEPENDENCY_IN_A_SUBFOLDER = """import shutil, sys
from pathlib import Path
from nereid.backend import ModelContext
from nereid.backends.cxx.model import CxxModel
from nereid.settings import ModelSettings
folder, library, dependency, new_dependency, scratch = map(Path, sys.argv[1:])
settings = ModelSettings("m", runtime={"library": str(folder / library)})
model = CxxModel(ModelContext("m", folder, settings, scratch, "test"))
model.load()
print(int(model.infer([])[0].data[0]), flush=True)
mapped = [line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libhelper" in line]
print(sorted({path.startswith(f"{scratch}/") for path in mapped}))
shutil.copyfile(new_dependency, dependency)  # a deploy's cp: the same file, rewritten
print(int(model.infer([])[0].data[0]), flush=True)
model.unload()
print(sorted(scratch.iterdir()))
"""

# Where each layout keeps the model's library, the RUNPATH it is linked with, the dependency's real file (relative to
# the test's folder) and the links that lead to it.
LAYOUTS = {
    "lib/ under $ORIGIN/lib": ("m/libmodel.so", "$ORIGIN/lib", "m/lib/libhelper.so", {}),
    "lib/ under $ORIGIN/../lib": ("m/build/libmodel.so", "$ORIGIN/../lib", "m/lib/libhelper.so", {}),
    "lib/ under ${ORIGIN}/../lib": ("m/build/libmodel.so", "${ORIGIN}/../lib", "m/lib/libhelper.so", {}),
    # (The review hunt of fde27a9: a linked folder on the way to the library failed its load, "File exists".)
    "the library's folder linked": ("m/current/libmodel.so", "$ORIGIN/lib", "m/v1/lib/libhelper.so",
                                    {"m/current": "v1"}),
    "lib/ linked": ("m/libmodel.so", "$ORIGIN/lib", "m/sdk-1.0/lib/libhelper.so", {"m/lib": "sdk-1.0/lib"}),
    "a link with a slash": ("m/libmodel.so", "$ORIGIN/lib", "m/vendor/libhelper.so",
                            {"m/lib/libhelper.so": "../vendor/libhelper.so"}),
    "$ORIGIN/.. past the model's folder": ("m/lib/libmodel.so", "$ORIGIN/../../shared", "shared/libhelper.so", {}),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_dependency_in_a_subfolder_of_the_model_is_copied_with_the_library(tmp_path, layout):
    """Defect (noticed by the stop 56 native hunt): a library the model's library finds in a subfolder of the model
    (``lib/`` under a RUNPATH ``$ORIGIN/lib``, as SDKs lay them out) was mapped from the repository through a link
    to the folder, so a deploy's ``cp`` over it changed the code under the running model (it answered 7, then the
    process died of SIGSEGV); and under ``$ORIGIN/../lib`` the copy found nothing, where ``ldd`` finds it, and the
    model did not load. The copy sits in a copy of the model's folder now (of every folder it finds a library in
    through $ORIGIN), holding copies of what it needs from there; linked folders on the way are folders of the
    copy's own."""
    library, runpath, dependency, links = LAYOUTS[layout]
    folder = tmp_path / "m"
    (tmp_path / dependency).parent.mkdir(parents=True)
    for link, target in links.items():
        (tmp_path / link).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / link).symlink_to(target)
    (tmp_path / library).parent.mkdir(parents=True, exist_ok=True)  # (through a linked folder, it is there)
    (folder / "model_inference.textproto").write_text('output { name: "v" data_type: "INT64" dims: [1] }\n')
    (tmp_path / "helper.cpp").write_text('#include <cstdint>\nextern "C" int64_t helper_value() { return VALUE; }\n')
    (tmp_path / "model.cpp").write_text(_DEPENDENT_MODEL)
    (tmp_path / "v2").mkdir()
    for value, out in ((5, tmp_path / dependency), (7, tmp_path / "v2" / "libhelper.so")):
        subprocess.run([CXX, "-shared", "-fPIC", f"-DVALUE={value}", "-o", str(out), str(tmp_path / "helper.cpp")],
                       check=True, capture_output=True, timeout=120)
    subprocess.run([CXX, "-shared", "-fPIC", "-std=c++17", f"-I{header_dir()}", "-o", str(tmp_path / library),
                    str(tmp_path / "model.cpp"), f"-L{(tmp_path / dependency).parent}", "-lhelper",
                    f"-Wl,-rpath,{runpath}"], check=True, capture_output=True, timeout=120)
    (tmp_path / "scratch").mkdir()
    done = subprocess.run([sys.executable, "-c", _REWRITE_DEPENDENCY_IN_A_SUBFOLDER, str(folder),
                           str((tmp_path / library).relative_to(folder)), str(tmp_path / dependency),
                           str(tmp_path / "v2" / "libhelper.so"), str(tmp_path / "scratch")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    # Mapped from the copy in the scratch folder, not the repository's; nothing left there after the unload.
    assert done.stdout.splitlines() == ["5", "[True]", "5", "[]"], done.stdout


def test_a_dependency_found_in_the_model_s_folder_by_an_absolute_runpath_is_named(tmp_path, caplog):
    """The review hunt of fde27a9: an absolute RUNPATH into the model's folder (a build tree's) cannot lead to the
    copy, so the loader maps the repository's file, which a rewrite changes under the running model: said."""
    from nereid.backends.cxx.library import NativeLibrary

    folder = tmp_path / "m"
    (folder / "lib").mkdir(parents=True)
    (tmp_path / "helper.cpp").write_text('#include <cstdint>\nextern "C" int64_t helper_value() { return 5; }\n')
    (tmp_path / "model.cpp").write_text(_DEPENDENT_MODEL)
    subprocess.run([CXX, "-shared", "-fPIC", "-o", str(folder / "lib" / "libhelperabs.so"),
                    str(tmp_path / "helper.cpp")], check=True, capture_output=True, timeout=120)
    subprocess.run([CXX, "-shared", "-fPIC", "-std=c++17", f"-I{header_dir()}", "-o", str(folder / "libmodel.so"),
                    str(tmp_path / "model.cpp"), f"-L{folder / 'lib'}", "-lhelperabs",
                    f"-Wl,-rpath,{folder / 'lib'}"], check=True, capture_output=True, timeout=120)
    (tmp_path / "scratch").mkdir()
    with caplog.at_level(logging.WARNING, logger="nereid.backends.cxx.library"):
        library = NativeLibrary("m", folder / "libmodel.so", tmp_path / "scratch", folder)
        library.close()
    assert caplog.messages == [
        f"model 'm': shared library {folder / 'libmodel.so'} needs libhelperabs.so, which the loader took from the "
        f"model's folder ({folder / 'lib' / 'libhelperabs.so'}), not from the copy the server made: rewriting it "
        "while the model serves can crash the server; have the library find it through its RUNPATH relative to "
        "itself (-Wl,-rpath,'$ORIGIN/lib'), not an absolute path"]


def test_a_dependency_whose_name_is_not_utf_8_is_shipped_and_loaded(tmp_path):
    """A carried item of stop 58's reread: the ELF reader decoded DT_NEEDED names with errors="replace", so a
    library needing lib/<not UTF-8>.so was looked for under another name: not shipped with the copy, and not
    found by the loader."""
    from nereid.backends.cxx.library import NativeLibrary, _shipped_files

    folder = tmp_path / "m"
    (folder / "lib").mkdir(parents=True)
    helper = os.fsencode(folder / "lib") + b"/libhelper\xff.so"
    (tmp_path / "helper.cpp").write_text('#include <cstdint>\nextern "C" int64_t helper_value() { return 5; }\n')
    (tmp_path / "model.cpp").write_text(_DEPENDENT_MODEL)
    subprocess.run([CXX, "-shared", "-fPIC", "-o", helper, b"-Wl,-soname,libhelper\xff.so",
                    str(tmp_path / "helper.cpp")], check=True, capture_output=True, timeout=120)
    subprocess.run([CXX, "-shared", "-fPIC", "-std=c++17", f"-I{header_dir()}", "-o", str(folder / "libmodel.so"),
                    str(tmp_path / "model.cpp"), helper, "-Wl,-rpath,$ORIGIN/lib"],
                   check=True, capture_output=True, timeout=120)
    assert _shipped_files(folder / "libmodel.so") == {Path(os.fsdecode(helper))}
    (tmp_path / "scratch").mkdir()
    library = NativeLibrary("m", folder / "libmodel.so", tmp_path / "scratch", folder)
    try:
        value = ctypes.CFUNCTYPE(ctypes.c_int64)(library._symbol("helper_value"))()
    finally:
        library.close()
    assert value == 5


@pytest.mark.parametrize("tags,shipped", [
    ("--disable-new-dtags", {"lib/libkern.so", "lib/libmid.so", "lib2/libhelper.so"}),
    ("--enable-new-dtags", {"lib/libkern.so", "lib/libmid.so"})])
def test_the_files_a_library_ships_are_found_as_the_loader_finds_them(tmp_path, tags, shipped):
    """An RPATH serves the libraries its object's dependencies need too (the loader walks the loaders' RPATH, past
    a loader with a RUNPATH, which adds none), a RUNPATH only the object's own: lib/libmid.so, linked with no search
    folder and loaded by lib/libkern.so (RUNPATH $ORIGIN), finds lib2/libhelper.so through libmodel.so's RPATH, and
    nothing through its RUNPATH (the review hunt of fde27a9). A file the library does not need is not shipped."""
    from nereid.backends.cxx.library import _shipped_files

    for folder in ("lib", "lib2"):
        (tmp_path / folder).mkdir()
    (tmp_path / "helper.c").write_text("int helper_value(void) { return 5; }\n")
    (tmp_path / "mid.c").write_text("int helper_value(void);\nint mid_value(void) { return helper_value(); }\n")
    (tmp_path / "kern.c").write_text("int mid_value(void);\nint kern_value(void) { return mid_value(); }\n")
    (tmp_path / "model.c").write_text("int kern_value(void);\nint model_value(void) { return kern_value(); }\n")
    for argv in ([CXX, "-shared", "-fPIC", "-o", str(tmp_path / "lib2" / "libhelper.so"), str(tmp_path / "helper.c")],
                 [CXX, "-shared", "-fPIC", "-o", str(tmp_path / "lib" / "libmid.so"), str(tmp_path / "mid.c"),
                  f"-L{tmp_path / 'lib2'}", "-lhelper"],
                 [CXX, "-shared", "-fPIC", "-o", str(tmp_path / "lib" / "libkern.so"), str(tmp_path / "kern.c"),
                  f"-L{tmp_path / 'lib'}", "-lmid", "-Wl,--enable-new-dtags", "-Wl,-rpath,$ORIGIN"],
                 [CXX, "-shared", "-fPIC", "-o", str(tmp_path / "libmodel.so"), str(tmp_path / "model.c"),
                  f"-L{tmp_path / 'lib'}", "-lkern", f"-Wl,{tags}", "-Wl,-rpath,$ORIGIN/lib:$ORIGIN/lib2"]):
        subprocess.run(argv, check=True, capture_output=True, timeout=120)
    shutil.copy(tmp_path / "lib2" / "libhelper.so", tmp_path / "lib" / "libunused.so")
    assert _shipped_files(tmp_path / "libmodel.so") == {tmp_path / name for name in shipped}


def test_a_library_in_a_folder_that_cannot_be_listed_still_loads(libs, tmp_path):
    """Linking the library's neighbours is a service: a folder that may be entered but not listed (mode 0311)
    failed the load, calling the folder a shared library."""
    from support import run_as_non_root

    folder = tmp_path / "lib"
    folder.mkdir()
    shutil.copy(libs["multi"], folder / "libmulti.so")
    folder.chmod(0o311)
    (tmp_path / "scratch").mkdir()
    load = ("import sys\nfrom pathlib import Path\nfrom nereid.backends.cxx.library import NativeLibrary\n"
            "library = NativeLibrary('m', Path(sys.argv[1]), Path(sys.argv[2]))\nprint(library.infer is not None)\n"
            "library.close()\n")
    done = run_as_non_root([sys.executable, "-c", load, str(folder / "libmulti.so"), str(tmp_path / "scratch")],
                           tmp_path)
    assert (done.returncode, done.stdout.strip()) == (0, "True"), done.stderr


CRASHING_CONSTRUCTOR = r'''
#include <cstddef>
struct Crash { Crash() { volatile int* nowhere = nullptr; *nowhere = 1; } } crash_at_load;
extern "C" int nereid_infer(void*, const void*, size_t, void*, size_t, char*, size_t) { return 0; }
'''


def _checked_crashing(repo, tmp_path: Path, model: str, source_text: str) -> subprocess.CompletedProcess:
    """`nereid check` of a cxx model ``model`` whose library, built from ``source_text``, crashes the process;
    asserts that the check failed, and returns it."""
    source = tmp_path / f"{model}.cpp"
    source.write_text(source_text)
    library = tmp_path / f"lib{model}.so"
    subprocess.run([CXX, "-shared", "-fPIC", str(source), "-o", str(library)], check=True)
    scale_model(repo, model)
    config = repo.write_config(entry(model, f'{{library: "{library}"}}'))
    result = subprocess.run([*NEREID, "check", "--config", str(config)], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    return result


@pytest.mark.skipif(CXX is None, reason="needs a C++ compiler")
def test_a_library_that_crashes_the_process_says_where(repo, tmp_path, caplog):
    """Found by a bug hunt: a cxx library whose static constructor crashed (or exited) ended `nereid check` and
    `nereid serve` with no word of which model; a crash in a call left the log at "is READY". The server now
    says which library it opens before it runs any of its code, and a crash prints every thread's stack."""
    import subprocess as sp

    result = _checked_crashing(repo, tmp_path, "crash", CRASHING_CONSTRUCTOR)
    assert "Fatal Python error: Segmentation fault" in result.stderr, result.stderr
    assert "nereid/backends/cxx/library.py" in result.stderr or "backends/cxx/library.py" in result.stderr
    # The server's log names the model before the library's code runs (here without crashing: the test
    # library's constructor does nothing).
    from nereid.backends.cxx.library import NativeLibrary

    plain = tmp_path / "plain.cpp"
    plain.write_text(CRASHING_CONSTRUCTOR.replace("*nowhere = 1;", ""))
    sp.run([CXX, "-shared", "-fPIC", str(plain), "-o", str(tmp_path / "libplain.so")], check=True)
    (tmp_path / "scratch").mkdir()
    with caplog.at_level(logging.INFO, logger="nereid.backends.cxx.library"):
        NativeLibrary("plain", tmp_path / "libplain.so", tmp_path / "scratch").close()
    assert f"model 'plain': opening shared library {tmp_path / 'libplain.so'}" in caplog.text


UNIQUE_STATIC = r'''
#include <cstddef>
#include <vector>
inline std::vector<float>& table() { static std::vector<float> t(8, 1.5f); return t; }
extern "C" int nereid_infer(void*, const void*, size_t, void*, size_t, char*, size_t) { return table().size() != 8; }
'''


@pytest.mark.skipif(CXX is None or "clang" in os.path.basename(os.path.realpath(CXX)),
                    reason="needs GCC's C++ compiler")
def test_a_library_with_statics_bound_process_wide_is_loaded_with_a_warning_that_says_so(tmp_path, caplog):
    """Found by the native-models hunt: a prebuilt library built without -fno-gnu-unique (CMake's default) served
    its first load's objects after it was rebuilt and reloaded, and two models loading it shared them, unsaid."""
    import subprocess as sp

    from nereid.backends.cxx.library import NativeLibrary

    (tmp_path / "table.cpp").write_text(UNIQUE_STATIC)
    (tmp_path / "scratch").mkdir()
    for flags, name in (([], "libunique.so"), (["-fno-gnu-unique"], "libplain.so")):
        sp.run([CXX, "-shared", "-fPIC", *flags, str(tmp_path / "table.cpp"), "-o", str(tmp_path / name)],
               check=True)
    caplog.set_level(logging.WARNING, logger="nereid.backends.cxx.library")
    NativeLibrary("plain", tmp_path / "libplain.so", tmp_path / "scratch").close()
    assert not caplog.records
    NativeLibrary("unique", tmp_path / "libunique.so", tmp_path / "scratch").close()
    [said] = caplog.messages
    assert said.startswith(f"model 'unique': shared library {tmp_path / 'libunique.so'} defines 2 symbol(s) the "
                           "loader binds process-wide (STB_GNU_UNIQUE, GCC's for the statics of inline functions "
                           "and templates: "), said
    assert "table()::t" in said and said.endswith("build it with -fno-gnu-unique")


THROWING_LOAD = r'''
#include <cstddef>
#include <stdexcept>
extern "C" int nereid_load(const char*, const char*, void**, char*, size_t) { throw std::runtime_error("boom"); }
extern "C" int nereid_infer(void*, const void*, size_t, void*, size_t, char*, size_t) { return 0; }
'''


@pytest.mark.skipif(CXX is None, reason="needs a C++ compiler")
def test_a_crash_inside_a_library_s_call_names_the_model_in_the_crash_trace(repo, tmp_path):
    """Found by the native-models hunt: a C++ exception thrown out of a call (terminate, then SIGABRT) left a trace
    of nereid's own frames only, the same for every cxx model: the calls go through a frame of the model's name."""
    result = _checked_crashing(repo, tmp_path, "thrower", THROWING_LOAD)
    assert "what():  boom" in result.stderr and "Fatal Python error: Aborted" in result.stderr, result.stderr
    assert 'File "<cxx model \'thrower\'>", line 2 in call' in result.stderr, result.stderr


@pytest.mark.skipif(CXX is None, reason="needs a C++ compiler")
def test_an_undefined_cxx_symbol_is_named_readably_too(tmp_path):
    """Found by a bug hunt: the loader's mangled name alone (_Z20not_defined_anywherev) was all the reason said."""
    import subprocess as sp

    from nereid.backends.cxx.library import NativeLibrary
    from nereid.errors import ConfigError

    source = tmp_path / "undefined.cpp"
    source.write_text('#include <cstddef>\nint not_defined_anywhere();\nextern "C" int nereid_infer(void*, const void*, '
                      "size_t, void*, size_t, char*, size_t) { return not_defined_anywhere(); }\n")
    sp.run([CXX, "-shared", "-fPIC", str(source), "-o", str(tmp_path / "libundefined.so")], check=True)
    (tmp_path / "scratch").mkdir()
    with pytest.raises(ConfigError, match=r"undefined symbol: _Z20not_defined_anywherev \(not_defined_anywhere\(\)\)"):
        NativeLibrary("undefined", tmp_path / "libundefined.so", tmp_path / "scratch")


def test_check_names_a_cxx_library_s_copy_folder_as_the_server_does(repo, libs, capsys):
    """Found by a README check: nereid check named the scratch root, not <scratch>/NAME as serve does."""
    scale_model(repo, "undefined")
    config = repo.write_config(entry("undefined", f'{{library: "{libs["undefined"]}"}}'))
    assert nereid_main(["check", "--config", str(config)]) == 1
    assert re.search(r"\(dlopened from its copy in \S+check-\S+/undefined\): ", capsys.readouterr().out)


def test_a_dependency_beside_the_library_that_is_no_file_or_is_cut_short_is_refused_not_waited_on(tmp_path):
    """From the native hunt: a FIFO where the library's dependency should be held the load for ever (the scan of
    what it needs opened it, as the loader would); a dependency cut short ended the server (SIGBUS)."""
    from nereid.backends.cxx.library import NativeLibrary

    lib = tmp_path / "lib"
    lib.mkdir()
    (tmp_path / "helper.cpp").write_text('#include <cstdint>\nextern "C" int64_t helper_value() { return 5; }\n')
    (lib / "model.cpp").write_text(_DEPENDENT_MODEL)
    subprocess.run([CXX, "-shared", "-fPIC", "-o", str(lib / "libhelper.so"), str(tmp_path / "helper.cpp")],
                   check=True, capture_output=True, timeout=120)
    subprocess.run([CXX, "-shared", "-fPIC", "-std=c++17", f"-I{header_dir()}", "-o", str(lib / "libmodel.so"),
                    str(lib / "model.cpp"), f"-L{lib}", "-lhelper", "-Wl,-rpath,$ORIGIN"],
                   check=True, capture_output=True, timeout=120)
    whole = (lib / "libhelper.so").read_bytes()
    (tmp_path / "scratch").mkdir()
    (lib / "libhelper.so").write_bytes(whole[:len(whole) // 2])
    with pytest.raises(ConfigError, match=r"^model 'm': shared library .*libmodel.so needs libhelper.so, but "
                                          r".*libhelper.so cannot be loaded: it is \d+ bytes, and its ELF headers say"):
        NativeLibrary("m", lib / "libmodel.so", tmp_path / "scratch")
    (lib / "libhelper.so").unlink()
    os.mkfifo(lib / "libhelper.so")
    with pytest.raises(ConfigError, match=r"^model 'm': shared library .*libmodel.so needs libhelper.so, and "
                                          r".*libhelper.so: is a FIFO, not a regular file$"):
        NativeLibrary("m", lib / "libmodel.so", tmp_path / "scratch")
    assert list((tmp_path / "scratch").iterdir()) == []  # no copy left behind


def test_a_library_whose_name_is_near_the_file_systems_limit_loads(tmp_path, libs):
    """From the native hunt: a 251-byte file name (legal; the compiler makes it) left no room for the private
    copy's folder suffix, and the load failed blaming TMPDIR ("File name too long")."""
    from nereid.backends.cxx.library import NativeLibrary

    long = tmp_path / f"lib{'a' * 245}.so"
    shutil.copy(libs["multi"], long)
    (tmp_path / "scratch").mkdir()
    library = NativeLibrary("m", long, tmp_path / "scratch")
    try:
        assert library.infer is not None
    finally:
        library.close()


def test_a_library_in_a_scratch_folder_whose_path_is_not_utf_8_loads(tmp_path, libs):
    """Defect (the deploy hunt): a TMPDIR holding a latin-1 byte (\\xe9, under LANG=C) made every cxx model
    UNAVAILABLE with a UnicodeEncodeError: the copy's path was encoded as UTF-8 for dlopen, not as the file system
    names it."""
    from nereid.backends.cxx.library import NativeLibrary

    scratch = tmp_path / os.fsdecode(b"scratch-\xe9")
    scratch.mkdir()
    library = NativeLibrary("m", libs["multi"], scratch)
    try:
        assert library.infer is not None
    finally:
        library.close()


OPENMP_LIBRARY = r'''
#include <omp.h>
#include "nereid_cxx.h"
extern "C" int nereid_load(const char*, const char*, void**, char*, size_t) {
    int threads = 0;
    #pragma omp parallel
    {
        #pragma omp atomic
        threads += 1;
    }
    return threads > 0 ? 0 : 1;
}
extern "C" int nereid_infer(void*, const nereid_tensor*, size_t, nereid_tensor*, size_t, char*, size_t) {
    return 0;
}
'''

MAPPED_AFTER_CLOSE = '''
import ctypes, sys
from pathlib import Path
from nereid.backends.cxx.library import NativeLibrary

library = NativeLibrary("omp", Path(sys.argv[1]), Path(sys.argv[2]))
assert library.load(b"omp", b".", ctypes.byref(ctypes.c_void_p()), ctypes.create_string_buffer(64), 63) == 0
library.close()
print("libgomp" in Path("/proc/self/maps").read_text())
'''


def test_the_system_libraries_a_model_needs_stay_loaded_after_its_unload(tmp_path) -> None:
    """Found by the native-models hunt: a library built with -fopenmp, unloaded, took libgomp with it (nothing else
    held it), while libgomp's pool threads still ran its code: the server died with SIGSEGV at an unload under
    traffic, and nereid check at every run whose model ran a parallel region in nereid_load. The system libraries
    a model pulls in are kept for the server's life; its own copy still goes (run in a process of its own: the
    tests' process may hold libgomp already)."""
    source = tmp_path / "omp.cpp"
    source.write_text(OPENMP_LIBRARY)
    built = subprocess.run([CXX, "-O1", "-shared", "-fPIC", "-fopenmp", f"-I{header_dir()}", "-std=c++17", "-o",
                            str(tmp_path / "libomp_model.so"), str(source)], capture_output=True, text=True)
    if built.returncode != 0:
        pytest.skip(f"no OpenMP for this compiler: {built.stderr[-300:]}")
    (tmp_path / "scratch").mkdir()
    ran = subprocess.run([sys.executable, "-c", MAPPED_AFTER_CLOSE, str(tmp_path / "libomp_model.so"),
                          str(tmp_path / "scratch")], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0 and ran.stdout.strip() == "True", (ran.returncode, ran.stdout, ran.stderr[-2000:])
    assert list((tmp_path / "scratch").iterdir()) == []  # (the model's own copy went)


MAPPED_NAMES_AFTER_CLOSE = '''
import ctypes, sys
from pathlib import Path
from nereid.backends.cxx.library import NativeLibrary

library = NativeLibrary("m", Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
if library.load is not None:
    assert library.load(b"m", b".", ctypes.byref(ctypes.c_void_p()), ctypes.create_string_buffer(64), 63) == 0
library.close()
maps = Path("/proc/self/maps").read_text()
print(" ".join(name for name in sys.argv[4:] if name in maps) or "-")
'''


def _mapped_after_close(library: Path, scratch: Path, model_folder: Path, *names: str) -> list[str]:
    scratch.mkdir(exist_ok=True)
    ran = subprocess.run([sys.executable, "-c", MAPPED_NAMES_AFTER_CLOSE, str(library), str(scratch),
                          str(model_folder), *names], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, (ran.returncode, ran.stdout, ran.stderr[-2000:])
    return [name for name in ran.stdout.split() if name != "-"]


def test_an_openmp_runtime_shipped_beside_the_library_stays_loaded_and_the_model_s_other_libraries_go(tmp_path):
    """The review hunt of 99c6f43: a libgomp shipped beside the model's library (as wheels vendor it) was unloaded
    with it, still crashing the server; and a library of the model's own folder that is not beside it (found
    through an absolute RUNPATH) was kept for the server's life, so a rebuilt one was never read again."""
    gomp = Path(ctypes.util.find_library("gomp") or "")
    system_gomp = next((Path(p) for p in ("/usr/lib/x86_64-linux-gnu/libgomp.so.1", "/usr/lib64/libgomp.so.1",
                                           "/usr/lib/aarch64-linux-gnu/libgomp.so.1") if Path(p).is_file()), None)
    if system_gomp is None or not gomp.name:
        pytest.skip("no libgomp.so.1 to ship")
    shipped = tmp_path / "omp_model" / "build"
    shipped.mkdir(parents=True)
    source = tmp_path / "omp.cpp"
    source.write_text(OPENMP_LIBRARY)
    built = subprocess.run([CXX, "-O1", "-shared", "-fPIC", "-fopenmp", f"-I{header_dir()}", "-std=c++17",
                            "-Wl,-rpath,$ORIGIN", "-o", str(shipped / "libomp_model.so"), str(source)],
                           capture_output=True, text=True)
    if built.returncode != 0:
        pytest.skip(f"no OpenMP for this compiler: {built.stderr[-300:]}")
    shutil.copy(system_gomp, shipped / "libgomp.so.1")
    kept = _mapped_after_close(shipped / "libomp_model.so", tmp_path / "scratch", tmp_path / "omp_model",
                               "libgomp.so.1")
    assert kept == ["libgomp.so.1"]

    model = tmp_path / "dep_model"
    (model / "lib").mkdir(parents=True)
    (model / "build").mkdir()
    (tmp_path / "dep.cpp").write_text('extern "C" int nereid_dep_value_xyz() { return 7; }\n')
    (tmp_path / "uses.cpp").write_text('#include "nereid_cxx.h"\nextern "C" int nereid_dep_value_xyz();\n'
                                       'extern "C" int nereid_infer(void*, const nereid_tensor*, size_t, '
                                       'nereid_tensor*, size_t, char*, size_t) {\n'
                                       '    return nereid_dep_value_xyz() - 7;\n}\n')
    for argv in ([CXX, "-shared", "-fPIC", "-o", str(model / "lib" / "libnereiddepxyz.so"), str(tmp_path / "dep.cpp")],
                 [CXX, "-shared", "-fPIC", f"-I{header_dir()}", f"-L{model / 'lib'}", f"-Wl,-rpath,{model / 'lib'}",
                  "-o", str(model / "build" / "libuses.so"), str(tmp_path / "uses.cpp"), "-lnereiddepxyz"]):
        assert subprocess.run(argv, capture_output=True).returncode == 0, argv
    assert _mapped_after_close(model / "build" / "libuses.so", tmp_path / "scratch2", model,
                               "libnereiddepxyz.so") == []


def test_an_openmp_runtime_a_library_in_a_subfolder_of_the_model_needs_stays_loaded(tmp_path) -> None:
    """Found by the cxx read hunt: a model's library under RUNPATH $ORIGIN/lib whose lib/libkern.so was built with
    -fopenmp (an SDK's layout): libgomp, needed by neither the model's library nor one beside it, was unloaded
    with the model while its pool's threads ran its code, and the server died with SIGSEGV."""
    model = tmp_path / "sub_model"
    (model / "lib").mkdir(parents=True)
    (tmp_path / "kern.cpp").write_text(
        'extern "C" int nereid_kern_threads_xyz() {\n    int threads = 0;\n    #pragma omp parallel\n    {\n'
        '        #pragma omp atomic\n        threads += 1;\n    }\n    return threads;\n}\n')
    (tmp_path / "model.cpp").write_text(
        '#include "nereid_cxx.h"\nextern "C" int nereid_kern_threads_xyz();\n'
        'extern "C" int nereid_load(const char*, const char*, void**, char*, size_t) {\n'
        '    return nereid_kern_threads_xyz() > 0 ? 0 : 1;\n}\n'
        'extern "C" int nereid_infer(void*, const nereid_tensor*, size_t, nereid_tensor*, size_t, char*, size_t) '
        '{\n    return 0;\n}\n')
    kern = subprocess.run([CXX, "-O1", "-shared", "-fPIC", "-fopenmp", "-o", str(model / "lib" / "libkernxyz.so"),
                           str(tmp_path / "kern.cpp")], capture_output=True, text=True)
    if kern.returncode != 0:
        pytest.skip(f"no OpenMP for this compiler: {kern.stderr[-300:]}")
    built = subprocess.run([CXX, "-O1", "-shared", "-fPIC", f"-I{header_dir()}", f"-L{model / 'lib'}",
                            "-Wl,-rpath,$ORIGIN/lib", "-o", str(model / "libmodel.so"), str(tmp_path / "model.cpp"),
                            "-lkernxyz"], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    # (The model's own library in its subfolder unloads with it: only the system's libgomp stays.)
    assert _mapped_after_close(model / "libmodel.so", tmp_path / "scratch", model,
                               "libgomp", "libkernxyz.so") == ["libgomp"]


TWO_MODELS_LOADED = '''
import logging, sys
from pathlib import Path
from nereid.backends.cxx.library import NativeLibrary

logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
root, case = Path(sys.argv[1]), sys.argv[2]
for name in ("a", "b"):
    (root / "scratch" / name).mkdir(parents=True)  # (a folder of its own per model, as the server gives)

def load(model, folder):
    return NativeLibrary(model, root / folder / "libuses.so", root / "scratch" / model, root / folder)

first = load("a", "a")
second = load("b", "b")
if case == "removed":  # a's copy, held by b, stays mapped once a's folder is gone; a's next version ships another
    first.close()
    first = load("a", "a2")
second.close()
first.close()
'''


@pytest.mark.parametrize("case", ["the same", "another", "removed"])
def test_a_dependency_of_a_name_another_model_loaded_first_is_named_when_it_differs(tmp_path, case):
    """Carried from stop 48: the loader shares a library by its name, so a model shipping a rebuilt libdep.so
    beside one loaded for another model (or for its own version still serving, in a reload) ran the old one, and
    nothing said so: a WARNING now, when the two differ, also when the copy given sits in a folder since removed
    (the review hunt of 2b5283b: it said nothing then, nor for models with scratch folders of their own)."""
    (tmp_path / "uses.cpp").write_text('#include "nereid_cxx.h"\nextern "C" int nereid_dep_value_xyz();\n'
                                       'extern "C" int nereid_infer(void*, const nereid_tensor*, size_t, '
                                       'nereid_tensor*, size_t, char*, size_t) {\n'
                                       '    return nereid_dep_value_xyz() - 1;\n}\n')
    for model, value in (("a", 1), ("b", 2), ("a2", 3)):
        folder = tmp_path / model
        folder.mkdir()
        (tmp_path / f"dep{model}.cpp").write_text(f'extern "C" int nereid_dep_value_xyz() {{ return {value}; }}\n')
        for argv in ([CXX, "-shared", "-fPIC", "-Wl,-soname,libnereidsharedxyz.so", "-o",
                      str(folder / "libnereidsharedxyz.so"), str(tmp_path / f"dep{model}.cpp")],
                     [CXX, "-shared", "-fPIC", f"-I{header_dir()}", f"-L{folder}", "-Wl,-rpath,$ORIGIN", "-o",
                      str(folder / "libuses.so"), str(tmp_path / "uses.cpp"), "-lnereidsharedxyz"]):
            assert subprocess.run(argv, capture_output=True).returncode == 0, argv
    if case != "another":  # (the same file shipped by both: a reload of an unchanged model)
        shutil.copy(tmp_path / "a" / "libnereidsharedxyz.so", tmp_path / "b" / "libnereidsharedxyz.so")
    ran = subprocess.run([sys.executable, "-c", TWO_MODELS_LOADED, str(tmp_path), case.split()[-1]],
                         capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr[-2000:]
    warned = {"the same": [], "another": ["b"], "removed": ["a"]}[case]
    assert ran.stdout.splitlines() == [
        f"model '{model}': shared library {tmp_path / ('a2' if case == 'removed' else model) / 'libuses.so'} ships "
        "libnereidsharedxyz.so, but the loader gave it the one already loaded under that name (for another model, "
        "or a version of this one still loaded), which differs: the loader shares a library by its name, so the "
        "one it ships runs only once no loaded model holds one of that name (unload them, then load)"
        for model in warned]


TWO_MODELS_MAPPED_AFTER_CLOSE = '''
import sys
from pathlib import Path
from nereid.backends.cxx.library import NativeLibrary

first = NativeLibrary("a", Path(sys.argv[1]), Path(sys.argv[3]), Path(sys.argv[1]).parent)
second = NativeLibrary("b", Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[2]).parent)
first.close()
second.close()
print(sys.argv[4] in Path("/proc/self/maps").read_text())
'''


def test_a_dependency_two_models_ship_under_one_name_unloads_with_them(tmp_path) -> None:
    """The review hunt of 47003a0: the second model's look-up of its shipped libdep.so found the first model's copy,
    outside its own folders, and kept it for the server's life: a rebuilt one was never read again."""
    (tmp_path / "dep.cpp").write_text('extern "C" int nereid_dep_value_abc() { return 1; }\n')
    (tmp_path / "uses.cpp").write_text('#include "nereid_cxx.h"\nextern "C" int nereid_dep_value_abc();\n'
                                       'extern "C" int nereid_infer(void*, const nereid_tensor*, size_t, '
                                       'nereid_tensor*, size_t, char*, size_t) {\n'
                                       '    return nereid_dep_value_abc() - 1;\n}\n')
    for model in ("a", "b"):
        folder = tmp_path / model
        folder.mkdir()
        for argv in ([CXX, "-shared", "-fPIC", "-Wl,-soname,libnereidsharedabc.so", "-o",
                      str(folder / "libnereidsharedabc.so"), str(tmp_path / "dep.cpp")],
                     [CXX, "-shared", "-fPIC", f"-I{header_dir()}", f"-L{folder}", "-Wl,-rpath,$ORIGIN", "-o",
                      str(folder / "libuses.so"), str(tmp_path / "uses.cpp"), "-lnereidsharedabc"]):
            assert subprocess.run(argv, capture_output=True).returncode == 0, argv
    (tmp_path / "scratch").mkdir()
    ran = subprocess.run([sys.executable, "-c", TWO_MODELS_MAPPED_AFTER_CLOSE, str(tmp_path / "a" / "libuses.so"),
                          str(tmp_path / "b" / "libuses.so"), str(tmp_path / "scratch"), "libnereidsharedabc.so"],
                         capture_output=True, text=True, timeout=60)
    assert (ran.returncode, ran.stdout.strip()) == (0, "False"), (ran.stdout, ran.stderr[-2000:])
