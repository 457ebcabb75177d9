// Portable SIMD helpers shared by the CPU kernels: GCC vector types of 8 and 16 floats (and of
// their bf16 / bit patterns), and
// load / store / broadcast for either, bf16 <-> fp32, and exp of 8 non-positive floats. Each kernel instantiates its templates inside functions
// built for one ISA (target attributes), so the same source compiles to ymm or zmm code.
#pragma once

#include <cstdint>
#include <cstring>

#pragma GCC diagnostic ignored "-Wpsabi"  // vectors never cross a non-inlined call boundary

namespace rhyme_vec {

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint16_t v16h __attribute__((vector_size(32)));

template <int W> struct Lanes;
template <> struct Lanes<16> { typedef v16f type; };
template <> struct Lanes<8> { typedef v8f type; };
template <typename V> struct IntLanes;  // the int32 vector as wide as V
template <> struct IntLanes<v8f> { typedef v8i type; };
template <> struct IntLanes<v16f> { typedef v16i type; };

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

// bf16 <-> fp32, one value. A bf16 is the high half of an fp32; fp32 -> bf16 rounds to
// nearest even, as torch's conversion does (a NaN becomes 0x7FC0).
[[gnu::always_inline]] inline float bf16_to_f32(uint16_t x) {
    const uint32_t bits = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

// 8 or 16 bf16 values at p as fp32 lanes (exact: each one's bits to the top half).
template <typename H, typename U, typename V>
[[gnu::always_inline]] inline V widen_bf16(const uint16_t* p) {
    H h;
    std::memcpy(&h, p, sizeof h);
    const U bits = __builtin_convertvector(h, U) << 16;
    V f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}
template <typename V> V loadv_bf16(const uint16_t* p);
template <>
[[gnu::always_inline]] inline v8f loadv_bf16<v8f>(const uint16_t* p) { return widen_bf16<v8h, v8u, v8f>(p); }
template <>
[[gnu::always_inline]] inline v16f loadv_bf16<v16f>(const uint16_t* p) { return widen_bf16<v16h, v16u, v16f>(p); }

// A vector of fp32 lanes from fp32 or bf16 elements, by the pointer's type (kernels templated
// on their rows' element type).
template <typename V>
[[gnu::always_inline]] inline V load_as_f32(const float* p) { return loadv<V>(p); }
template <typename V>
[[gnu::always_inline]] inline V load_as_f32(const uint16_t* p) { return loadv_bf16<V>(p); }

// The bf16 of fp32 bits, in the low half: to nearest even, a NaN to 0x7FC0 (torch's rule). U is
// uint32_t or a vector of them (lane by lane); a select, not a branch, so loops vectorize.
template <typename U>
[[gnu::always_inline]] inline U bf16_bits(U bits) {
    const U rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    return (bits & 0x7FFFFFFFu) > 0x7F800000u ? U{} + 0x7FC0u : rounded;
}

// The uint32 and bf16 vectors as wide as V.
template <typename V> struct Bits;
template <> struct Bits<v8f> { typedef v8u U; typedef v8h H; };
template <> struct Bits<v16f> { typedef v16u U; typedef v16h H; };

// Each lane's bf16 (bf16_bits), in the low half of a uint32 lane / as a vector of bf16.
template <typename V>
[[gnu::always_inline]] inline typename Bits<V>::U bf16_lanes(V v) {
    typename Bits<V>::U bits;
    std::memcpy(&bits, &v, sizeof bits);
    return bf16_bits(bits);
}
template <typename V>
[[gnu::always_inline]] inline typename Bits<V>::H bf16_halves(V v) {
    return __builtin_convertvector(bf16_lanes(v), typename Bits<V>::H);
}

[[gnu::always_inline]] inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    return static_cast<uint16_t>(bf16_bits(bits));
}

// f rounded to bf16 and widened back: what a PyTorch op on bf16 tensors leaves of its fp32 result.
[[gnu::always_inline]] inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

// exp(x) lane by lane for x <= 0 (scores minus their row maximum): Cody-Waite reduction to
// r in [-ln2/2, ln2/2], a degree-6 Taylor polynomial (relative error ~1e-7), and the power of
// two through the exponent bits; x below -87 gives 0. Each lane's result depends only on its x,
// so the 8- and 16-lane forms agree lane for lane (built without FMA contraction).
template <typename V>
[[gnu::always_inline]] inline V expv(V x) {
    typedef typename IntLanes<V>::type I;
    const V lo = splatv<V>(-87.f);
    const I dead = x < lo;
    x = x < lo ? lo : x;
    const V shift = splatv<V>(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
    const V n = (x * splatv<V>(1.44269504088896341f) + shift) - shift;
    V r = x - n * splatv<V>(0.693359375f);
    r = r - n * splatv<V>(-2.12194440e-4f);
    V p = splatv<V>(1.f / 720.f);
    p = p * r + splatv<V>(1.f / 120.f);
    p = p * r + splatv<V>(1.f / 24.f);
    p = p * r + splatv<V>(1.f / 6.f);
    p = p * r + splatv<V>(0.5f);
    p = p * r + splatv<V>(1.f);
    p = p * r + splatv<V>(1.f);
    const I bits = (__builtin_convertvector(n, I) + 127) << 23;
    V scale;
    std::memcpy(&scale, &bits, sizeof scale);
    const V out = p * scale;
    return dead ? splatv<V>(0.f) : out;
}
[[gnu::always_inline]] inline v8f exp8(v8f x) { return expv<v8f>(x); }

}  // namespace rhyme_vec
