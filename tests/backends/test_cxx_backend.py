"""The cxx backend end to end: real shared libraries built with c++, dlopened in a real server.

The libraries are compiled once per module; each test serves them through
nereid.yaml and talks to the server with tritonclient over gRPC.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from nereid.backend import ModelContext
from nereid.backends.cxx.build import header_dir, library_hash, shared_flags
from nereid.backends.elf_files import needed_libraries
from nereid.backends.cxx.model import MAX_OUTPUT_BYTES, CxxModel
from nereid.cli import main as nereid_main
from nereid.dtypes import DType
from nereid.errors import ConfigError, ModelFailure
from nereid.settings import ModelSettings
from nereid.tensors import NamedTensor
from support import (NEREID, expect_grpc_error, nereid_serve, run_with_tmpdir_mounted_noexec, wait_until,
                     zero_text_section)

EXAMPLES = Path(__file__).resolve().parents[2] / "ml-backends"
CXX = shutil.which(os.environ.get("CXX", "c++"))

pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler")

# One library, several models: nereid_load picks a behaviour from the model name's
# prefix and logs "load <name>" / "unload <name>" to events.log in the model folder.
TEST_LIBRARY = r'''
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include "nereid_cxx.h"

namespace {
struct State {
    std::string name, folder;
    std::atomic<int> in_flight{0}, max_in_flight{0};
};

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

void log_event(const State* s, const char* what) {
    std::FILE* f = std::fopen((s->folder + "/events.log").c_str(), "a");
    if (f) { std::fprintf(f, "%s %s\n", what, s->name.c_str()); std::fclose(f); }
}

int echo(const nereid_tensor* in, size_t n_in, nereid_tensor* out, size_t n_out, char* error, size_t size) {
    if (n_in != n_out) { nereid_set_error(error, size, "echo: %zu inputs, %zu outputs", n_in, n_out); return 1; }
    for (size_t i = 0; i < n_in; ++i) {
        bool same_shape = in[i].rank == out[i].rank;
        for (int64_t d = 0; same_shape && d < in[i].rank; ++d) same_shape = in[i].shape[d] == out[i].shape[d];
        if (std::strcmp(in[i].dtype, out[i].dtype) != 0 || in[i].byte_size != out[i].byte_size || !same_shape ||
            std::strcmp(in[i].name + 3, out[i].name + 4) != 0) {
            nereid_set_error(error, size, "echo: %s (%s) does not match %s (%s)", in[i].name, in[i].dtype,
                             out[i].name, out[i].dtype);
            return 1;
        }
        std::memcpy(out[i].data, in[i].data, in[i].byte_size);
    }
    return 0;
}

int doubled(const nereid_tensor& in, nereid_tensor& out) {
    const float* x = static_cast<const float*>(in.data);
    float* y = static_cast<float*>(out.data);
    for (size_t i = 0; i < in.byte_size / sizeof(float); ++i) y[i] = 2 * x[i];
    return 0;
}
}  // namespace

extern "C" int nereid_load(const char* model_name, const char* model_folder, void** state,
                           char* error, size_t error_size) {
    std::string name(model_name);
    if (starts_with(name, "refuse")) {
        nereid_set_error(error, error_size, "cannot open %s/weights.bin", model_folder);
        return 3;
    }
    State* s = new State;
    s->name = name;
    s->folder = model_folder;
    log_event(s, "load");
    *state = s;
    return 0;
}

extern "C" void nereid_unload(void* state) {
    State* s = static_cast<State*>(state);
    log_event(s, "unload");
    delete s;
}

extern "C" int nereid_infer(void* state, const nereid_tensor* in, size_t n_in, nereid_tensor* out, size_t n_out,
                            char* error, size_t error_size) {
    State* s = static_cast<State*>(state);
    if (starts_with(s->name, "echo")) return echo(in, n_in, out, n_out, error, error_size);
    if (starts_with(s->name, "sumdiff")) {  // inputs a, b -> outputs sum, diff (a - b: order matters)
        const float* a = static_cast<const float*>(in[0].data);
        const float* b = static_cast<const float*>(in[1].data);
        float* sum = static_cast<float*>(out[0].data);
        float* diff = static_cast<float*>(out[1].data);
        for (size_t i = 0; i < in[0].byte_size / sizeof(float); ++i) { sum[i] = a[i] + b[i]; diff[i] = a[i] - b[i]; }
        return 0;
    }
    if (starts_with(s->name, "address")) {  // where the buffers it was handed live
        uint64_t* out0 = static_cast<uint64_t*>(out[0].data);
        out0[0] = reinterpret_cast<uintptr_t>(in[0].data);
        out0[1] = reinterpret_cast<uintptr_t>(out[0].data);
        return 0;
    }
    if (starts_with(s->name, "slow")) {  // reports how many calls it has seen running at once
        int now = ++s->in_flight;
        int seen = s->max_in_flight.load();
        while (now > seen && !s->max_in_flight.compare_exchange_weak(seen, now)) {}
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        *static_cast<int64_t*>(out[0].data) = s->max_in_flight.load();
        --s->in_flight;
        return 0;
    }
    if (starts_with(s->name, "batched")) {  // doubles, and reports the batch it was called with
        doubled(in[0], out[0]);
        for (int64_t row = 0; row < out[1].shape[0]; ++row) static_cast<int64_t*>(out[1].data)[row] = in[0].shape[0];
        return 0;
    }
    if (starts_with(s->name, "faulty")) {  // the first element picks the fault; 0 doubles
        int mode = static_cast<int>(static_cast<const float*>(in[0].data)[0]);
        if (mode == 1) { nereid_set_error(error, error_size, "refusing input %d", mode); return 1; }
        if (mode == 2) { std::string long_text(100000, 'x'); nereid_set_error(error, error_size, "%s", long_text.c_str()); return 2; }
        if (mode == 3) { std::memset(error, 'y', error_size); return 3; }  // fills the buffer, no NUL
        if (mode == 4) return 4;  // no text
        if (mode == 5) { static float elsewhere[64]; out[0].data = elsewhere; return 0; }
        if (mode == 6) { static int64_t other[2] = {1, 99}; out[0].shape = other; return 0; }
        if (mode == 7) { const_cast<int64_t*>(out[0].shape)[1] = 99; return 0; }  // writes through its shape
        if (mode == 8) { doubled(in[0], out[0]); static_cast<float*>(out[0].data)[out[0].byte_size / 4] = 1; return 0; }
        if (mode == 9) { doubled(in[0], out[0]); static_cast<float*>(out[0].data)[-1] = 1; return 0; }
        if (mode == 10) {  // a whole extra row (of 8 floats): an off-by-one batch loop
            float* y = static_cast<float*>(out[0].data);
            for (int i = 0; i < 8; ++i) y[out[0].byte_size / 4 + i] = 0;
            return 0;
        }
        return doubled(in[0], out[0]);
    }
    nereid_set_error(error, error_size, "unknown test model %s", s->name.c_str());
    return 9;
}
'''

# Plain C, no nereid_load: the header must work from C, and state must be NULL.
NO_LOAD_C = r'''
#include "nereid_cxx.h"

int nereid_infer(void *state, const nereid_tensor *inputs, size_t n_inputs,
                 nereid_tensor *outputs, size_t n_outputs, char *error, size_t error_size) {
    if (state != NULL) { nereid_set_error(error, error_size, "state is not NULL"); return 1; }
    const float *x = (const float *)inputs[0].data;
    float *y = (float *)outputs[0].data;
    for (uint64_t i = 0; i < inputs[0].byte_size / sizeof(float); ++i) y[i] = 2 * x[i];
    (void)n_inputs; (void)n_outputs;
    return 0;
}
'''

NO_INFER = '#include <cstddef>\nextern "C" int nereid_load(const char*, const char*, void**, char*, size_t) { return 0; }\n'

# A library built against a later version of the header, whose functions take other arguments.
FUTURE_ABI_C = (
    '#include <stddef.h>\n#include <stdint.h>\n'
    '__attribute__((visibility("default"))) const uint32_t nereid_cxx_api_version = 2;\n'
    'int nereid_infer(void *s, const void *i, size_t n, void *o, size_t m, char *e, size_t k) { return 0; }\n')

UNDEFINED_SYMBOL = r'''
#include "nereid_cxx.h"
extern "C" int nereid_missing_dependency_xyz(void);
extern "C" int nereid_infer(void*, const nereid_tensor*, size_t, nereid_tensor*, size_t, char*, size_t) {
    return nereid_missing_dependency_xyz();
}
'''

TRIPLE = (EXAMPLES / "cxx_scale" / "scale.cpp").read_text().replace("* 2.0f", "* 3.0f")

SCALE_TEXTPROTO = (EXAMPLES / "cxx_scale" / "model_inference.textproto").read_text()
ROWS = np.arange(-8, 16, dtype=np.float32).reshape(3, 8) * 0.25

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


@pytest.fixture(scope="module")
def libs(tmp_path_factory) -> dict[str, Path]:
    """Every test library, compiled once, in parallel."""
    root = tmp_path_factory.mktemp("cxx-libs")
    sources = {"multi": ("cpp", TEST_LIBRARY), "noload": ("c", NO_LOAD_C), "noinfer": ("cpp", NO_INFER),
               "undefined": ("cpp", UNDEFINED_SYMBOL), "triple": ("cpp", TRIPLE),
               "future": ("c", FUTURE_ABI_C)}
    builds = {}
    for name, (language, text) in sources.items():
        source = root / f"{name}.{language}"
        source.write_text(text)
        argv = [CXX, "-O1", "-shared", "-fPIC", f"-I{header_dir()}", "-o", str(root / f"lib{name}.so"),
                *(["-x", "c"] if language == "c" else ["-std=c++17"]), str(source)]
        builds[name] = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    for name, build in builds.items():
        _, err = build.communicate(timeout=120)
        assert build.returncode == 0, f"{name}: {err}"
    (root / "libgarbage.so").write_text("this is not an ELF file\n" * 10)
    # The same library claiming another machine in its ELF header (e_machine, 2 bytes at offset 18).
    foreign = bytearray((root / "libnoinfer.so").read_bytes())
    foreign[18:20] = (62 if foreign[18:20] == (183).to_bytes(2, "little") else 183).to_bytes(2, "little")
    (root / "libforeign.so").write_bytes(foreign)
    whole = (root / "libnoinfer.so").read_bytes()  # a copy cut short (a deploy's, still arriving)
    (root / "libcutshort.so").write_bytes(whole[:len(whole) // 2])
    return {name: root / f"lib{name}.so" for name in (*sources, "garbage", "foreign", "cutshort")}


def test_a_library_built_with_the_header_exports_the_api_version_the_server_calls(libs) -> None:
    """What the load checks (see the refusal of a library of another version below); one built before the header
    exported it (the version-less ones here) is taken as version 1."""
    from nereid.backends.cxx import API_VERSION
    header = (header_dir() / "nereid_cxx.h").read_text()
    assert f"#define NEREID_CXX_API_VERSION {API_VERSION}\n" in header
    library = ctypes.CDLL(str(libs["multi"]))
    assert ctypes.c_uint32.in_dll(library, "nereid_cxx_api_version").value == API_VERSION


def index_of(server) -> dict[str, tuple[str, str]]:
    return {m.name: (m.state, m.reason) for m in server.client.get_model_repository_index().models}


def tensor(name: str, array: np.ndarray, datatype: str = "FP32") -> triton.InferInput:
    value = triton.InferInput(name, list(array.shape), datatype)
    value.set_data_from_numpy(array)
    return value


def scale_model(repo, name: str, textproto: str = SCALE_TEXTPROTO) -> Path:
    return repo.add(name, textproto)


def entry(name: str, runtime: str, extra: str = "") -> str:
    return f'- name: "{name}"\n  backend: "cxx"\n  runtime: {runtime}\n{extra}'


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


def test_a_model_folder_in_a_bucket_brings_its_own_library(s3, serve, libs, tmp_path):
    # A bucket's model runs from a local mirror whose path nereid.yaml cannot know: $MODEL_FOLDER names it.
    import obstore

    obstore.put(s3.store, f"{s3.prefix}/tripler/model_inference.textproto", SCALE_TEXTPROTO.encode())
    obstore.put(s3.store, f"{s3.prefix}/tripler/libtriple.so", libs["triple"].read_bytes())
    config = tmp_path / "nereid.yaml"
    config.write_text(f'server:\n  bind_addr: "127.0.0.1:0"\n  metrics_addr: ""\n  http_addr: ""\n'
                      f'  ml_backends_path: "{s3.url()}"\n  cache_dir: "{tmp_path / "cache"}"\nmodels:\n'
                      + "".join(f"  {line}\n" for line in
                                entry("tripler", '{library: "$MODEL_FOLDER/libtriple.so"}').splitlines()))
    server = serve(config)
    assert server.client.infer("tripler", [tensor("input", ROWS)]).as_numpy("output").tolist() == \
        (ROWS * 3).tolist()


def test_model_folder_paths_resolve_per_model_and_need_a_folder(tmp_path):
    from nereid.backends.cxx.options import parse_options
    from nereid.errors import ConfigError

    options = parse_options("m", {"sources": ["$MODEL_FOLDER/src/a.cpp", "/abs/b.cpp"]}, "", tmp_path / "m")
    assert options.sources == (tmp_path / "m" / "src" / "a.cpp", Path("/abs/b.cpp"))
    with pytest.raises(ConfigError, match=r"runtime.library: uses \$MODEL_FOLDER, but no model folder is known"):
        parse_options("m", {"library": "$MODEL_FOLDER/lib.so"}, "")


def test_a_source_yaml_read_as_a_boolean_is_named_by_its_item_with_the_advice_to_quote(tmp_path):
    """Stop 48's walkthrough: `sources: [a.cpp, on]` said only "runtime.sources: must be a path ..., got true",
    with neither the item nor the advice to quote that `backend: on` gets."""
    from nereid.backends.cxx.options import parse_options
    from nereid.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        parse_options("m", {"sources": ["/abs/a.cpp", True]}, "", tmp_path / "m")
    assert "runtime.sources[1]: must be a path" in str(refused.value)
    assert "put the text in quotes" in str(refused.value) and str(refused.value).endswith("got true")


def test_a_models_own_library_or_sources_replaces_the_other_from_backends_cxx(tmp_path):
    """Found by a README check: under `backends: {cxx: {sources: [...]}}` (as the README suggests) a model with its
    own `library:` inherited `sources:` too, and was refused ("needs exactly one of ... in nereid.yaml: models[1]")
    naming only its own entry, which held one."""
    from nereid.backends.cxx.options import parse_options
    from nereid.errors import ConfigError
    from nereid.runtime_options import LayeredRuntime

    folder = tmp_path / "m"
    sources = {"sources": ["$MODEL_FOLDER/model.cpp"]}
    library = {"library": "$MODEL_FOLDER/libm.so"}
    defaults = "nereid.yaml: backends.cxx"
    own_library = parse_options("m", LayeredRuntime(library, sources, defaults), "nereid.yaml: models[1]", folder)
    assert own_library == parse_options("m", library, "", folder)
    own_sources = parse_options("m", LayeredRuntime(sources, library, defaults), "nereid.yaml: models[1]", folder)
    assert own_sources == parse_options("m", sources, "", folder)
    # Both in the default: named there, not under the model that wrote neither.
    with pytest.raises(ConfigError, match=r"needs exactly one of runtime.library .* in nereid.yaml: backends.cxx, "):
        parse_options("m", LayeredRuntime({}, {**library, **sources}, defaults), "nereid.yaml: models[1]", folder)
    with pytest.raises(ConfigError, match=r"needs exactly one of runtime.library .* in nereid.yaml: models\[1\], "):
        parse_options("m", LayeredRuntime({**library, **sources}, {}, defaults), "nereid.yaml: models[1]", folder)


def test_relative_paths_are_taken_next_to_a_symlinked_nereid_yaml_as_named(tmp_path):
    """In a Kubernetes ConfigMap nereid.yaml is a symlink into a versioned folder: a library named relative to it
    was looked for in that folder (where no library is), unlike every relative path the core resolves."""
    from nereid.backends.cxx.options import parse_options

    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "nereid.yaml").write_text("models: []\n")
    (tmp_path / "mounted").mkdir()
    (tmp_path / "mounted" / "nereid.yaml").symlink_to(tmp_path / "cfg" / "nereid.yaml")
    (tmp_path / "mounted" / "build").mkdir()
    (tmp_path / "mounted" / "build" / "libm.so").write_bytes(b"")
    origin = f"{tmp_path / 'mounted' / 'nereid.yaml'}: models[0]"
    assert parse_options("m", {"library": "build/libm.so"}, origin).library == tmp_path / "mounted" / "build" / \
        "libm.so"
    # Nothing there as named: next to the file the link points to, as the core's paths.
    assert parse_options("m", {"sources": ["src/m.cpp"]}, origin).sources == (tmp_path / "cfg" / "src" / "m.cpp",)


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


def test_check_reports_cxx_models_and_cxx_header_prints_the_header(repo, libs, capsys):
    scale_model(repo, "plain_c")
    scale_model(repo, "noinfer")
    config = repo.write_config(entry("plain_c", f'{{library: "{libs["noload"]}"}}') +
                               entry("noinfer", f'{{library: "{libs["noinfer"]}"}}'))
    assert nereid_main(["check", "--config", str(config)]) == 1
    out = capsys.readouterr().out
    assert "plain_c: OK backend=cxx device=cpu max_batch_size=16 batching=on inputs=[input FP32[8]]" in out
    assert "noinfer: UNAVAILABLE: model 'noinfer': shared library" in out and "nereid_infer" in out
    assert nereid_main(["cxx-header"]) == 0
    header = Path(capsys.readouterr().out.strip())
    assert header.name == "nereid_cxx.h" and header.parent == header_dir()
    text = header.read_text()
    for declaration in ("int nereid_infer(", "int nereid_load(", "void nereid_unload(", "typedef struct nereid_tensor"):
        assert declaration in text


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


@pytest.mark.skipif(CXX is None, reason="needs a C++ compiler")
def test_a_library_that_crashes_the_process_says_where(repo, tmp_path, caplog):
    """Found by a bug hunt: a cxx library whose static constructor crashed (or exited) ended `nereid check` and
    `nereid serve` with no word of which model; a crash in a call left the log at "is READY". The server now
    says which library it opens before it runs any of its code, and a crash prints every thread's stack."""
    import subprocess as sp

    source = tmp_path / "crash.cpp"
    source.write_text(CRASHING_CONSTRUCTOR)
    library = tmp_path / "libcrash.so"
    sp.run([CXX, "-shared", "-fPIC", str(source), "-o", str(library)], check=True)
    scale_model(repo, "crash")
    config = repo.write_config(entry("crash", f'{{library: "{library}"}}'))
    result = sp.run([*NEREID, "check", "--config", str(config)], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
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
