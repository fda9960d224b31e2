"""backends/cxx/build.py: sources are built into a shared library cached in the model folder's .cache/, keyed by
every file the build reads."""

from __future__ import annotations

import ctypes
import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from nereid.backends.cxx.build import library_hash, shared_flags
from nereid.cli import main as nereid_main
from support import expect_grpc_error, nereid_serve, zero_text_section
from tests.backends.cxx.cxx_support import CXX, EXAMPLES, ROWS, entry, index_of, tensor

pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler")


def test_cxx_scale_example_builds_from_sources_once_and_serves(repo, serve):
    folder = repo.models_dir / "cxx_scale"
    shutil.copytree(EXAMPLES / "cxx_scale", folder)
    config = repo.write_config(entry("cxx_scale", '{sources: ["ml-backends/cxx_scale/scale.cpp"]}',
                                     "  instances: 2\n"))
    server = serve(config)
    batch = np.linspace(-3, 3, 16 * 8, dtype=np.float32).reshape(16, 8)
    assert server.client.infer("cxx_scale", [tensor("input", batch)]).as_numpy("output").tolist() == \
        (batch * 2).tolist()
    one = np.arange(8, dtype=np.float32)
    result = server.client.infer("cxx_scale", [tensor("input", one)]).as_numpy("output")
    assert result.shape == (8,) and result.tolist() == (one * 2).tolist()
    expect_grpc_error("INVALID_ARGUMENT",
                      lambda: server.client.infer("cxx_scale", [tensor("input", np.zeros((17, 8), np.float32))]),
                      "model 'cxx_scale'", "max_batch_size 16")
    [built] = (folder / ".cache").glob("lib-*.so")
    before = built.stat()
    # nereid check loads it through the same cache (no rebuild) and reports it
    assert nereid_main(["check", "--config", str(config)]) == 0
    after = built.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    # an edited source is rebuilt under a new name; the old library is removed
    source = folder / "scale.cpp"
    source.write_text(source.read_text().replace("* 2.0f", "* 4.0f"))
    server.client.load_model("cxx_scale")
    assert server.client.infer("cxx_scale", [tensor("input", ROWS)]).as_numpy("output").tolist() == \
        (ROWS * 4).tolist()
    [rebuilt] = (folder / ".cache").glob("lib-*.so")
    assert rebuilt.name != built.name and rebuilt.name.startswith("lib-")


def test_sources_in_an_unwritable_cache_build_in_the_scratch_folder_and_serve(repo, serve, caplog):
    """A read-only repository or a full disk (root ignores permission bits, so ``.cache`` is a file here)."""
    folder = repo.models_dir / "cxx_scale"
    shutil.copytree(EXAMPLES / "cxx_scale", folder, ignore=shutil.ignore_patterns(".cache"))
    (folder / ".cache").write_text("not a folder\n")
    caplog.set_level("WARNING")
    server = serve(repo.write_config(entry("cxx_scale", '{sources: ["$MODEL_FOLDER/scale.cpp"]}')))
    assert index_of(server)["cxx_scale"] == ("READY", "")
    assert server.client.infer("cxx_scale", [tensor("input", ROWS)]).as_numpy("output").tolist() == \
        (ROWS * 2).tolist()
    [warning] = [r.getMessage() for r in caplog.records if "build cache" in r.getMessage()]
    assert "model 'cxx_scale'" in warning and str(folder / ".cache") in warning
    assert "(it is a file, not a folder)" in warning, warning  # (it said "(File exists)")
    assert (folder / ".cache").read_text() == "not a folder\n"


def test_a_moved_read_only_repository_reuses_its_built_library(repo, serve, tmp_path):
    """The key holds the sources' paths relative to the model folder: a copy elsewhere finds its prebuilt library."""
    folder = repo.models_dir / "cxx_scale"
    shutil.copytree(EXAMPLES / "cxx_scale", folder)
    shutil.rmtree(folder / ".cache", ignore_errors=True)
    serve(repo.write_config(entry("cxx_scale", '{sources: ["ml-backends/cxx_scale/scale.cpp"]}')))
    [built] = (folder / ".cache").glob("lib-*.so")
    moved = tmp_path / "moved"
    shutil.copytree(repo.root, moved, symlinks=True)
    for path in sorted(moved.rglob("*"), reverse=True):
        path.chmod(path.stat().st_mode & ~0o222)  # as shipped read-only (root writes anyway: checked below)
    copy = moved / "ml-backends" / "cxx_scale" / ".cache" / built.name
    before = copy.stat()
    try:
        server = serve(moved / "nereid.yaml")
        assert server.client.infer("cxx_scale", [tensor("input", ROWS)]).as_numpy("output").tolist() == \
            (ROWS * 2).tolist()
        # Not rebuilt, nothing removed (its record, beside it, holds no file: every one it read is in its key).
        assert sorted(p.name for p in copy.parent.iterdir()) == [built.name, built.name + ".deps"]
        after = copy.stat()
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
        assert not list(server.server.scratch_dir.rglob("build-cache/*"))  # no scratch build either
    finally:
        for path in moved.rglob("*"):
            path.chmod(path.stat().st_mode | 0o200)


def test_the_library_key_covers_sources_by_their_place_in_the_model_folder(tmp_path):
    outside = tmp_path / "shared" / "common.cpp"
    outside.parent.mkdir()
    outside.write_text("int common() { return 1; }\n")
    keys = []
    for where in ("a", "b/deeper"):
        folder = tmp_path / where / "model"
        (folder / "include").mkdir(parents=True)
        (folder / "model.cpp").write_text('#include "include/k.h"\n')
        (folder / "include" / "k.h").write_text("constexpr int k = 1;\n")
        keys.append(library_hash((folder / "model.cpp",), (CXX,), folder, model="m"))
    assert keys[0] == keys[1]  # the same sources anywhere: the same library
    (folder / "include" / "k.h").write_text("constexpr int k = 2;\n")
    assert library_hash((folder / "model.cpp",), (CXX,), folder, model="m") != keys[0]  # headers below still count
    # A source outside the model folder keeps its absolute path in the key.
    model_a = tmp_path / "a" / "model"
    first = library_hash((model_a / "model.cpp", outside), (CXX,), model_a, model="m")
    elsewhere = tmp_path / "other" / "common.cpp"
    elsewhere.parent.mkdir()
    shutil.copy(outside, elsewhere)
    assert library_hash((model_a / "model.cpp", elsewhere), (CXX,), model_a, model="m") != first
    # Defect: a header elsewhere in the model folder (src/model.cpp including ../include/factor.h) was not in
    # the key, so its edit never rebuilt: a reload reported a new version and served the old code.
    nested = tmp_path / "nested"
    (nested / "src").mkdir(parents=True)
    (nested / "include").mkdir()
    (nested / "src" / "model.cpp").write_text('#include "../include/factor.h"\n')
    (nested / "include" / "factor.h").write_text("constexpr int factor = 3;\n")
    before = library_hash((nested / "src" / "model.cpp",), (CXX,), nested, model="m")
    (nested / "include" / "factor.h").write_text("constexpr int factor = 7;\n")
    assert library_hash((nested / "src" / "model.cpp",), (CXX,), nested, model="m") != before
    # Defect: a source the listed one includes (a unity build's impl.cc) was not in the key either.
    (nested / "src" / "model.cpp").write_text('#include "impl.cc"\n')
    (nested / "src" / "impl.cc").write_text("int value() { return 1; }\n")
    before = library_hash((nested / "src" / "model.cpp",), (CXX,), nested, model="m")
    (nested / "src" / "impl.cc").write_text("int value() { return 2; }\n")
    assert library_hash((nested / "src" / "model.cpp",), (CXX,), nested, model="m") != before


def test_the_library_key_of_a_model_folder_linked_in_from_outside_the_repository_covers_its_headers(tmp_path):
    """Found by a bug hunt: a model folder linked into the repository from elsewhere (follow_symlinks) was not
    walked, so with sources: ["$MODEL_FOLDER/model.cpp"] only model.cpp was in the key: an edit of factor.h
    (F=2 to F=5) served the old library after every reload and restart."""
    (tmp_path / "elsewhere" / "m").mkdir(parents=True)
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "m").symlink_to(tmp_path / "elsewhere" / "m")
    folder = tmp_path / "repo" / "m"
    (folder / "model.cpp").write_text('#include "factor.h"\n')
    (folder / "factor.h").write_text("constexpr float F = 2;\n")
    before = library_hash((folder / "model.cpp",), (CXX,), folder, model="m")
    (folder / "factor.h").write_text("constexpr float F = 5;\n")
    assert library_hash((folder / "model.cpp",), (CXX,), folder, model="m") != before


def test_the_library_key_covers_a_header_whose_name_is_not_utf_8(tmp_path):
    """Defect (the deploy hunt): a header named with a latin-1 byte beside the sources made the model UNAVAILABLE
    with a UnicodeEncodeError: its name went into the key as UTF-8, not as the file system names it."""
    (tmp_path / "model.cpp").write_text("int f() { return 1; }\n")
    header = tmp_path / os.fsdecode(b"caf\xe9.h")
    header.write_text("constexpr int k = 1;\n")
    before = library_hash((tmp_path / "model.cpp",), (CXX,), tmp_path, model="m")
    header.write_text("constexpr int k = 2;\n")
    assert library_hash((tmp_path / "model.cpp",), (CXX,), tmp_path, model="m") != before


def test_a_cached_library_whose_code_was_zeroed_is_built_again_never_dlopened(repo, tmp_path):
    """Found by a bug hunt of persistent caches: .cache/lib-<hash>.so with its code zeroed (a torn write, bit-rot)
    and its ELF headers whole passed the cache's one check; the server dlopened it and died of SIGSEGV, at that
    start and at every later one, every other model with it. Its record's sha256 no longer matches: a WARNING names
    it, and the library is built again before anything maps it. (The server runs as a process of its own: on the
    old code it is that process that dies.)"""
    from nereid.backends.cxx.build import build_library

    folder = repo.models_dir / "cxx_scale"
    shutil.copytree(EXAMPLES / "cxx_scale", folder, ignore=shutil.ignore_patterns(".cache"))
    config = repo.write_config(entry("cxx_scale", '{sources: ["$MODEL_FOLDER/scale.cpp"]}'))
    (tmp_path / "scratch").mkdir()
    built = build_library("cxx_scale", folder, (folder / "scale.cpp",), tmp_path / "scratch")  # (built, not loaded)
    stamp = built.stat()
    assert zero_text_section(built) > 0 and built.stat().st_size == stamp.st_size
    os.utime(built, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))  # (bit-rot, a torn write: its time as it was)
    with nereid_serve(config) as (process, client):
        assert client.infer("cxx_scale", [tensor("input", ROWS)]).as_numpy("output").tolist() == (ROWS * 2).tolist()
    lines = process.stdout.read().splitlines()
    [warning] = [i for i, line in enumerate(lines) if f"ignoring its cached build {built}: " in line]
    assert "WARNING" in lines[warning] and "model 'cxx_scale'" in lines[warning], lines[warning]
    assert "its content is not the one it was built with" in lines[warning], lines[warning]
    assert lines[warning].endswith("; building it again"), lines[warning]
    # Opened once, after it was built again (under the same name: the same sources).
    [opened] = [i for i, line in enumerate(lines) if "opening shared library" in line]
    assert opened > warning, lines


def test_an_edit_of_a_header_a_second_source_includes_from_outside_the_model_folder_rebuilds(tmp_path):
    """Found by a bug hunt: a header included from outside the model folder was compiled in but in no key, so
    its edit never rebuilt the library. With several sources the compiler's -MMD list holds only the last one's
    headers: each source is listed on its own, and the first one's outside header counts too."""
    import json

    from nereid.backends.cxx import build

    folder, shared = tmp_path / "repo" / "m", tmp_path / "shared"
    folder.mkdir(parents=True)
    shared.mkdir()
    (folder / "a.cpp").write_text('#include "../../shared/a.h"\nextern "C" int first() { return A; }\n')
    (folder / "b.cpp").write_text('#include "../../shared/b.h"\nextern "C" int second() { return B; }\n')
    (shared / "a.h").write_text("constexpr int A = 1;\n")
    (shared / "b.h").write_text("constexpr int B = 2;\n")
    sources = (folder / "a.cpp", folder / "b.cpp")

    def values(copy: str) -> tuple[int, int]:
        # (A copy under a name of its own, as the backend loads it: dlopen hands back a library of a known name.)
        library = tmp_path / copy
        shutil.copy(build.build_library("m", folder, sources, tmp_path / "scratch"), library)
        loaded = ctypes.CDLL(str(library))
        return loaded.first(), loaded.second()
    assert values("before.so") == (1, 2)
    [record] = (folder / ".cache").glob("lib-*.so.deps")
    assert [name for name, _ in json.loads(record.read_text())["outside_key"]] == [
        "../../shared/a.h", "../../shared/b.h"]  # (relative to the model folder, as a cpp build's)
    (shared / "a.h").write_text("constexpr int A = 5;\n")
    assert values("after.so") == (5, 2)


def _factor_model(root: Path, factor: int) -> Path:
    """``root/repo/m``, whose scale.cpp returns FACTOR from ``root/shared/factor.h`` (``../../shared/factor.h``)."""
    folder = root / "repo" / "m"
    folder.mkdir(parents=True)
    (root / "shared").mkdir()
    (folder / "scale.cpp").write_text('#include "../../shared/factor.h"\nextern "C" int factor() { return FACTOR; }\n')
    (root / "shared" / "factor.h").write_text(f"constexpr int FACTOR = {factor};\n")
    return folder


def _factor_of(folder: Path, scratch: Path, copy: Path) -> int:
    """The FACTOR of the library built (or reused) for ``folder``, through a copy named ``copy`` (dlopen hands back
    a library of a known name)."""
    from nereid.backends.cxx.build import build_library

    scratch.mkdir(exist_ok=True)
    shutil.copy(build_library("m", folder, (folder / "scale.cpp",), scratch), copy)
    return ctypes.CDLL(str(copy)).factor()


def test_a_copied_repository_checks_its_own_copy_of_a_header_included_from_outside_the_model_folder(tmp_path):
    """Found by an upgrade hunt: with sources: ["$MODEL_FOLDER/scale.cpp"] the compiler names an include by the
    absolute path it was built at (/build/path/repo/m/../../shared/factor.h), and the record kept that name, so a
    repository copied with its .cache/ (cp -a) checked the ORIGINAL's header: the copy's own header edited to
    FACTOR 5 served the library built with 3, with no word. The record names it relative to the model folder."""
    import json

    folder = _factor_model(tmp_path / "a", 3)
    assert _factor_of(folder, tmp_path / "scratch", tmp_path / "a.so") == 3
    shutil.copytree(tmp_path / "a", tmp_path / "b", symlinks=True)  # (its .cache/ along, times kept: as cp -a)
    (tmp_path / "b" / "shared" / "factor.h").write_text("constexpr int FACTOR = 5;\n")
    assert _factor_of(tmp_path / "b" / "repo" / "m", tmp_path / "scratch-b", tmp_path / "b.so") == 5
    assert _factor_of(folder, tmp_path / "scratch", tmp_path / "a-again.so") == 3  # (the original's own, still)
    for root in ("a", "b"):
        [record] = (tmp_path / root / "repo" / "m" / ".cache").glob("lib-*.so.deps")
        assert [name for name, _ in json.loads(record.read_text())["outside_key"]] == ["../../shared/factor.h"]


def test_a_repository_moved_from_where_it_was_built_reuses_a_library_including_a_header_outside_its_folder(
        tmp_path, caplog):
    """Found by an upgrade hunt: a repository built at one path and shipped elsewhere (read-only, the original
    path gone) compiled such a model again at every start: its record named the header at the build's path ("...
    which its build included, has changed; building it again"), then the read-only .cache/ kept no rebuild."""
    folder = _factor_model(tmp_path / "built-here", 3)
    assert _factor_of(folder, tmp_path / "scratch", tmp_path / "before.so") == 3
    (tmp_path / "built-here").rename(tmp_path / "shipped")
    moved = tmp_path / "shipped" / "repo" / "m"
    [library] = (moved / ".cache").glob("lib-*.so")
    before = library.stat()
    # (Only what the shipped repository's load logs: the first build's INFO lines are captured too wherever an earlier
    # test of the same worker left the nereid logger at INFO.)
    caplog.clear()
    with caplog.at_level("INFO", logger="nereid.backends.cpp.compiler"):
        assert _factor_of(moved, tmp_path / "scratch-shipped", tmp_path / "after.so") == 3
    after = library.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # reused, not built again
    assert not list((tmp_path / "scratch-shipped").rglob("lib-*")) and not caplog.messages, caplog.messages


def test_the_compiler_version_probe_runs_in_its_own_process_group(tmp_path):
    """Like a build: a server stopped during a slow probe kills the group, a compiler wrapper's children too."""
    record = tmp_path / "probe"
    compiler = tmp_path / "wrapped-c++"
    compiler.write_text(f'#!/bin/sh\nread -r pid comm state ppid pgid rest < /proc/$$/stat\n'
                        f'echo "$pid $pgid" > "{record}"\necho "g++ (wrapped) 13.2.0"\n')
    compiler.chmod(0o755)
    assert "-fno-gnu-unique" in shared_flags((str(compiler),))
    pid, pgid = map(int, record.read_text().split())
    assert pgid == pid and pgid != os.getpgrp()


def _within(seconds: float, call, fifo: Path):
    """``call()``'s outcome (its exception, or None), failing when it takes longer than ``seconds``; a reader it
    left waiting on ``fifo`` is then let go (a writer opens and closes it: end of file) so the test can end."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as err:  # noqa: BLE001 - handed to the test
            outcome.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        deadline = time.monotonic() + 30
        while thread.is_alive() and time.monotonic() < deadline:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:  # no reader yet
                pass
            thread.join(0.1)
        pytest.fail(f"still waiting on {fifo} after {seconds} s")
    return outcome[0]


def test_a_header_that_is_not_a_regular_file_is_refused_at_once_naming_it(tmp_path, monkeypatch):
    """Defect: a FIFO header in the model folder held the load until the 600 s compile limit (the compiler
    waited on it at its #include). Every header the build key covers must be a regular file: refused at once."""
    from nereid.backends.cpp import compiler
    from nereid.backends.cxx import build
    from nereid.errors import ConfigError

    folder = tmp_path / "m"
    (folder / "include").mkdir(parents=True)
    source = folder / "model.cpp"
    source.write_text('#include "include/x.h"\n')
    fifo = folder / "include" / "x.h"
    os.mkfifo(fifo)
    err = _within(10, lambda: build.build_library("m", folder, (source,), tmp_path / "scratch"), fifo)
    assert isinstance(err, ConfigError), err
    assert str(err).startswith(f"model 'm': runtime.sources: {fifo}: is a FIFO, not a regular file; "), err
    assert not (folder / ".cache").exists()  # nothing was compiled
    fifo.unlink()
    (folder / "include" / "gone.h").symlink_to(folder / "nowhere.h")
    with pytest.raises(ConfigError, match="gone.h: is a symlink to a file that does not exist"):
        library_hash((source,), (CXX,), folder, model="m")
    # A FIFO put in place after the check (a race) is refused as it is read, not waited on.
    (folder / "include" / "gone.h").unlink()
    os.mkfifo(fifo)
    monkeypatch.setattr(compiler, "not_regular_reason", lambda path: None)
    err = _within(10, lambda: library_hash((source,), (CXX,), folder, model="m"), fifo)
    assert isinstance(err, ConfigError) and f"{fifo}: is a FIFO, not a regular file" in str(err), err


def test_clang_builds_without_the_gcc_only_flag(tmp_path):
    """Clang emits no STB_GNU_UNIQUE symbols and has no -fno-gnu-unique: a build passing it would fail."""
    compiler = tmp_path / "clang++"
    compiler.write_text('#!/bin/sh\necho "clang version 17.0.6 (https://github.com/llvm/llvm-project)"\n')
    compiler.chmod(0o755)
    assert shared_flags((str(compiler),)) == ("-shared", "-fPIC")


def test_the_header_is_installed_beside_the_package_and_declares_the_api():
    from nereid.backends.cxx import HEADER_NAME
    from nereid.backends.cxx.build import header_dir, header_path

    assert header_path().name == HEADER_NAME and header_path().parent == header_dir()
    text = header_path().read_text()
    for declaration in ("int nereid_infer(", "int nereid_load(", "void nereid_unload(", "nereid_set_error("):
        assert declaration in text, declaration
