"""backends/cpp/plugin.py end to end: a cpp model's main.cpp compiled once into .cache/, then run per batch.

Real g++ builds, real servers and tritonclient over gRPC.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from nereid.backends.cpp import compiler
from nereid.run_folders import runs_folder
from support import ECHO_MAIN, NEREID, run_with_tmpdir_mounted_noexec, textproto_single, zombie_children

EXAMPLES = Path(__file__).resolve().parents[3] / "ml-backends"

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


ROWS = np.arange(-8, 16, dtype=np.float32).reshape(3, 8) * 0.25


# cpp_scale with its factor in a header, to show headers are part of the cache key.
SCALE_WITH_HEADER = (EXAMPLES / "cpp_scale" / "main.cpp").read_text().replace(
    "#include <vector>", '#include <vector>\n#include "factor.h"').replace("v *= 2.0f", "v *= kFactor")


def test_compiles_once_reuses_the_binary_and_rebuilds_on_edit(repo, serve, cache_files):
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


def test_a_scratch_folder_on_a_noexec_mount_makes_the_model_unavailable_saying_so(repo, tmp_path, cache_files):
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


def test_editing_an_included_header_rebuilds(repo, serve, cache_files):
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


def test_compile_error_is_unavailable_with_the_compiler_message(repo, serve, no_zombies, cache_files):
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


def test_declared_backend_settles_an_ambiguous_folder(repo, serve, cache_files):
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
    tests = str(Path(__file__).resolve().parents[2])
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


@pytest.mark.parametrize("main_cpp", ["file", "fifo", "folder", "dangling link"])
def test_a_folder_holding_main_cpp_in_any_form_is_claimed(tmp_path, main_cpp):
    """A FIFO or a folder named main.cpp is claimed too, so that the load names what it is (no backend claiming
    it said only "no backend claims")."""
    from nereid.backends.cpp import plugin

    source = tmp_path / "main.cpp"
    if main_cpp == "file":
        source.write_text("int main() {}\n")
    elif main_cpp == "fifo":
        os.mkfifo(source)
    elif main_cpp == "folder":
        source.mkdir()
    else:
        source.symlink_to(tmp_path / "nowhere.cpp")
    assert plugin.nereid_claim_model(tmp_path, declared=False).create is plugin.CppModel


def test_a_folder_without_main_cpp_is_claimed_only_when_declared(tmp_path):
    from nereid.backends.cpp import plugin

    (tmp_path / "main.py").write_text("")
    assert plugin.nereid_claim_model(tmp_path, declared=False) is None
    assert plugin.nereid_claim_model(tmp_path, declared=True).create is plugin.CppModel  # (its load says what lacks)
    assert plugin.nereid_claim_signs() == "main.cpp"


def test_any_key_of_backends_cpp_is_refused_naming_where_it_is():
    from nereid.backends.cpp import plugin
    from nereid.errors import ConfigError

    plugin.nereid_check_defaults({}, "nereid.yaml: backends.cpp")
    with pytest.raises(ConfigError) as refused:
        plugin.nereid_check_defaults({"typo_default": 2}, "nereid.yaml: backends.cpp")
    assert str(refused.value) == ("nereid.yaml: backends.cpp.typo_default: unknown option of the cpp backend (it has "
                                  "no runtime options), got 2")
