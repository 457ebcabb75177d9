// Portable SIMD helpers shared by the CPU kernels: GCC vector types of 8 and 16 floats, and
// load / store / broadcast for either. Each kernel instantiates its templates inside functions
// built for one ISA (target attributes), so the same source compiles to ymm or zmm code.
#pragma once

#include <cstdint>
#include <cstring>

#pragma GCC diagnostic ignored "-Wpsabi"  // vectors never cross a non-inlined call boundary

namespace rhyme_vec {

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v16f __attribute__((vector_size(64)));

template <int W> struct Lanes;
template <> struct Lanes<16> { typedef v16f type; };
template <> struct Lanes<8> { typedef v8f type; };

template <typename V>
[[gnu::always_inline]] inline V loadv(const float* p) {
    V x;
    std::memcpy(&x, p, sizeof x);
    return x;
}

template <typename V>
[[gnu::always_inline]] inline void storev(float* p, V x) { std::memcpy(p, &x, sizeof x); }

// A scalar in every lane, written as a shuffle so that it compiles to one vbroadcastss (an
// element-by-element fill compiles to a chain of inserts: 2.5x slower in the GEMM on AVX2).
template <typename V> V splatv(float x);
template <>
[[gnu::always_inline]] inline v8f splatv<v8f>(float x) {
    const v8f v = {x};
    return __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0);
}
template <>
[[gnu::always_inline]] inline v16f splatv<v16f>(float x) {
    const v16f v = {x};
    return __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
}

}  // namespace rhyme_vec
