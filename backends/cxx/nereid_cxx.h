/*
 * nereid_cxx.h -- the C ABI of nereid's in-process `cxx` backend.
 *
 * A cxx model is a shared library that exports `nereid_infer` (required) and,
 * optionally, `nereid_load` / `nereid_unload`, with C linkage. nereid dlopens
 * the library in the server process and calls these functions directly: no
 * copies, no child process, no serialization.
 *
 *   nereid.yaml:   - name: my_model
 *                    backend: cxx
 *                    runtime: {library: build/libmy_model.so}   # or {sources: [my_model.cpp]}
 *   build:         c++ -O2 -std=c++17 -shared -fPIC -fno-gnu-unique -I"$(dirname "$(nereid cxx-header)")" \
 *                      -o build/libmy_model.so my_model.cpp      (-fno-gnu-unique: GCC's; not with clang)
 *
 * LIFETIMES
 *   - nereid_load is called once per load, before any nereid_infer, on a worker
 *     thread. Whatever it stores in *state is passed back to every nereid_infer
 *     and to nereid_unload. Without nereid_load, state is NULL.
 *   - nereid_unload is called once, after the last nereid_infer has returned and
 *     before the library is dlclosed. Free everything nereid_load acquired; stop
 *     any thread the library started and leave no callback registered anywhere
 *     (atexit, signal handlers, thread-local destructors): the code is unmapped
 *     right afterwards.
 *     It is NOT called when nereid_load failed: clean up before returning the error.
 *   - Every load dlopens a fresh private copy of the library file, so rebuilding
 *     the library and reloading the model (RepositoryModelLoad, a restart) picks up
 *     the new code. Static variables therefore start afresh with each load;
 *     build with GCC's -fno-gnu-unique (nereid does when it builds from
 *     runtime.sources), or the function-local statics of inline functions and
 *     templates are bound process-wide (STB_GNU_UNIQUE) and outlive a reload.
 *   - Tensor memory belongs to the server and is valid only during the call:
 *     copy what you need to keep. Do not free it, do not store the pointers.
 *
 * THREADS
 *   - nereid_infer is called from server worker threads with the Python GIL
 *     released, by at most `instances` threads at once (nereid.yaml, default 1).
 *     With instances > 1 it MUST be thread-safe: concurrent calls share `state`.
 *   - The server never calls nereid_unload while a nereid_infer is running: a
 *     call still running when its model is unloaded (past the drain's grace)
 *     delays nereid_unload and the dlclose until it returns.
 *   - There is no time limit (timeout_s does not apply) and no way to cancel a
 *     call: a call that never returns holds its instance forever.
 *
 * ERRORS
 *   - Return 0 on success. Any other value is a model fault: the request fails
 *     with gRPC INTERNAL, carrying the text written to `error`.
 *   - `error` points to a zeroed buffer of error_size bytes (error_size >= 1).
 *     Write at most error_size bytes, NUL included; nereid_set_error below
 *     truncates safely. Text longer than the buffer is cut, never overrun.
 *   - nereid_load returning non-zero makes the model UNAVAILABLE with that text.
 *   - A crash (segfault, abort, an uncaught C++ exception escaping the C
 *     functions) takes the whole server down: that is the price of running
 *     in-process. Catch exceptions at the boundary. Use the `cpp` backend (one
 *     child process per batch) when a model must not be able to do that.
 *
 * TENSORS
 *   - Inputs arrive in the order of the textproto's input blocks (one "input"
 *     tensor in the single-tensor form), batch axis first when max_batch_size > 0
 *     (a request without it arrives as batch 1). Outputs are passed in
 *     textproto order, preallocated (zero-filled) with shape [batch, *dims], or
 *     [*dims] without batching: fill `data`, byte_size bytes. Do not change the
 *     output structs' fields (data, shape, byte_size); nereid checks.
 *   - Data is row-major (C order), little-endian, aligned for its dtype.
 *     `dtype` strings: "bool" (one byte, 0 or 1), "uint8", "uint16", "uint32",
 *     "uint64", "int8", "int16", "int32", "int64", "float16", "bfloat16",
 *     "float32", "float64". BYTES tensors and outputs with a -1 dimension are
 *     refused at load (the server could not preallocate them).
 */
#ifndef NEREID_CXX_H
#define NEREID_CXX_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define NEREID_CXX_API_VERSION 1

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define NEREID_EXPORT __declspec(dllexport)
#else
#define NEREID_EXPORT __attribute__((visibility("default")))
#endif

typedef struct nereid_tensor {
    const char    *name;       /* as declared in the textproto */
    const char    *dtype;      /* the contract dtype string: "float32", "int64", "bool", ... */
    int64_t        rank;
    const int64_t *shape;      /* batch axis first when the model batches */
    void          *data;       /* little-endian, row-major; inputs: read only */
    uint64_t       byte_size;
} nereid_tensor;

/* The ABI version the library was built against, exported so that nereid refuses a library built for
 * another version (one built before this symbol existed is taken as version 1). Weak: every source file
 * that includes this header defines it, and the linker keeps one. */
#if defined(__GNUC__)
#ifdef __cplusplus
extern
#endif
NEREID_EXPORT __attribute__((weak)) const uint32_t nereid_cxx_api_version = NEREID_CXX_API_VERSION;
#endif

/* Required. Run one batch: read `inputs`, write every output's data. 0: success. */
NEREID_EXPORT int nereid_infer(void *state,
                               const nereid_tensor *inputs, size_t n_inputs,
                               nereid_tensor *outputs, size_t n_outputs,
                               char *error, size_t error_size);

/* Optional. Prepare the model; store anything calls need in *state. 0: success.
 * model_folder is the absolute path of <ml_backends_path>/<model_name>, symbolic links resolved (a folder
 * reached through a link is named where it is; under a ConfigMap-style link swap, read what you need here). */
NEREID_EXPORT int nereid_load(const char *model_name, const char *model_folder, void **state,
                              char *error, size_t error_size);

/* Optional. Release what nereid_load acquired. */
NEREID_EXPORT void nereid_unload(void *state);

/* A printf-style helper for the error buffer: always NUL-terminated, truncated to fit. */
static inline void nereid_set_error(char *error, size_t error_size, const char *format, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
static inline void nereid_set_error(char *error, size_t error_size, const char *format, ...) {
    if (error == NULL || error_size == 0) return;
    va_list args;
    va_start(args, format);
    vsnprintf(error, error_size, format, args);
    va_end(args);
}

#ifdef __cplusplus
}
#endif

#endif /* NEREID_CXX_H */
