// Doubles every element of a float32 tensor: cpp_scale as an in-process cxx library.
// nereid builds it at load (runtime.sources in nereid.yaml); by hand:
//   c++ -O2 -std=c++17 -shared -fPIC -fno-gnu-unique -I"$(dirname "$(nereid cxx-header)")" -o libscale.so scale.cpp
//   (-fno-gnu-unique is GCC's: leave it out with clang)
#include <cstring>

#include "nereid_cxx.h"

// Stateless and reentrant, so any number of instances may call it at once.
extern "C" int nereid_infer(void* /*state*/, const nereid_tensor* inputs, size_t n_inputs,
                            nereid_tensor* outputs, size_t n_outputs, char* error, size_t error_size) {
    if (n_inputs != 1 || n_outputs != 1 || std::strcmp(inputs[0].dtype, "float32") != 0 ||
        inputs[0].byte_size != outputs[0].byte_size) {
        nereid_set_error(error, error_size, "cxx_scale expects one float32 input and an output of its size");
        return 1;
    }
    const float* in = static_cast<const float*>(inputs[0].data);
    float* out = static_cast<float*>(outputs[0].data);
    const size_t count = inputs[0].byte_size / sizeof(float);
    for (size_t i = 0; i < count; ++i) out[i] = in[i] * 2.0f;
    return 0;
}
