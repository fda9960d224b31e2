"""backends/cpp/compiler.py with the real c++: build_binary's cache and its keys, damaged and edited builds, the
compile slots, and the compiler CXX names."""

from __future__ import annotations

import errno
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from nereid.backends.cpp import compiler
from nereid.errors import ConfigError
from nereid.backends.cpp.compiler import source_hash

EXAMPLES = Path(__file__).resolve().parents[3] / "ml-backends"

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler")


def test_every_header_an_include_can_reach_is_in_the_key_and_the_cache_is_not(tmp_path):
    """Headers in subfolders and with any header suffix change the key; the cache folder and data files do not."""
    (tmp_path / "main.cpp").write_text('#include "include/factor.h"\n#include "more.hxx"\nint main() {}\n')
    # Defect: an X-macro table (.def) or a CUDA header (.cuh) edited left the old binary serving.
    for name in ("include/factor.h", "more.hxx", "detail/impl.inl", "table.def", "kernels.cuh", ".cache/main-old",
                 "weights.bin"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("1\n")
    key = source_hash(tmp_path, ("c++",), "m")
    for name in ("include/factor.h", "more.hxx", "detail/impl.inl", "table.def", "kernels.cuh"):
        (tmp_path / name).write_text("2\n")
        assert source_hash(tmp_path, ("c++",), "m") != key, name
        key = source_hash(tmp_path, ("c++",), "m")
    for name in (".cache/main-old", "weights.bin"):
        (tmp_path / name).write_text("2\n")
    assert source_hash(tmp_path, ("c++",), "m") == key


def test_a_long_compile_error_keeps_its_first_error_and_says_what_was_left_out(tmp_path):
    """Defect: only the last 4000 characters were kept, so a first error followed by a cascade (an undefined name,
    then template errors) lost the one that mattered, and nothing said the message was cut."""
    source = tmp_path / "main.cpp"
    source.write_text("int first = undefined_symbol_FIRST;\n" +
                      "".join(f"int later_{i} = undefined_symbol_number_{i};\n" for i in range(400)))
    (tmp_path / "scratch").mkdir()
    with pytest.raises(ConfigError) as failed:
        compiler.build_binary(tmp_path, "main.cpp", tmp_path / "scratch", "cascade")
    message = str(failed.value)
    assert "undefined_symbol_FIRST" in message and "undefined_symbol_number_399" in message
    assert re.search(r"\n\.\.\. \(\d+ bytes left out\) \.\.\.\n", message), message
    assert len(message) < compiler.MESSAGE_TAIL_CHARS + 500


def test_a_full_disk_while_publishing_the_build_leaves_no_partial_and_serves_from_scratch(tmp_path, monkeypatch,
                                                                                          caplog, cache_files):
    folder = tmp_path / "model"
    shutil.copytree(EXAMPLES / "cpp_scale", folder, ignore=shutil.ignore_patterns(".cache"))
    scratch = tmp_path / "scratch"
    scratch.mkdir()

    def copy_until_the_disk_is_full(source, target, **_):
        Path(target).write_bytes(b"\x7fELF half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))

    monkeypatch.setattr(compiler.shutil, "copy2", copy_until_the_disk_is_full)
    built = compiler.build_binary(folder, "main.cpp", scratch, "full")
    assert built.parent == scratch / compiler.SCRATCH_CACHE_DIR and os.access(built, os.X_OK)
    assert cache_files(folder) == []  # the half-written copy is gone
    [warning] = [r for r in caplog.records if r.levelname == "WARNING"]
    assert "model 'full'" in warning.getMessage() and os.strerror(errno.ENOSPC) in warning.getMessage()
    monkeypatch.undo()
    assert compiler.build_binary(folder, "main.cpp", scratch, "full") == built  # reused in this server


def test_a_build_is_keyed_by_the_compiler_that_runs_not_only_its_name(tmp_path, monkeypatch):
    """Defect: the key held the compiler's path alone, so a compiler repointed under the same name (update-
    alternatives, a newer image, a shipped .cache) reused binaries it did not build."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for version in ("1", "2"):
        wrapper = bin_dir / f"cxx-{version}"
        wrapper.write_text(f'#!/bin/sh\n[ "$1" = --version ] && echo "c++ (wrapped) {version}" && exit 0\n'
                           'exec c++ "$@"\n')
        wrapper.chmod(0o755)
    link = bin_dir / "c++"
    folder = tmp_path / "model"
    shutil.copytree(EXAMPLES / "cpp_scale", folder, ignore=shutil.ignore_patterns(".cache"))
    keys = []
    for version in ("1", "2", "1"):
        link.unlink(missing_ok=True)
        link.symlink_to(bin_dir / f"cxx-{version}")
        keys.append(source_hash(folder, (str(link),), "m"))
    assert keys[0] != keys[1] and keys[0] == keys[2]


@pytest.mark.parametrize("damage", ["cut short", "not a program"])
def test_a_damaged_build_in_the_cache_is_built_again(tmp_path, damage):
    """Found by a bug hunt: a cached build was used if it was an executable file, so one a deploy's copy cut short
    (or any file under its name) turned the model READY, and every run failed "Exec format error"."""
    folder = tmp_path / "model"
    shutil.copytree(EXAMPLES / "cpp_scale", folder, ignore=shutil.ignore_patterns(".cache"))
    (tmp_path / "scratch").mkdir()
    built = compiler.build_binary(folder, "main.cpp", tmp_path / "scratch", "m")
    whole = built.read_bytes()
    built.write_bytes(whole[:len(whole) // 2] if damage == "cut short" else b"#garbage\n" * 100)
    assert compiler.build_binary(folder, "main.cpp", tmp_path / "scratch", "m") == built
    assert built.read_bytes()[:4] == b"\x7fELF" and len(built.read_bytes()) == len(whole)  # (a build is the same size)


def test_sources_edited_while_they_compile_are_built_but_not_cached(tmp_path, monkeypatch):
    """Defect: the key was taken before the compiler read the sources, so an edit saved during a build was cached
    under the old sources' key, and served by every later start that found those sources again."""
    folder = tmp_path / "model"
    shutil.copytree(EXAMPLES / "cpp_scale", folder, ignore=shutil.ignore_patterns(".cache"))
    editor = tmp_path / "cc-edits"  # a compiler during whose run the source is saved again
    editor.write_text(f'#!/bin/sh\n[ "$1" = --version ] || echo "// saved during the build" >> "{folder}/main.cpp"\n'
                      'exec c++ "$@"\n')
    editor.chmod(0o755)
    monkeypatch.setenv("CXX", str(editor))
    (tmp_path / "scratch").mkdir()
    built = compiler.build_binary(folder, "main.cpp", tmp_path / "scratch", "m")
    assert os.access(built, os.X_OK) and not built.is_relative_to(folder)  # served from the scratch folder
    assert not (folder / ".cache").exists() or list((folder / ".cache").glob("main-*")) == []
    monkeypatch.setenv("CXX", "c++")
    cached = compiler.build_binary(folder, "main.cpp", tmp_path / "scratch", "m")  # the sources as they are now
    assert cached.parent == folder / ".cache"


def test_compilers_run_at_most_one_per_slot(tmp_path, monkeypatch):
    """Defect: every load compiled at once (six compilers on two cores), so a repository of many template-heavy
    models could run the machine out of memory. Here with one slot: the builds never overlap."""
    import threading

    log = tmp_path / "compiles.log"
    slow = tmp_path / "cc-slow"
    slow.write_text(f'#!/bin/sh\n[ "$1" = --version ] && exec c++ --version\necho start >> "{log}"\n'
                    f'sleep 0.3\necho end >> "{log}"\nexec c++ "$@"\n')
    slow.chmod(0o755)
    monkeypatch.setenv("CXX", str(slow))
    monkeypatch.setattr(compiler, "_COMPILE_SLOTS", threading.BoundedSemaphore(1))
    folders = []
    for index in range(3):
        folder = tmp_path / f"model{index}"
        shutil.copytree(EXAMPLES / "cpp_scale", folder, ignore=shutil.ignore_patterns(".cache"))
        (folder / "scratch").mkdir()
        folders.append(folder)
    builds = [threading.Thread(target=compiler.build_binary, args=(folder, "main.cpp", folder / "scratch", "m"))
              for folder in folders]
    for build in builds:
        build.start()
    for build in builds:
        build.join(60)
    assert log.read_text().split() == ["start", "end"] * 3
    assert all(list((folder / ".cache").glob("main-*")) for folder in folders)


def test_an_abandoned_load_stops_its_compile_and_frees_its_slot(tmp_path, monkeypatch):
    """Found by the native hunt: a load abandoned by an unload (its compile hung on a FIFO it includes) left its
    compiler running for up to 600 s, holding one of the compile slots: every other model's build waited."""
    import threading
    import time

    from nereid.errors import ConfigError

    hanging = tmp_path / "cc-hangs"  # hangs compiling a folder holding "hang"
    hanging.write_text('#!/bin/sh\n[ "$1" = --version ] && exec c++ --version\n[ -e hang ] && sleep 60\n'
                       'exec c++ "$@"\n')
    hanging.chmod(0o755)
    monkeypatch.setenv("CXX", str(hanging))
    monkeypatch.setattr(compiler, "_COMPILE_SLOTS", threading.BoundedSemaphore(1))
    folders = {}
    for name in ("stuck", "next"):
        folder = folders[name] = tmp_path / name
        shutil.copytree(EXAMPLES / "cpp_scale", folder, ignore=shutil.ignore_patterns(".cache"))
        (folder / "scratch").mkdir()
    (folders["stuck"] / "hang").write_text("")
    abandoned = threading.Event()
    outcome: dict[str, BaseException | Path] = {}

    def build(name: str, event: threading.Event | None) -> None:
        try:
            outcome[name] = compiler.build_binary(folders[name], "main.cpp", folders[name] / "scratch", name, event)
        except BaseException as err:  # noqa: BLE001 - the test looks at it
            outcome[name] = err

    stuck = threading.Thread(target=build, args=("stuck", abandoned))
    stuck.start()
    time.sleep(0.5)  # (its compiler started, the slot taken)
    waiting = threading.Thread(target=build, args=("next", None))
    waiting.start()
    time.sleep(0.3)
    assert "next" not in outcome  # (behind the slot)
    started = time.monotonic()
    abandoned.set()
    stuck.join(10)
    waiting.join(60)
    assert isinstance(outcome["stuck"], ConfigError) and "its load was abandoned" in str(outcome["stuck"])
    assert isinstance(outcome["next"], Path) and time.monotonic() - started < 30, outcome


def test_a_compile_waiting_for_its_slot_when_the_server_stops_never_starts(tmp_path, monkeypatch):
    """Defect: a load waiting for a compile slot took it once the stop had killed every child, and its compiler
    ran on under init, with no time limit, writing into a scratch folder being removed."""
    import threading

    from nereid import processes

    monkeypatch.setattr(compiler, "_COMPILE_SLOTS", threading.BoundedSemaphore(1))
    monkeypatch.setattr(processes, "_NO_NEW_CHILDREN", threading.Event())  # (this process goes on: a fresh one)
    log = tmp_path / "compiles.log"
    logging_cc = tmp_path / "cc-logs"
    logging_cc.write_text(f'#!/bin/sh\n[ "$1" = --version ] && exec c++ --version\necho ran >> "{log}"\n'
                          'exec c++ "$@"\n')
    logging_cc.chmod(0o755)
    monkeypatch.setenv("CXX", str(logging_cc))
    folder = tmp_path / "model"
    shutil.copytree(EXAMPLES / "cpp_scale", folder, ignore=shutil.ignore_patterns(".cache"))
    (tmp_path / "scratch").mkdir()
    outcome: list[BaseException] = []

    def load() -> None:
        try:
            compiler.build_binary(folder, "main.cpp", tmp_path / "scratch", "m")
        except BaseException as err:  # noqa: BLE001 - kept for the test
            outcome.append(err)
    with compiler._COMPILE_SLOTS:  # another build holds the one slot
        waiting = threading.Thread(target=load)
        waiting.start()
        time.sleep(0.3)
        processes.stop_new_children()  # what serve does before it kills its children
    waiting.join(30)
    assert [str(err) for err in outcome] == [f"{folder / 'main.cpp'}: not compiled: the server is stopping"]
    assert not log.exists()  # no compiler ever started


def test_a_compiler_upgraded_behind_a_launcher_is_asked_its_version_again(tmp_path):
    """Defect: the version was cached by the first word's file alone: with CXX="ccache g++", a g++ upgraded behind
    ccache kept its old version in every build key until a restart."""
    launcher = tmp_path / "launcher"
    launcher.write_text('#!/bin/sh\nexec "$@"\n')
    launcher.chmod(0o755)
    for version in ("11", "14"):
        program = tmp_path / f"gxx-{version}"
        program.write_text(f'#!/bin/sh\necho "gxx {version}.0"\n')
        program.chmod(0o755)
    linked = tmp_path / "gxx"
    linked.symlink_to(tmp_path / "gxx-11")
    command = (str(launcher), str(linked))
    assert compiler.compiler_version(command) == "gxx 11.0"
    first = compiler.compiler_key(command)
    linked.unlink()
    linked.symlink_to(tmp_path / "gxx-14")
    assert compiler.compiler_version(command) == "gxx 14.0"
    assert compiler.compiler_key(command) != first


def test_the_compiler_s_include_path_variables_are_part_of_its_key(monkeypatch):
    """Found by the cxx read hunt: CPATH (or CPLUS_INCLUDE_PATH) naming other headers built the same sources, and
    the build kept under the old name was served with the old headers."""
    command = ("c++",)
    for name in compiler.COMPILER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    plain = compiler.compiler_key(command)
    monkeypatch.setenv("CPATH", "/opt/dep-v1/include")
    v1 = compiler.compiler_key(command)
    monkeypatch.setenv("CPATH", "/opt/dep-v2/include")
    assert len({plain, v1, compiler.compiler_key(command)}) == 3
    monkeypatch.setenv("CPATH", "")  # (empty: as unset)
    assert compiler.compiler_key(command) == plain


def test_a_build_whose_sources_cannot_be_read_again_after_it_is_not_kept(tmp_path):
    # A source deleted during the compile: asking the name again raises, and the build must not stay where a
    # later load with the same sources would take it unchecked.
    folder = tmp_path / "model"
    shutil.copytree(EXAMPLES / "cpp_scale", folder, ignore=shutil.ignore_patterns(".cache"))
    scratch = tmp_path / "scratch"
    scratch.mkdir()

    def source_gone() -> str:
        raise ConfigError("model 'm': main.cpp: gone")
    with pytest.raises(ConfigError, match="gone"):
        compiler.cached_build(compiler.find_compiler(), [*compiler.CXX_FLAGS, "main.cpp"], "main-x", "main-*",
                              model="m", folder=folder, scratch=scratch, what="main.cpp", sources=("main.cpp",),
                              keyed=(), executable=True,
                              name_now=source_gone)
    assert not (scratch / compiler.SCRATCH_CACHE_DIR / "main-x").exists()


def test_builds_of_sources_edited_while_they_compiled_do_not_pile_up(tmp_path):
    """Found by the native hunt: each build served once, its sources edited while they compiled, stayed in the
    scratch folder (.edited-main-...) for the server's life. The next build of the model removes them."""
    folder = tmp_path / "model"
    shutil.copytree(EXAMPLES / "cpp_scale", folder, ignore=shutil.ignore_patterns(".cache"))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    names = iter(["main-edited-1", "main-edited-2", "main-3"])

    def build(name: str) -> Path:
        return compiler.cached_build(compiler.find_compiler(), [*compiler.CXX_FLAGS, "main.cpp"], name, "main-*",
                                     model="m", folder=folder, scratch=scratch, what="main.cpp",
                                     sources=("main.cpp",), keyed=(), executable=True,
                                     name_now=lambda: next(names))
    first = build("main-x")  # edited meanwhile: served once, not cached
    assert first.name.startswith(".edited-main-x.")
    second = build("main-y")
    assert second.name.startswith(".edited-main-y.") and not first.exists()
    build("main-3")  # (its sources as named: cached)
    assert not second.exists() and list((scratch / compiler.SCRATCH_CACHE_DIR).iterdir()) == []


def test_cxx_may_hold_a_wrapper_and_its_words_as_make_takes_it(tmp_path, monkeypatch):
    """Defect: CXX="ccache g++" was looked up as one program named 'ccache g++' (no compiler on PATH)."""
    log = tmp_path / "wrapper.log"
    wrapper = tmp_path / "bin" / "cc-wrap"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\necho "$1" >> "{log}"\nexec "$@"\n')  # as ccache does: runs its arguments
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{wrapper.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CXX", "cc-wrap 'c++'")
    assert compiler.find_compiler() == (str(wrapper), "c++")
    folder = tmp_path / "model"
    shutil.copytree(EXAMPLES / "cpp_scale", folder, ignore=shutil.ignore_patterns(".cache"))
    (tmp_path / "scratch").mkdir()
    built = compiler.build_binary(folder, "main.cpp", tmp_path / "scratch", "wrapped")
    assert os.access(built, os.X_OK) and log.read_text().splitlines()[-1] == "c++"  # (after its --version)
    monkeypatch.setenv("CXX", " ")  # blank: the default, as CMake takes it (it was a compiler named '')
    assert compiler.find_compiler() == (shutil.which("c++"),)
    monkeypatch.setenv("CXX", "cc-wrap 'c++")
    with pytest.raises(ConfigError, match="CXX=\"cc-wrap 'c\\+\\+\" cannot be split into words"):
        compiler.find_compiler()
    # A path is not looked up on PATH, and the message says so.
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler" / "c++"))
    with pytest.raises(ConfigError, match=f"no C\\+\\+ compiler: '{tmp_path}/no-such-compiler/c\\+\\+' is not an "
                                          "executable file \\(set CXX or install g\\+\\+\\)$"):
        compiler.find_compiler()
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    with pytest.raises(ConfigError, match="'no-such-compiler-xyz' is not on PATH"):
        compiler.find_compiler()
    # Found: a relative path (a wrapper beside where the server starts) is the working directory's, whatever the
    # folder a build runs in (from the native hunt: every build failed, FileNotFoundError: './cc-wrap').
    monkeypatch.chdir(wrapper.parent)
    monkeypatch.setenv("CXX", "./cc-wrap c++")
    assert compiler.find_compiler() == (str(wrapper), "c++")
    assert os.access(compiler.build_binary(folder, "main.cpp", tmp_path / "scratch", "relative"), os.X_OK)


@pytest.mark.parametrize("umask", [0o177, 0o777])
def test_a_build_made_under_a_umask_taking_the_owner_s_execute_bit_still_runs(tmp_path, umask):
    """Defect (the deploy hunt): root under umask 0177 or 0777 (which nereid refuses only for another user) built a
    binary no one may run: cpp_scale was READY and failed every request with "Permission denied"."""
    import subprocess
    import sys

    folder = tmp_path / "model"
    shutil.copytree(EXAMPLES / "cpp_scale", folder, ignore=shutil.ignore_patterns(".cache"))
    (tmp_path / "scratch").mkdir()
    # (In a process of its own: the umask is the whole process's, this test's other threads' too.)
    script = (f"import os; os.umask({umask:#o})\n"
              "from pathlib import Path\nfrom nereid.backends.cpp import compiler\n"
              f"binary = compiler.build_binary(Path({str(folder)!r}), 'main.cpp', Path({str(tmp_path / 'scratch')!r}), "
              "'scale')\n"
              "print(oct(os.stat(binary).st_mode & 0o777), os.access(binary, os.X_OK))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    mode, runnable = done.stdout.split()
    assert runnable == "True" and int(mode, 8) & 0o700 == 0o700, done.stdout
