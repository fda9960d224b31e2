"""backends/cxx/model.py: a cxx model loads its library, calls it on preallocated, guarded buffers, and unloads it.

Most tests serve the libraries through nereid.yaml and talk to a real server with
tritonclient over gRPC; the in-process ones call CxxModel directly.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from pathlib import Path

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from nereid.backend import ModelContext
from nereid.backends.cxx.model import MAX_OUTPUT_BYTES, CxxModel
from nereid.cli import main as nereid_main
from nereid.dtypes import DType
from nereid.errors import ConfigError, ModelFailure
from nereid.settings import ModelSettings
from nereid.tensors import NamedTensor
from support import expect_grpc_error, wait_until
from tests.backends.cxx.cxx_support import CXX, ROWS, entry, index_of, scale_model, tensor

pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler")


# Every fixed-size datatype, with values that survive the wire (BF16 travels as float32 in tritonclient).
DTYPES = {
    "BOOL": np.array([True, False, True]), "UINT8": np.array([0, 7, 255], np.uint8),
    "UINT16": np.array([0, 9, 65535], np.uint16), "UINT32": np.array([0, 11, 2**32 - 1], np.uint32),
    "UINT64": np.array([0, 13, 2**64 - 1], np.uint64), "INT8": np.array([-128, 0, 127], np.int8),
    "INT16": np.array([-32768, 1, 32767], np.int16), "INT32": np.array([-2**31, 2, 2**31 - 1], np.int32),
    "INT64": np.array([-2**63, 3, 2**63 - 1], np.int64), "FP16": np.array([-1.5, 0.25, 65504], np.float16),
    "FP32": np.array([-1.5, 3.25, 1e30], np.float32), "FP64": np.array([-1e300, 0.1, 2.5], np.float64),
    "BF16": np.array([-2.0, 0.5, 384.0], np.float32),
}


def test_multi_tensor_model_round_trips_every_fixed_size_dtype(repo, serve, libs):
    blocks = "".join(f'input {{ name: "in_{t.lower()}" data_type: "{t}" dims: [3] }}\n'
                     f'output {{ name: "out_{t.lower()}" data_type: "{t}" dims: [3] }}\n' for t in DTYPES)
    folder = repo.add("echo_all", blocks + "max_batch_size: 4\n")
    repo.add("sumdiff", 'input { name: "a" data_type: "FP32" dims: [4] }\n'
                        'input { name: "b" data_type: "FP32" dims: [4] }\n'
                        'output { name: "sum" data_type: "FP32" dims: [4] }\n'
                        'output { name: "diff" data_type: "FP32" dims: [4] }\nmax_batch_size: 2\n')
    server = serve(repo.write_config(entry("echo_all", f'{{library: "{libs["multi"]}"}}') +
                                     entry("sumdiff", f'{{library: "{libs["multi"]}"}}')))
    assert server.client.get_model_metadata("echo_all").platform == "nereid_cxx"
    batch = {t: np.stack([v, v[::-1]]) for t, v in DTYPES.items()}  # batch of 2 rows
    result = server.client.infer("echo_all", [tensor(f"in_{t.lower()}", batch[t], t) for t in DTYPES])
    for t, sent in batch.items():
        received = result.as_numpy(f"out_{t.lower()}")
        assert received.shape == (2, 3), t
        assert received.tolist() == sent.tolist(), t
    # no batch axis in the request: batch 1 for the library, none in the reply
    result = server.client.infer("echo_all", [tensor(f"in_{t.lower()}", v, t) for t, v in DTYPES.items()])
    assert result.as_numpy("out_int64").tolist() == DTYPES["INT64"].tolist()
    assert (folder / "events.log").read_text() == "load echo_all\n"  # nereid_load got the name and folder

    a, b = np.array([[1, 2, 3, 4]], np.float32), np.array([[10, 20, 30, 40]], np.float32)
    result = server.client.infer("sumdiff", [tensor("b", b), tensor("a", a)])  # sent out of order
    assert result.as_numpy("sum").tolist() == (a + b).tolist()
    assert result.as_numpy("diff").tolist() == (a - b).tolist()  # the library got textproto order


def test_buffers_are_passed_without_copies(repo, libs, tmp_path, caplog):
    """In-process (the wire plays no part): the library sees the request array's memory and writes the reply's."""
    folder = repo.add("address", 'input { name: "x" data_type: "INT32" dims: [4] }\n'
                                 'output { name: "where" data_type: "UINT64" dims: [2] }\n')
    settings = ModelSettings("address", runtime={"library": str(libs["multi"])}, timeout_s=2)
    model = CxxModel(ModelContext("address", folder, settings, tmp_path, "test"))
    with caplog.at_level(logging.WARNING, logger="nereid.backend"):
        model.load()
    # Found by a bug hunt: accepted without a word, though a call into the library cannot be stopped.
    assert "model 'address': timeout_s: 2 does not apply: a cxx model's call into its library" in caplog.text
    try:
        x = np.arange(4, dtype=np.int32)
        [where] = model.infer([NamedTensor("x", DType.INT32, x)])
        assert where.data.tolist() == [x.ctypes.data, where.data.ctypes.data]
    finally:
        model.unload()
    assert private_copies(tmp_path) == []  # the private copy went with the unload


INCREMENTING_SOURCE = r'''
#include <cstdint>
#include "nereid_cxx.h"
extern "C" int nereid_infer(void*, const nereid_tensor* in, size_t, nereid_tensor* out, size_t, char*, size_t) {
    uint8_t* value = static_cast<uint8_t*>(in[0].data);  // read only, by the header: written anyway
    *value += 1;
    *static_cast<uint8_t*>(out[0].data) = *value;
    return 0;
}
'''


def test_a_library_that_writes_a_small_read_only_input_changes_only_its_own_copy(repo, tmp_path):
    """Found by the correctness hunt: gRPC's one-byte input is CPython's shared bytes object of that value, passed
    to the library as it was; a library adding 1 to its input answered 6, 7, 8 for the same request, and every
    later one-byte input of 5, to any model, reached it as 8."""
    folder = repo.add("inplace", 'input { name: "x" data_type: "UINT8" dims: [1] }\n'
                                 'output { name: "y" data_type: "UINT8" dims: [1] }\n')
    (folder / "inplace.cpp").write_text(INCREMENTING_SOURCE)
    settings = ModelSettings("inplace", runtime={"sources": [str(folder / "inplace.cpp")]})
    model = CxxModel(ModelContext("inplace", folder, settings, tmp_path, "test"))
    model.load()
    try:
        shared = bytes([5])  # (the interpreter's one bytes object of that value, as a parsed message holds it)
        answers = [int(model.infer([NamedTensor("x", DType.UINT8, np.frombuffer(shared, np.uint8))])[0].data[0])
                   for _ in range(3)]
        assert answers == [6, 6, 6] and bytes([5])[0] == 5 and shared == b"\x05"
        writable = np.array([5], np.uint8)  # (a request's own array is still passed as it is: no copy)
        model.infer([NamedTensor("x", DType.UINT8, writable)])
        assert writable.tolist() == [6]
    finally:
        model.unload()


def test_an_unload_during_a_running_call_waits_for_it_to_return(repo, libs, tmp_path):
    """A call abandoned past the drain's grace cannot be stopped: its code must stay mapped until it returns."""
    folder = repo.add("slow", 'input { name: "x" data_type: "INT64" dims: [1] }\n'
                              'output { name: "max_in_flight" data_type: "INT64" dims: [1] }\n')
    model = CxxModel(ModelContext("slow", folder, ModelSettings("slow", runtime={"library": str(libs["multi"])}),
                                  tmp_path, "test"))
    model.load()
    results = []
    call = threading.Thread(target=lambda: results.append(model.infer([NamedTensor("x", DType.INT64,
                                                                                   np.array([1], np.int64))])))
    call.start()
    # Inside its 300 ms nereid_infer (a fixed sleep could end before the call began, on a slow machine).
    assert wait_until(lambda: model._running_calls == 1)
    model.unload()  # returns at once; nereid_unload and dlclose wait for the call
    assert (folder / "events.log").read_text() == "load slow\n" and len(private_copies(tmp_path)) == 1
    call.join(timeout=10)
    assert results[0][0].data.tolist() == [1]  # the call finished normally
    assert (folder / "events.log").read_text() == "load slow\nunload slow\n"
    assert list(tmp_path.glob("*.so")) == []


COUNTER_SOURCE = r'''
#include <cstdint>
#include "nereid_cxx.h"
inline int64_t& calls() { static int64_t count = 0; return count; }  // GCC would make it STB_GNU_UNIQUE
extern "C" int nereid_infer(void*, const nereid_tensor*, size_t, nereid_tensor* out, size_t, char*, size_t) {
    *static_cast<int64_t*>(out[0].data) = ++calls();
    return 0;
}
'''


def test_statics_start_afresh_with_each_load_and_are_never_shared_between_models(repo, tmp_path):
    """Even a function-local static of an inline function (GCC binds those process-wide unless told not to)."""
    models = []
    for name in ("counter_a", "counter_b"):
        folder = repo.add(name, 'output { name: "calls" data_type: "INT64" dims: [1] }\n')
        (folder / "counter.cpp").write_text(COUNTER_SOURCE)
        settings = ModelSettings(name, runtime={"sources": [str(folder / "counter.cpp")]})
        models.append(CxxModel(ModelContext(name, folder, settings, tmp_path, "test")))

    def calls(model) -> list[int]:
        return [int(model.infer([])[0].data[0]) for _ in range(2)]

    a, b = models
    a.load()
    b.load()
    assert (calls(a), calls(b)) == ([1, 2], [1, 2])
    a.unload()
    a.load()
    assert calls(a) == [1, 2]
    a.unload()
    b.unload()


MEDDLING_SOURCE = r'''
#include <csignal>
#include <unistd.h>
#include "nereid_cxx.h"

namespace {
struct Installs { Installs() { std::signal(SIGTERM, SIG_IGN); } } installs;  // as a crash reporter's constructor
}

extern "C" int nereid_load(const char*, const char* folder, void**, char*, size_t) {
    std::signal(SIGCHLD, SIG_IGN);  // as a library starting helpers, against zombies
    return chdir(folder);           // to open its weights by a relative path
}

extern "C" int nereid_infer(void*, const nereid_tensor*, size_t, nereid_tensor* out, size_t, char*, size_t) {
    *static_cast<int64_t*>(out[0].data) = 1;
    return 0;
}
'''


def test_what_a_library_changes_of_the_server_s_process_is_put_back_and_said(repo, tmp_path, caplog):
    """Found by the native-models hunt: a library that ignored SIGCHLD made every cpp run that failed read as
    exiting 0 (one that wrote its output, then exited 3, was served); one that set its own SIGTERM handler ended the
    server without its drain; one that moved the working folder broke later loads of paths relative to nereid.yaml.
    Each is put back as it was, and the model named."""
    import signal
    import subprocess

    from nereid.backends.cxx.process_guard import _dispositions

    folder = repo.add("meddler", 'output { name: "y" data_type: "INT64" dims: [1] }\n')
    (folder / "meddler.cpp").write_text(MEDDLING_SOURCE)
    model = CxxModel(ModelContext("meddler", folder, ModelSettings(
        "meddler", runtime={"sources": [str(folder / "meddler.cpp")]}), tmp_path, "test"))
    before, working = _dispositions(), os.getcwd()
    caplog.set_level(logging.WARNING, logger="nereid.backends.cxx")
    model.load()
    try:
        assert subprocess.run(["sh", "-c", "exit 3"]).returncode == 3  # (0 with SIGCHLD ignored: reaped unread)
        assert {s: raw[:8] for s, raw in _dispositions().items()} == {s: raw[:8] for s, raw in before.items()}
        assert os.getcwd() == working and int(model.infer([])[0].data[0]) == 1
    finally:
        model.unload()
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [m.split(";")[0] for m in said] == [
        "model 'meddler': opening its shared library changed the server's handling of SIGTERM",
        f"model 'meddler': its nereid_load changed the server's handling of SIGCHLD and working folder "
        f"(from {working})"], said
    assert signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL


def test_library_without_nereid_load_gets_null_state_and_c_works(repo, serve, libs):
    scale_model(repo, "plain_c")
    server = serve(repo.write_config(entry("plain_c", f'{{library: "{libs["noload"]}"}}')))
    assert server.client.infer("plain_c", [tensor("input", ROWS)]).as_numpy("output").tolist() == (ROWS * 2).tolist()


def test_model_faults_are_internal_with_the_library_text(repo, serve, libs):
    scale_model(repo, "faulty")
    server = serve(repo.write_config(entry("faulty", f'{{library: "{libs["multi"]}"}}')))

    def fail(mode: int, *fragments: str) -> str:
        row = np.array([[mode, 5, 6, 7, 8, 9, 10, 11]], np.float32)
        return expect_grpc_error("INTERNAL", lambda: server.client.infer("faulty", [tensor("input", row)]),
                                 "model 'faulty'", *fragments)

    fail(1, "nereid_infer returned 1: refusing input 1")
    long_text = fail(2, "nereid_infer returned 2: xxxx", "(truncated)")
    assert len(long_text) < 1200  # capped, though the library wrote 100000 characters
    unterminated = fail(3, "nereid_infer returned 3: yyyy", "(truncated)")
    assert len(unterminated) < 1200  # no NUL from the library: the server's own last byte ends the text
    fail(4, "nereid_infer returned 4: (no error text)")
    for mode in (5, 6, 7):
        fail(mode, "changed the description of output 'output' (data, byte_size, rank or shape)",
             "preallocated buffer of 32 bytes")
    # Defect: a write past (or before) an output buffer went unnoticed, corrupting the server's memory.
    fail(8, "nereid_infer wrote past the end of output 'output' (its buffer is 32 bytes, shape [1, 8])")
    fail(9, "nereid_infer wrote before the start of output 'output'")
    fail(10, "nereid_infer wrote past the end of output 'output'")  # zeroes, not the guard byte: caught too
    # the model still serves
    assert server.client.infer("faulty", [tensor("input", ROWS)]).as_numpy("output").tolist() == (ROWS * 2).tolist()


def test_models_the_cxx_backend_refuses_are_unavailable_with_a_reason(repo, serve, libs, tmp_path):
    for name in ("missing", "garbage", "foreign", "undefined", "noinfer", "refuse_load", "no_runtime", "both_options",
                 "unknown_option", "on_gpu", "textproto_only", "broken_source", "library_folder", "source_fifo",
                 "cut_short", "future_abi"):
        scale_model(repo, name)
    repo.add("no_textproto", None)
    repo.add("bytes_input", 'input_shape: [4]\noutput_shape: [4]\ndata_type: "BYTES"\n')
    repo.add("dynamic_output", 'input { name: "x" data_type: "FP32" dims: [-1] }\n'
                               'output { name: "y" data_type: "FP32" dims: [-1] }\n')
    broken = tmp_path / "broken" / "broken.cpp"  # (a folder of its own: the build reads every C++ file beside it)
    broken.parent.mkdir()
    broken.write_text("int nereid_infer() { return undefined_identifier_xyz; }\n")
    (tmp_path / "folder.so").mkdir()
    os.mkfifo(tmp_path / "fifo.cpp")
    multi = f'{{library: "{libs["multi"]}"}}'
    server = serve(repo.write_config(
        entry("missing", '{library: "build/libmissing.so"}') +
        entry("garbage", f'{{library: "{libs["garbage"]}"}}') +
        entry("foreign", f'{{library: "{libs["foreign"]}"}}') +
        entry("undefined", f'{{library: "{libs["undefined"]}"}}') +
        entry("noinfer", f'{{library: "{libs["noinfer"]}"}}') +
        entry("refuse_load", multi) +
        '- name: "no_runtime"\n  backend: "cxx"\n' +
        entry("both_options", f'{{library: "{libs["multi"]}", sources: ["x.cpp"]}}') +
        entry("unknown_option", f'{{library: "{libs["multi"]}", flavour: 1}}') +
        entry("on_gpu", multi, '  device: "cuda:0"\n') +
        '- name: "textproto_only"\n' +
        entry("broken_source", f'{{sources: ["{broken}"]}}') +
        entry("library_folder", f'{{library: "{tmp_path / "folder.so"}"}}') +
        entry("source_fifo", f'{{sources: ["{tmp_path / "fifo.cpp"}"]}}') +
        entry("cut_short", f'{{library: "{libs["cutshort"]}"}}') +
        entry("future_abi", f'{{library: "{libs["future"]}"}}') +
        entry("no_textproto", multi) + entry("bytes_input", multi) + entry("dynamic_output", multi)))
    index = index_of(server)
    expected = {
        "missing": ["build/libmissing.so does not exist"],  # resolved against nereid.yaml's folder
        # The loader's faults name the copy's folder too (defect: a fault of where the copy is, such as a
        # file system that cannot map code, was blamed on the user's file).
        "garbage": [f"cannot load shared library {libs['garbage']} (dlopened from its copy in <scratch>/garbage): ",
                    "invalid ELF header"],
        # Defect: glibc's "cannot open shared object file: No such file or directory", of a file that exists.
        "foreign": [f"cannot load shared library {libs['foreign']} (dlopened from its copy in <scratch>/foreign): "
                    "it is built for ", "and this server runs on ", "build it for this machine"],
        "undefined": [f"cannot load shared library {libs['undefined']} (dlopened from its copy in "
                      "<scratch>/undefined): ", "undefined symbol: nereid_missing_dependency_xyz"],
        "noinfer": [f"shared library {libs['noinfer']} does not export nereid_infer"],
        "refuse_load": [f"nereid_load in {libs['multi']} returned 3: cannot open ", "refuse_load/weights.bin"],
        "no_runtime": ["needs exactly one of runtime.library", "runtime.sources"],
        "both_options": ["needs exactly one of runtime.library"],
        "unknown_option": ["models[8].runtime.flavour: unknown option of the cxx backend", "got 1"],
        "on_gpu": ["runs on the CPU", "cuda:0"],
        "textproto_only": ["no backend claims",
                           "may be one), declare it in nereid.yaml with backend: cxx and runtime: {library: PATH}"],
        "broken_source": [f"{broken.name}: compilation failed", "undefined_identifier_xyz"],
        # Defect: both were said not to exist.
        "library_folder": ["shared library ", "folder.so: is a directory, not a regular file"],
        "source_fifo": ["runtime.sources: ", "fifo.cpp: is a FIFO, not a regular file"],
        # Defect (the native hunt): dlopen mapped the part that was missing, and the server died of SIGBUS.
        "cut_short": [f"shared library {libs['cutshort']} cannot be loaded: it is ", " bytes, and its ELF headers say "
                      "at least ", "a copy cut short, or still being written"],
        # (Triton checks a backend's TRITONBACKEND_ApiVersion; the header's version was exported by nothing.)
        "future_abi": [f"shared library {libs['future']} was built against nereid_cxx.h's API version 2; this "
                       "server's is 1: build it again against the header `nereid cxx-header` prints"],
        "no_textproto": ["missing model_inference.textproto"],
        "bytes_input": ["input 'input' is BYTES", "fixed-size datatypes only"],
        "dynamic_output": ["output 'y' has a -1 dimension", "preallocates outputs"],
    }
    for name, fragments in expected.items():
        state, reason = index[name]
        assert state == "UNAVAILABLE", (name, reason)
        for fragment in fragments:
            assert fragment in reason, (name, fragment, reason)
        if name not in ("textproto_only",):
            assert f"model '{name}'" in reason or name in reason, (name, reason)
    assert not list((repo.models_dir / "broken_source").glob(".cache/*"))  # no library, no partial build
    # nothing stays loaded or copied for a model that failed
    assert not list(server.server.scratch_dir.glob("**/*.so"))
    expect_grpc_error("UNAVAILABLE", lambda: server.client.infer("refuse_load", [tensor("input", ROWS)]),
                      "cannot open")


def test_instances_calls_run_at_once_with_the_gil_released(repo, serve, libs):
    repo.add("slow", 'input { name: "x" data_type: "INT64" dims: [1] }\n'
                     'output { name: "max_in_flight" data_type: "INT64" dims: [1] }\n')
    server = serve(repo.write_config(entry("slow", f'{{library: "{libs["multi"]}"}}', "  instances: 2\n")))
    results: list[int] = []
    done = threading.Semaphore(0)

    def answered(result, error) -> None:
        results.append(int(error is None and result.as_numpy("max_in_flight")[0]))
        done.release()

    for _ in range(4):
        server.client.async_infer("slow", [tensor("x", np.array([1], np.int64), "INT64")], answered)
    for _ in range(4):
        assert done.acquire(timeout=30)
    # Two native calls overlapped (the GIL held, none could), never three. (What the library counted, not the
    # time taken: a bound of 1 s on the four calls failed on a starved machine.)
    assert max(results) == 2 and min(results) >= 1, results


def test_coalesced_requests_make_one_call(repo, serve, libs):
    repo.add("batched", 'input { name: "x" data_type: "FP32" dims: [2] }\n'
                        'output { name: "doubled" data_type: "FP32" dims: [2] }\n'
                        'output { name: "batch" data_type: "INT64" dims: [1] }\nmax_batch_size: 4\n')
    server = serve(repo.write_config(entry("batched", f'{{library: "{libs["multi"]}"}}',
                                           "  batching:\n    max_queue_delay_ms: 2000\n")))
    results: dict[int, object] = {}
    done = threading.Semaphore(0)
    rows = [np.array([[i, -i]], np.float32) for i in range(1, 5)]
    for i, row in enumerate(rows):
        def answered(result, error, i=i) -> None:
            results[i] = error or result
            done.release()
        server.client.async_infer("batched", [tensor("x", row)], answered)
    for _ in rows:
        assert done.acquire(timeout=30)
    for i, row in enumerate(rows):
        assert not isinstance(results[i], InferenceServerException), results[i]
        assert results[i].as_numpy("doubled").tolist() == (row * 2).tolist()  # each gets its own rows back
        assert results[i].as_numpy("batch").tolist() == [[4]]  # from one call on a batch of 4


def private_copies(scratch: Path) -> list[Path]:
    """The private copies of shared libraries under ``scratch`` (each in a folder of its own, beside links)."""
    return [path for path in scratch.glob("*/*.so") if not path.is_symlink()]


def test_unload_calls_nereid_unload_and_load_again_works(repo, serve, libs):
    folder = scale_model(repo, "faulty_reloaded")
    server = serve(repo.write_config(entry("faulty_reloaded", f'{{library: "{libs["multi"]}"}}')))
    scratch = server.server.scratch_dir / "faulty_reloaded"
    assert len(private_copies(scratch)) == 1  # the private copy
    server.client.unload_model("faulty_reloaded")
    assert (folder / "events.log").read_text() == "load faulty_reloaded\nunload faulty_reloaded\n"
    assert private_copies(scratch) == []  # dlclosed and deleted, with its folder
    expect_grpc_error("UNAVAILABLE", lambda: server.client.infer("faulty_reloaded", [tensor("input", ROWS)]))
    server.client.load_model("faulty_reloaded")
    assert server.client.infer("faulty_reloaded", [tensor("input", ROWS)]).as_numpy("output").tolist() == \
        (ROWS * 2).tolist()
    assert (folder / "events.log").read_text().splitlines() == ["load faulty_reloaded", "unload faulty_reloaded",
                                                                "load faulty_reloaded"]


HUGE_OUTPUTS = {  # a typo'd dimension: no buffer of that size can exist
    "one_row": ('input_shape: [1]\noutput_shape: [4611686018427387904]\n',
                "output 'output' (FP32 [4611686018427387904]) takes 18446744073709551616 bytes for its declared "
                "shape"),
    # Each row fits; the max_batch_size rows the buffer is allocated for do not.
    "batched": ('input { name: "x" data_type: "FP32" dims: [1] }\n'
                'output { name: "y" data_type: "INT64" dims: [576460752303423488] }\nmax_batch_size: 2\n',
                "output 'y' (INT64 [576460752303423488]) takes 9223372036854775808 bytes for 2 rows "
                "(max_batch_size) of its declared shape"),
}


@pytest.mark.parametrize("case", HUGE_OUTPUTS)
def test_an_output_too_large_for_any_buffer_is_refused_at_load_naming_it(repo, tmp_path, case):
    """Found by a bug hunt: output_shape: [4611686018427387904] loaded READY, then every request failed with a
    bare "OverflowError: cannot fit 'int' into an index-sized integer", logged as a crash."""
    textproto, fragment = HUGE_OUTPUTS[case]
    folder = repo.add("huge", textproto)
    # Refused from the textproto alone: the library is never looked for.
    model = CxxModel(ModelContext("huge", folder, ModelSettings("huge", runtime={"library": str(tmp_path / "x.so")}),
                                  tmp_path, "test"))
    with pytest.raises(ConfigError) as refused:
        model.load()
    assert str(refused.value) == (f"model 'huge': {fragment}, more than the {MAX_OUTPUT_BYTES} bytes an output "
                                  "buffer can hold; the cxx backend preallocates outputs: check its dims in "
                                  f"{folder / 'model_inference.textproto'}")


def test_check_reports_an_output_too_large_for_any_buffer_as_unavailable(repo, libs, capsys):
    repo.add("huge", HUGE_OUTPUTS["one_row"][0])
    config = repo.write_config(entry("huge", f'{{library: "{libs["multi"]}"}}'))
    assert nereid_main(["check", "--config", str(config)]) == 1
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("huge:"))
    assert line.startswith(f"huge: UNAVAILABLE: model 'huge': {HUGE_OUTPUTS['one_row'][1]}, more than the "), line


def test_an_output_that_memory_cannot_hold_fails_the_call_naming_it(repo, libs, tmp_path):
    """Below the array limit but past any memory (an exbibyte): a ModelFailure naming the output, not a
    MemoryError logged as a crash."""
    folder = repo.add("exbi", 'input_shape: [1]\noutput_shape: [288230376151711744]\n')
    model = CxxModel(ModelContext("exbi", folder, ModelSettings("exbi", runtime={"library": str(libs["multi"])}),
                                  tmp_path, "test"))
    model.load()
    try:
        with pytest.raises(ModelFailure, match=re.escape(
                "model 'exbi': cannot allocate output 'output' (FP32 [288230376151711744], 1152921504606846976 "
                "bytes): out of memory")):
            model.infer([NamedTensor("input", DType.FP32, np.ones(1, np.float32))])
    finally:
        model.unload()


def test_a_folder_whose_path_is_not_utf8_is_passed_to_nereid_load_as_its_bytes(libs, tmp_path):
    """Found by the deployment hunt: a repository under a folder named in Latin-1 (an old NFS share's 'rep\\xe8o')
    failed the load of every cxx model with nereid_load: UnicodeEncodeError, surrogates not allowed."""
    blocks = "".join(f'input {{ name: "in_{t.lower()}" data_type: "{t}" dims: [3] }}\n'
                     f'output {{ name: "out_{t.lower()}" data_type: "{t}" dims: [3] }}\n' for t in DTYPES)
    folder = tmp_path / os.fsdecode(b"rep\xe8o") / "echo_all"
    folder.mkdir(parents=True)
    (folder / "model_inference.textproto").write_text(blocks + "max_batch_size: 4\n")
    settings = ModelSettings("echo_all", runtime={"library": str(libs["multi"])})
    model = CxxModel(ModelContext("echo_all", folder, settings, tmp_path, "test"))
    model.load()
    try:
        assert (folder / "events.log").read_text() == "load echo_all\n"  # (written where nereid_load was told)
    finally:
        model.unload()


OPENMP_CALL_SOURCE = r'''
#include <omp.h>
#include "nereid_cxx.h"
extern "C" int nereid_infer(void*, const nereid_tensor*, size_t, nereid_tensor* out, size_t, char*, size_t) {
    *static_cast<int64_t*>(out[0].data) = omp_get_num_threads();
    return 0;
}
'''


def test_a_source_build_missing_a_library_says_what_a_source_build_links(repo, tmp_path):
    """Found by the native-models hunt: runtime.sources calling OpenMP (or another library) built, then failed to
    load naming only the symbol (`undefined symbol: omp_get_num_threads`), where a cpp build's link says what is
    linked and what to do."""
    folder = repo.add("omp_src", 'output { name: "threads" data_type: "INT64" dims: [1] }\n')
    (folder / "omp.cpp").write_text(OPENMP_CALL_SOURCE)
    settings = ModelSettings("omp_src", runtime={"sources": [str(folder / "omp.cpp")]})
    model = CxxModel(ModelContext("omp_src", folder, settings, tmp_path, "test"))
    with pytest.raises(ConfigError) as refused:
        model.load()
    assert "undefined symbol: omp_get_num_threads" in str(refused.value)
    assert str(refused.value).endswith("as CXX=\"c++ -fopenmp\")"), str(refused.value)


def test_a_source_build_missing_a_function_defined_beside_it_names_that_file(repo, tmp_path):
    """Found by the author hunt: a helper.cpp beside the model's source, not listed in runtime.sources, got the
    advice to take a prebuilt library or a CXX with a flag."""
    folder = repo.add("two", 'output { name: "x" data_type: "INT64" dims: [1] }\n')
    (folder / "model.cpp").write_text(OPENMP_CALL_SOURCE.replace("#include <omp.h>", 'extern "C" int helper_threads();')
                                      .replace("omp_get_num_threads", "helper_threads"))
    (folder / "helper.cpp").write_text('extern "C" int helper_threads() { return 1; }\n')
    settings = ModelSettings("two", runtime={"sources": [str(folder / "model.cpp")]})
    with pytest.raises(ConfigError) as refused:
        CxxModel(ModelContext("two", folder, settings, tmp_path, "test")).load()
    assert str(refused.value).endswith("; only runtime.sources are compiled: helper.cpp, beside them, is not: list "
                                       "it in runtime.sources)"), str(refused.value)
