"""The cpp backend end to end: main.cpp compiled once into .cache/, then run per batch.

Real g++ builds, real servers and tritonclient over gRPC.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from nereid.backends.cpp import compiler
from nereid.errors import ConfigError
from nereid.backends.cpp.compiler import source_hash
from nereid.run_folders import runs_folder
from support import ECHO_MAIN, NEREID, run_with_tmpdir_mounted_noexec, textproto_single, zombie_children

EXAMPLES = Path(__file__).resolve().parents[2] / "ml-backends"

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler")


def infer(server, model: str, array: np.ndarray, datatype: str = "FP32"):
    tensor = triton.InferInput("input", list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return server.client.infer(model, [tensor])


def expect_error(server, model: str, array: np.ndarray, status: str = "StatusCode.INTERNAL") -> str:
    with pytest.raises(InferenceServerException) as caught:
        infer(server, model, array)
    assert caught.value.status() == status, (caught.value.status(), caught.value.message())
    assert f"'{model}'" in caught.value.message()
    return caught.value.message()


def index_of(server) -> dict[str, tuple[str, str]]:
    return {m.name: (m.state, m.reason) for m in server.client.get_model_repository_index().models}


def copy_example(repo, name: str, as_name: str | None = None) -> Path:
    folder = repo.models_dir / (as_name or name)
    shutil.copytree(EXAMPLES / name, folder)
    return folder


def cache_files(folder: Path) -> list[str]:
    """The names in the model's .cache/, the records beside its builds (``<build>.deps``) left out."""
    cache = folder / ".cache"
    names = sorted(p.name for p in cache.iterdir()) if cache.is_dir() else []
    return [name for name in names if not name.endswith(compiler.RECORD_SUFFIX)]


ROWS = np.arange(-8, 16, dtype=np.float32).reshape(3, 8) * 0.25

# cpp_scale with its factor in a header, to show headers are part of the cache key.
SCALE_WITH_HEADER = (EXAMPLES / "cpp_scale" / "main.cpp").read_text().replace(
    "#include <vector>", '#include <vector>\n#include "factor.h"').replace("v *= 2.0f", "v *= kFactor")


def test_compiles_once_reuses_the_binary_and_rebuilds_on_edit(repo, serve):
    folder = copy_example(repo, "cpp_scale", "scale")
    config = repo.write_config()

    first = serve(config)
    assert index_of(first)["scale"] == ("READY", "")
    assert infer(first, "scale", ROWS).as_numpy("output").tolist() == (ROWS * 2).tolist()
    [binary_name] = cache_files(folder)  # one binary, no partial build left over
    assert binary_name.startswith("main-")
    binary = folder / ".cache" / binary_name
    assert binary.stat().st_mode & stat.S_IXUSR
    before = binary.stat()

    # A second server on the same folder reuses the cached binary: not rebuilt, not rewritten.
    second = serve(config)
    assert infer(second, "scale", ROWS).as_numpy("output").tolist() == (ROWS * 2).tolist()
    after = binary.stat()
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == (before.st_ino, before.st_mtime_ns, before.st_size)
    assert cache_files(folder) == [binary_name]

    # Editing main.cpp builds a new binary under a new name and removes the old one.
    source = folder / "main.cpp"
    source.write_text(source.read_text().replace("v *= 2.0f", "v *= 3.0f"))
    third = serve(config)
    assert infer(third, "scale", ROWS).as_numpy("output").tolist() == (ROWS * 3).tolist()
    [rebuilt_name] = cache_files(folder)
    assert rebuilt_name.startswith("main-") and rebuilt_name != binary_name
    assert not binary.exists()
    # The servers that loaded the old version still run it (their own link to it), as a version being
    # replaced by a reload keeps serving while the new one builds.
    assert infer(first, "scale", ROWS).as_numpy("output").tolist() == (ROWS * 2).tolist()


@pytest.mark.parametrize("change", ["renamed", "deleted"])
def test_a_run_that_finds_its_folder_gone_still_runs(repo, serve, change):
    # A request queued just before its folder moved or went away (the server hears of it a moment
    # later; here never, without watch) runs in the loaded folder, wherever it is now.
    folder = copy_example(repo, "cpp_scale", "moving")
    server = serve(repo.write_config())
    assert infer(server, "moving", ROWS).as_numpy("output").tolist() == (ROWS * 2).tolist()
    if change == "renamed":
        folder.rename(folder.with_name("elsewhere"))
    else:
        shutil.rmtree(folder)
    assert infer(server, "moving", ROWS).as_numpy("output").tolist() == (ROWS * 2).tolist()


def test_runs_go_on_after_the_scratch_folder_was_removed(repo, serve):
    # (a /tmp cleaner's doing, say: every run failed for good, see the python backend's test)
    copy_example(repo, "cpp_scale", "scale")
    server = serve(repo.write_config())
    shutil.rmtree(server.server.scratch_dir)
    assert infer(server, "scale", ROWS).as_numpy("output").tolist() == (ROWS * 2).tolist()


def test_a_scratch_folder_on_a_noexec_mount_makes_the_model_unavailable_saying_so(repo, tmp_path):
    """Defect: with TMPDIR (/tmp) mounted noexec the model loaded READY, its binary linked into the scratch
    folder, then failed every request with "Permission denied: '<scratch>/.../main-...'"."""
    shutil.copytree(EXAMPLES / "cpp_scale", repo.models_dir / "scale", ignore=shutil.ignore_patterns(".cache"))
    noexec = tmp_path / "noexec"
    result = run_with_tmpdir_mounted_noexec(noexec, [*NEREID, "check", "--config", str(repo.write_config())])
    assert result.returncode == 1, result.stdout + result.stderr
    [line] = [line for line in result.stdout.splitlines() if line.startswith("scale: ")]
    assert line.startswith(f"scale: UNAVAILABLE: model 'scale': its binary runs from the server's scratch folder "
                           f"{noexec}/nereid-"), line
    assert "which is on a file system mounted noexec" in line and "set TMPDIR to a folder" in line, line
    assert cache_files(repo.models_dir / "scale") == []  # refused before the compile


def test_concurrent_runs_after_the_scratch_folder_was_removed_all_run_on_another_file_system(repo, serve,
                                                                                            monkeypatch, tmp_path):
    """Defect: with the scratch folder on another file system than .cache/ (tmpfs /tmp, so no hard link), runs
    racing to put the binary back failed: FileExistsError making its folder, PermissionError executing a copy
    another run had not finished."""
    import concurrent.futures
    import tempfile

    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs /dev/shm on a file system of its own")
    elsewhere = Path(tempfile.mkdtemp(dir=shm))
    monkeypatch.setattr(tempfile, "tempdir", str(elsewhere))
    try:
        copy_example(repo, "cpp_scale", "scale")
        server = serve(repo.write_config('- name: "scale"\n  instances: 8\n'))
        for _ in range(5):
            shutil.rmtree(server.server.scratch_dir)
            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                answers = list(pool.map(lambda _: infer(server, "scale", ROWS).as_numpy("output"), range(16)))
            assert all(answer.tolist() == (ROWS * 2).tolist() for answer in answers)
    finally:
        shutil.rmtree(elsewhere, ignore_errors=True)


def test_editing_an_included_header_rebuilds(repo, serve):
    folder = repo.add("scale_h", (EXAMPLES / "cpp_scale" / "model_inference.textproto").read_text(),
                      main_cpp=SCALE_WITH_HEADER)
    (folder / "factor.h").write_text("constexpr float kFactor = 4.0f;\n")
    config = repo.write_config()
    server = serve(config)
    assert infer(server, "scale_h", ROWS).as_numpy("output").tolist() == (ROWS * 4).tolist()
    [old] = cache_files(folder)
    (folder / "factor.h").write_text("constexpr float kFactor = -1.0f;\n")
    server = serve(config)
    assert infer(server, "scale_h", ROWS).as_numpy("output").tolist() == (-ROWS).tolist()
    [new] = cache_files(folder)
    assert new != old


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


def test_compile_error_is_unavailable_with_the_compiler_message(repo, serve, no_zombies):
    broken = repo.add("broken", textproto_single(), main_cpp='''
        int main() {
            return undefined_identifier_xyz + 1;
        }
    ''')
    copy_example(repo, "cpp_scale")
    repo.python("echo", main=ECHO_MAIN)
    server = serve(repo.write_config())
    index = index_of(server)
    state, reason = index["broken"]
    assert state == "UNAVAILABLE"
    assert "compilation failed" in reason
    assert "undefined_identifier_xyz" in reason  # the compiler's own diagnostic
    assert reason.startswith("broken/main.cpp: ")  # names the model's source, relative to ml_backends_path
    assert str(broken) not in reason  # clients never see the server's absolute paths
    assert cache_files(broken) == []  # no binary, no partial build left behind
    # requests to it say why; the other models serve
    message = expect_error(server, "broken", np.zeros(4, dtype=np.float32), status="StatusCode.UNAVAILABLE")
    assert "undefined_identifier_xyz" in message
    assert index["cpp_scale"] == ("READY", "") and index["echo"] == ("READY", "")
    assert infer(server, "cpp_scale", ROWS).as_numpy("output").tolist() == (ROWS * 2).tolist()
    row = np.array([1, 2, 3, 4], dtype=np.float32)
    assert infer(server, "echo", row).as_numpy("output").tolist() == row.tolist()
    assert zombie_children() == []


def test_cpp_scale_example_doubles_its_input(repo, serve):
    copy_example(repo, "cpp_scale")
    server = serve(repo.write_config())
    metadata = server.client.get_model_metadata("cpp_scale")
    assert metadata.platform == "nereid_cpp"
    batch = np.linspace(-3, 3, 16 * 8, dtype=np.float32).reshape(16, 8)
    result = infer(server, "cpp_scale", batch)
    assert result.as_numpy("output").shape == (16, 8)
    assert result.as_numpy("output").tolist() == (batch * 2).tolist()
    one = np.arange(8, dtype=np.float32)
    result = infer(server, "cpp_scale", one)
    assert result.as_numpy("output").shape == (8,)
    assert result.as_numpy("output").tolist() == (one * 2).tolist()
    # over max_batch_size 16: refused before the program runs
    message = expect_error(server, "cpp_scale", np.zeros((17, 8), dtype=np.float32),
                           status="StatusCode.INVALID_ARGUMENT")
    assert "max_batch_size 16" in message


# The first input element picks the behaviour; 0 answers like cpp_scale.
FAULTY_CPP = r'''
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

int main() {
    std::string shape = std::getenv("NEREID_INPUT_SHAPE");
    std::vector<char> raw((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
    std::vector<float> values(raw.size() / sizeof(float));
    std::copy(raw.begin(), raw.end(), reinterpret_cast<char*>(values.data()));
    int mode = values.empty() ? 0 : static_cast<int>(values[0]);
    if (mode == 1) {
        std::cerr << "cpp model: refusing input " << values[0] << std::endl;
        return 7;
    }
    if (mode == 2) std::abort();
    std::FILE* out = std::fopen(std::getenv("NEREID_OUTPUT_PATH"), "wb");
    std::string header = (mode == 3 ? "int32 " : "float32 ") + shape + "\n";
    std::fwrite(header.data(), 1, header.size(), out);
    std::fwrite(values.data(), sizeof(float), values.size(), out);
    std::fclose(out);
    return 0;
}
'''


@pytest.mark.parametrize("mode,expected", [
    (1, ["model 'faulty_cpp' exited with code 7", "cpp model: refusing input 1"]),
    (2, ["model 'faulty_cpp' was killed by signal SIGABRT"]),
    (3, ["model 'faulty_cpp': output 'output': the model wrote int32, expected float32"]),
], ids=["nonzero_exit", "abort", "wrong_dtype"])
def test_cpp_model_fault_is_internal(repo, serve, no_zombies, mode, expected):
    repo.add("faulty_cpp", textproto_single(), main_cpp=FAULTY_CPP)
    server = serve(repo.write_config())
    assert index_of(server)["faulty_cpp"] == ("READY", "")
    message = expect_error(server, "faulty_cpp", np.array([[mode, 5, 6, 7]], dtype=np.float32))
    for text in expected:
        assert text in message, (text, message)
    # the same model serves the next good request
    good = np.array([[0, 5, 6, 7], [8, 9, 10, 11]], dtype=np.float32)
    assert infer(server, "faulty_cpp", good).as_numpy("output").tolist() == good.tolist()
    assert not any(runs_folder(server.server.scratch_dir).iterdir())
    assert zombie_children() == []


def test_folders_the_cpp_backend_cannot_serve(repo, serve):
    repo.add("declared_no_source", textproto_single())
    repo.add("both", textproto_single(), main_py=ECHO_MAIN, main_cpp="int main() { return 0; }\n")
    repo.add("cpp_no_textproto", None, main_cpp="int main() { return 0; }\n")
    repo.python("echo")
    server = serve(repo.write_config('''
        - name: "declared_no_source"
          backend: "cpp"
        - name: "both"
        - name: "cpp_no_textproto"
        - name: "echo"
    '''))
    index = index_of(server)
    state, reason = index["declared_no_source"]
    assert state == "UNAVAILABLE" and "model 'declared_no_source': missing main.cpp" in reason
    state, reason = index["both"]
    assert state == "UNAVAILABLE" and "several backends claim" in reason and "cpp, python" in reason
    state, reason = index["cpp_no_textproto"]
    assert state == "UNAVAILABLE" and "model 'cpp_no_textproto': missing model_inference.textproto" in reason
    row = np.array([1, 2, 3, 4], dtype=np.float32)
    assert infer(server, "echo", row).as_numpy("output").tolist() == row.tolist()


def test_declared_backend_settles_an_ambiguous_folder(repo, serve):
    folder = repo.add("both", (EXAMPLES / "cpp_scale" / "model_inference.textproto").read_text(),
                      main_py="raise SystemExit('the python file must not run')\n",
                      main_cpp=(EXAMPLES / "cpp_scale" / "main.cpp").read_text())
    server = serve(repo.write_config('''
        - name: "both"
          backend: "cpp"
    '''))
    assert infer(server, "both", ROWS).as_numpy("output").tolist() == (ROWS * 2).tolist()
    assert server.client.get_model_metadata("both").platform == "nereid_cpp"
    assert len(cache_files(folder)) == 1


def test_missing_compiler_is_reported(repo, serve, monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    copy_example(repo, "cpp_scale")
    repo.python("echo")
    server = serve(repo.write_config())
    state, reason = index_of(server)["cpp_scale"]
    assert state == "UNAVAILABLE"
    assert "no C++ compiler" in reason and "no-such-compiler-xyz" in reason
    row = np.array([1, 2, 3, 4], dtype=np.float32)
    assert infer(server, "echo", row).as_numpy("output").tolist() == row.tolist()


def test_an_unwritable_cache_builds_in_the_scratch_folder_and_serves(repo, serve, caplog):
    """A read-only repository or a full disk: .cache/ cannot be written, so the build goes to scratch, with a warning.

    Root writes anywhere whatever the permission bits say, so ``.cache`` is a
    regular file here: creating the folder or a file in it fails with a real OSError.
    """
    folder = copy_example(repo, "cpp_scale", "scale")
    shutil.rmtree(folder / ".cache", ignore_errors=True)
    (folder / ".cache").write_text("not a folder\n")
    config = repo.write_config()
    caplog.set_level("WARNING", logger="nereid.backends.cpp.compiler")
    server = serve(config)
    assert index_of(server)["scale"] == ("READY", "")
    assert infer(server, "scale", ROWS).as_numpy("output").tolist() == (ROWS * 2).tolist()
    [warning] = [r.getMessage() for r in caplog.records if "build cache" in r.getMessage()]
    assert "model 'scale'" in warning and str(folder / ".cache") in warning and "scratch folder" in warning
    assert "(it is a file, not a folder)" in warning, warning  # (it said "(File exists)")
    assert (folder / ".cache").read_text() == "not a folder\n"
    # A reload in this server reuses its scratch build: no second compile, no second warning.
    caplog.clear()
    server.client.load_model("scale")
    assert infer(server, "scale", ROWS).as_numpy("output").tolist() == (ROWS * 2).tolist()
    assert not [r for r in caplog.records if "build cache" in r.getMessage()]


def test_a_full_disk_while_publishing_the_build_leaves_no_partial_and_serves_from_scratch(tmp_path, monkeypatch,
                                                                                          caplog):
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


# A child whose files may not grow past 4 KiB (RLIMIT_FSIZE, SIGXFSZ ignored so that a write fails with EFBIG): a
# full scratch folder, without a disk to fill. It loads the model, prints the error and what the scratch holds.
_LOAD_WITH_FULL_DISK = """
import os, resource, signal, sys
from pathlib import Path
from nereid.backend import ModelContext
from nereid.backends.cpp.plugin import CppModel
from nereid.settings import ModelSettings
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
folder, scratch = Path(sys.argv[1]), Path(sys.argv[2])
try:
    CppModel(ModelContext("full", folder, ModelSettings("full"), scratch, "test")).load()
except Exception as err:
    print(type(err).__name__, err)
print(sorted(str(p.relative_to(scratch)) for p in scratch.rglob("*")))
"""


def test_a_binary_a_full_scratch_folder_cannot_take_is_named_and_leaves_nothing(tmp_path):
    """Defect: with the scratch folder on another file system than .cache/ (so the binary is copied, not linked)
    and full, the load failed with a bare "[Errno 28] No space left on device" and left its cpp-* folder with a
    partial copy in the scratch folder until the server stopped (a failed load is never unloaded)."""
    import subprocess
    import sys
    import tempfile

    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs /dev/shm on a file system of its own")
    folder = tmp_path / "model"
    shutil.copytree(EXAMPLES / "cpp_scale", folder, ignore=shutil.ignore_patterns(".cache"))
    built = compiler.build_binary(folder, "main.cpp", tmp_path / "build-scratch", "full")  # in .cache/ from now on
    assert built.parent == folder / ".cache" and built.stat().st_size > 4096
    scratch = Path(tempfile.mkdtemp(dir=shm))
    try:
        child = subprocess.run([sys.executable, "-c", _LOAD_WITH_FULL_DISK, str(folder), str(scratch)],
                               capture_output=True, text=True, timeout=60)
        assert child.returncode == 0, child.stderr
        assert child.stdout.splitlines() == [
            f"ConfigError model 'full': cannot put its binary {built} into the server's scratch folder {scratch}: "
            "File too large (the server makes its scratch folder in TMPDIR)", "[]"], child.stdout
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# Serves the model through its scheduler (which logs its faults, to stderr here) while its folder's mode changes:
# a request with mode 000, one with 644 (read, no search), one whose run puts the mode back (755) the moment it has
# ended, before the model looks at why it failed, then one more. Prints each request's answer: its outputs, or its
# error's class and message.
_SERVE_WITH_FOLDER_MODES = """
import asyncio, logging, sys
from pathlib import Path
import numpy as np
from nereid.backend import ModelContext
from nereid.backends.cpp.plugin import CppModel
from nereid.dtypes import DType
from nereid.scheduler import ModelScheduler
from nereid.settings import ModelSettings
from nereid.stats import ModelStats
from nereid.tensors import NamedTensor
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
folder, scratch = Path(sys.argv[1]), Path(sys.argv[2])
model = CppModel(ModelContext("locked", folder, ModelSettings("locked"), scratch, "test"))
model.load()
x = [NamedTensor("input", DType.FP32, np.arange(8, dtype=np.float32).reshape(1, 8))]
launch = model.launch

def launch_then_mode_back(**kwargs):
    try:
        return launch(**kwargs)
    finally:
        folder.chmod(0o755)

async def serve():
    scheduler = ModelScheduler("locked", model, model.signature(), capacity=4, instances=1, stats=ModelStats())
    async def answer():
        try:
            return (await scheduler.submit(x, 1, 0))[0].data.tolist()
        except Exception as err:
            return f"{type(err).__name__}: {err}"
    for mode in (0, 0o644):
        folder.chmod(mode)
        print(await answer())
    folder.chmod(0)
    model.launch = launch_then_mode_back
    print(await answer())
    del model.launch
    print(await answer())
    await scheduler.drain()

asyncio.run(serve())
model.unload()
"""


def test_a_folder_whose_mode_changes_while_serving_fails_each_request_saying_so_without_a_traceback(tmp_path):
    """Defect (the hunt of the folder's mode): a cpp model whose folder was given mode 000 (or 644) while serving
    answered `PermissionError: [Errno 13] Permission denied: '/proc/self/fd/18'`, naming neither the folder nor the
    remedy, and logged a traceback per request, where a python model's said what to do. Root obeys no permission
    bits: the model is served as a server that is not root serves it."""
    import sys

    from support import run_as_non_root

    folder = tmp_path / "models" / "locked"
    shutil.copytree(EXAMPLES / "cpp_scale", folder, ignore=shutil.ignore_patterns(".cache"))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    tests = str(Path(__file__).resolve().parents[1])
    child = run_as_non_root(["env", f"PYTHONPATH={tests}", sys.executable, "-c", _SERVE_WITH_FOLDER_MODES,
                             str(folder), str(scratch)], folder.parent)
    assert child.returncode == 0, child.stderr
    uid = os.geteuid()

    def refused(mode: str) -> str:
        return (f"model 'locked': its folder {folder} cannot be entered by the server's user (uid {uid}): "
                f"Permission denied (its mode is {mode} now), and every run starts in it: give it back read and "
                f"search permission (chmod u+rx {folder}, or the mode it had); the version loaded serves again as "
                "soon as it can be entered")

    put_back = (f"model 'locked': its folder {folder} could not be entered by the server's user (uid {uid}) when "
                "this run started: Permission denied (its mode was changed while it serves; it is 755 now), and every "
                f"run starts in it: keep its read and search permission (chmod u+rx {folder}); the next run starts in "
                "it as long as it can be entered")
    faults = [refused("000"), refused("644"), put_back]
    assert child.stdout.splitlines() == [*(f"ModelFailure: {fault}" for fault in faults),
                                         str([[float(2 * i) for i in range(8)]])], child.stdout
    assert "Traceback" not in child.stderr and "/proc/self/fd" not in child.stderr, child.stderr
    assert [line for line in child.stderr.splitlines() if line.startswith("ERROR ")] == \
        [f"ERROR nereid.scheduler {fault}" for fault in faults], child.stderr
