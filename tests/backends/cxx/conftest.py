"""The cxx backend's test libraries: real shared libraries built with c++, once per session (each test module
skips itself where no C++ compiler is installed)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from nereid.backends.cxx.build import header_dir
from tests.backends.cxx.cxx_support import CXX, TRIPLE

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


@pytest.fixture(scope="session")
def libs(tmp_path_factory) -> dict[str, Path]:
    """Every test library, compiled once, in parallel (read only: a test that changes one works on its copy)."""
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
