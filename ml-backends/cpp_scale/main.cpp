// Doubles every element of a float32 tensor: the subprocess tensor contract in C++.
// stdin: raw little-endian float32; NEREID_INPUT_SHAPE: e.g. "4,8";
// NEREID_OUTPUT_PATH: where to write "float32 4,8\n" followed by the raw result.
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

int main() {
    const char* shape_env = std::getenv("NEREID_INPUT_SHAPE");
    const char* out_path = std::getenv("NEREID_OUTPUT_PATH");
    if (shape_env == nullptr || out_path == nullptr) {
        std::cerr << "NEREID_INPUT_SHAPE and NEREID_OUTPUT_PATH must be set\n";
        return 2;
    }
    std::vector<char> raw((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
    std::vector<float> values(raw.size() / sizeof(float));
    std::copy(raw.begin(), raw.begin() + values.size() * sizeof(float), reinterpret_cast<char*>(values.data()));
    for (float& v : values) v *= 2.0f;

    std::FILE* out = std::fopen(out_path, "wb");
    if (out == nullptr) {
        std::perror("cannot open NEREID_OUTPUT_PATH");
        return 3;
    }
    std::string header = std::string("float32 ") + shape_env + "\n";
    std::fwrite(header.data(), 1, header.size(), out);
    std::fwrite(values.data(), sizeof(float), values.size(), out);
    return std::fclose(out) == 0 ? 0 : 4;
}
