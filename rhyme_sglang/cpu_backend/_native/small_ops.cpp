// The small per-layer ops of a decode step, each one call instead of the 7-25 PyTorch ops (and
// their dispatch) that sglang's native CPU path runs: RMSNorm with or without the residual
// add, and rotary embedding of q and k. At decode's few rows they are all dispatch overhead
// (measured on an AVX2 EPYC, SmolLM2, one plain step at batch 1: ~20% of the step was the
// norms and rotary of sglang's forward_native).
//
// Each row is computed on its own, in an order that does not depend on the other rows, so the
// ops keep the row invariance of the native GEMM and attention (a verify tree's rows and plain
// decode rows get the same bits). Built without fast-math and with -ffp-contract=off:
// the rotary products and sums round as PyTorch's separate multiply and add do.
//
// Each op also takes bf16 rows (a bf16 model), computing in fp32 and rounding to bf16 where
// PyTorch's ops on bf16 tensors round. Called from rhyme_sglang/cpu_backend/small_ops.py with raw pointers to
// contiguous float32 (or bf16) tensors that Python checked; no torch headers are needed.

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "parts.h"
#include "vec.h"

namespace py = pybind11;

namespace {

using namespace rhyme_vec;

// Elements of fp32 and bf16 rows: widened to fp32 on load; narrow<T> rounds an fp32 result to
// T (exact for fp32; to nearest even for bf16), and rounded<T> gives the value a PyTorch op on
// T tensors leaves of its fp32 result (a bf16 op computes in fp32 and rounds).
[[gnu::always_inline]] inline float wide(float x) { return x; }
[[gnu::always_inline]] inline float wide(uint16_t x) { return bf16_to_f32(x); }
template <typename T> T narrow(float f);
template <> [[gnu::always_inline]] inline float narrow<float>(float f) { return f; }
template <> [[gnu::always_inline]] inline uint16_t narrow<uint16_t>(float f) { return f32_to_bf16(f); }
template <typename T>
[[gnu::always_inline]] inline float rounded(float f) { return wide(narrow<T>(f)); }

// Sum of squares of n floats: 8 lanes of partial sums over i = lane (mod 8), then the lanes
// and the tail in index order.
template <typename V>
[[gnu::always_inline]] inline float sum_squares(const float* x, int64_t n) {
    V acc = splatv<V>(0.f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const V v = loadv<V>(x + i);
        acc += v * v;
    }
    float total = 0.f;
    for (int lane = 0; lane < 8; ++lane) total += acc[lane];
    for (; i < n; ++i) total += x[i] * x[i];
    return total;
}

// As sglang's RMSNorm.forward_native: x (+ residual) summed in fp32, the sum (rounded to T) the
// new residual, normalised from the fp32 sum, times the weight, rounded to T once.
template <typename V, typename T>
[[gnu::always_inline]] inline void rmsnorm_rows(const T* x, const T* residual, const T* weight, T* out,
                                                T* residual_out, int64_t rows, int64_t n, float eps) {
    static thread_local std::vector<float> sum;  // kept between calls (no malloc a call)
    sum.resize(static_cast<size_t>(n));
    for (int64_t r = 0; r < rows; ++r) {
        const T* src = x + r * n;
        if (residual != nullptr) {
            const T* res = residual + r * n;
            for (int64_t i = 0; i < n; ++i) {
                sum[i] = wide(src[i]) + wide(res[i]);
                residual_out[r * n + i] = narrow<T>(sum[i]);
            }
        } else {
            for (int64_t i = 0; i < n; ++i) sum[i] = wide(src[i]);
        }
        const float scale = 1.f / std::sqrt(sum_squares<V>(sum.data(), n) / static_cast<float>(n) + eps);
        for (int64_t i = 0; i < n; ++i) out[r * n + i] = narrow<T>((sum[i] * scale) * wide(weight[i]));
    }
}

template <typename T>
__attribute__((target("avx2"))) void rmsnorm_avx2(const T* x, const T* residual, const T* weight, T* out,
                                                  T* residual_out, int64_t rows, int64_t n, float eps) {
    rmsnorm_rows<v8f>(x, residual, weight, out, residual_out, rows, n, eps);
}

template <typename T>
void rmsnorm_default(const T* x, const T* residual, const T* weight, T* out, T* residual_out, int64_t rows,
                     int64_t n, float eps) {
    rmsnorm_rows<v8f>(x, residual, weight, out, residual_out, rows, n, eps);
}

// out = rmsnorm(x [+ residual]) * weight; with a residual, residual_out = x + residual.
template <typename T>
void rmsnorm_kernel(const T* x, const T* residual, const T* weight, T* out, T* residual_out, int64_t rows,
                    int64_t n, float eps) {
    if (rows < 0 || n <= 0) throw std::invalid_argument("rmsnorm needs rows >= 0 and n > 0");
    if (residual != nullptr && residual_out == nullptr)
        throw std::invalid_argument("a residual needs residual_out");
    static const bool avx2 = __builtin_cpu_supports("avx2");
    (avx2 ? rmsnorm_avx2<T> : rmsnorm_default<T>)(x, residual, weight, out, residual_out, rows, n, eps);
}

template <typename T>
void rmsnorm(uintptr_t x, uintptr_t residual, uintptr_t weight, uintptr_t out, uintptr_t residual_out,
             int64_t rows, int64_t n, double eps) {
    py::gil_scoped_release release;
    rmsnorm_kernel(reinterpret_cast<const T*>(x), reinterpret_cast<const T*>(residual),
                   reinterpret_cast<const T*>(weight), reinterpret_cast<T*>(out), reinterpret_cast<T*>(residual_out),
                   rows, n, static_cast<float>(eps));
}

// Rotary embedding of `heads` heads of head_size elements per token: token t's heads start at
// src + t * src_stride (a row of q or k inside a fused qkv row, say) and go to dst + t * heads
// * head_size. The first rot_dim dims are rotated, the rest copied: neox style rotates
// (i, i + rot/2) pairs, GPT-J style (2i, 2i + 1). cos_sin [positions][rot_dim] (of T): cos in
// the first half, sin in the second. Every product and sum is rounded to T, as PyTorch's
// separate ops on T tensors round them (a product of two bf16 is exact in fp32): the same bits.
// o[a(i)], o[b(i)] <- the pair (x[a(i)], x[b(i)]) rotated by (cos[i], sin[i]), for i < half.
template <typename T, typename A, typename B>
[[gnu::always_inline]] inline void rotate_pairs(const T* x, T* o, const T* cos, const T* sin, int64_t half, A a,
                                                B b) {
    for (int64_t i = 0; i < half; ++i) {
        const float x1 = wide(x[a(i)]), x2 = wide(x[b(i)]), c = wide(cos[i]), sn = wide(sin[i]);
        o[a(i)] = narrow<T>(rounded<T>(x1 * c) - rounded<T>(x2 * sn));
        o[b(i)] = narrow<T>(rounded<T>(x2 * c) + rounded<T>(x1 * sn));
    }
}

template <typename T>
void rotate_rows(const T* src, int64_t src_stride, T* dst, const int64_t* positions, const T* cos_sin,
                 int64_t tokens, int64_t heads, int64_t head_size, int64_t rot_dim, bool neox) {
    const int64_t half = rot_dim / 2;
    for (int64_t t = 0; t < tokens; ++t) {
        const T* cos = cos_sin + positions[t] * rot_dim;
        const T* sin = cos + half;
        for (int64_t h = 0; h < heads; ++h) {
            const T* x = src + t * src_stride + h * head_size;
            T* o = dst + (t * heads + h) * head_size;
            if (neox)  // contiguous halves: the pair loop vectorizes
                rotate_pairs(x, o, cos, sin, half, [](int64_t i) { return i; },
                             [half](int64_t i) { return i + half; });
            else
                rotate_pairs(x, o, cos, sin, half, [](int64_t i) { return 2 * i; },
                             [](int64_t i) { return 2 * i + 1; });
            for (int64_t i = rot_dim; i < head_size; ++i) o[i] = x[i];
        }
    }
}

template <typename T>
__attribute__((target("avx2"))) void rotate_rows_avx2(const T* src, int64_t src_stride, T* dst, const int64_t* positions,
                                                      const T* cos_sin, int64_t tokens, int64_t heads,
                                                      int64_t head_size, int64_t rot_dim, bool neox) {
    rotate_rows(src, src_stride, dst, positions, cos_sin, tokens, heads, head_size, rot_dim, neox);
}

constexpr int64_t kOneThread = 8 * 1024;  // fewer elements than this: the caller alone

// Tokens are independent, so a split of them into parts on up to `threads` threads changes no bit.
template <typename T>
void rotary_kernel(const int64_t* pos, const T* q, int64_t q_stride, const T* k, int64_t k_stride, T* q_out,
                   T* k_out, const T* table, int64_t table_rows, int64_t tokens, int64_t q_heads,
                   int64_t k_heads, int64_t head_size, int64_t rot_dim, bool neox, int64_t threads) {
    if (tokens < 0 || head_size <= 0 || rot_dim <= 0 || rot_dim > head_size || rot_dim % 2)
        throw std::invalid_argument("rotary needs 0 < rot_dim <= head_size, rot_dim even");
    if (q_stride < q_heads * head_size || k_stride < k_heads * head_size)
        throw std::invalid_argument("a row stride is shorter than its row");
    for (int64_t t = 0; t < tokens; ++t)
        if (pos[t] < 0 || pos[t] >= table_rows)
            throw std::out_of_range("position " + std::to_string(pos[t]) + " is outside the rotary table of " +
                                    std::to_string(table_rows) + " positions");
    static const bool avx2 = __builtin_cpu_supports("avx2");
    const auto rotate = avx2 ? rotate_rows_avx2<T> : rotate_rows<T>;
    auto some = [&](int64_t t0, int64_t t1) {
        rotate(q + t0 * q_stride, q_stride, q_out + t0 * q_heads * head_size, pos + t0, table, t1 - t0, q_heads,
               head_size, rot_dim, neox);
        rotate(k + t0 * k_stride, k_stride, k_out + t0 * k_heads * head_size, pos + t0, table, t1 - t0, k_heads,
               head_size, rot_dim, neox);
    };
    if (tokens * (q_heads + k_heads) * head_size < kOneThread || threads <= 1) {
        some(0, tokens);
        return;
    }
    const int64_t parts = rhyme_parts::parts_for(tokens, threads);
    rhyme_parts::run_in_parts(parts, threads,
                              [&](int64_t part) { some(tokens * part / parts, tokens * (part + 1) / parts); });
}

template <typename T>
void rotary(uintptr_t positions, uintptr_t q, int64_t q_stride, uintptr_t k, int64_t k_stride,
            uintptr_t q_out, uintptr_t k_out, uintptr_t cos_sin, int64_t table_rows, int64_t tokens,
            int64_t q_heads, int64_t k_heads, int64_t head_size, int64_t rot_dim, bool neox, int64_t threads) {
    py::gil_scoped_release release;
    rotary_kernel(reinterpret_cast<const int64_t*>(positions), reinterpret_cast<const T*>(q), q_stride,
                  reinterpret_cast<const T*>(k), k_stride, reinterpret_cast<T*>(q_out), reinterpret_cast<T*>(k_out),
                  reinterpret_cast<const T*>(cos_sin), table_rows, tokens, q_heads, k_heads, head_size, rot_dim,
                  neox, threads);
}

// SiLU-and-mul of a fused gate/up row: out[r][i] = silu(x[r][i]) * x[r][d + i], with
// silu(g) = g * sigmoid(g) and sigmoid from e = exp(-|g|) (expv of vec.h, ~1e-7 relative), so
// nothing overflows: 1 / (1 + e) for g >= 0, e / (1 + e) below. Each element depends only on
// its own two inputs, and every lane runs the same operations (this file is built without FMA
// contraction), so the 8-lane (AVX2, portable) and 16-lane (AVX-512) builds give the same
// bits. In bf16, as F.silu(gate) * up on bf16 tensors: silu rounded, then the product. A row's
// tail goes through the same vector code, lanes unused.
template <typename V>
[[gnu::always_inline]] inline V siluv(V g) {
    const V zero = splatv<V>(0.f), one = splatv<V>(1.f);
    const V e = expv<V>(g < zero ? g : -g);
    return g * (g >= zero ? one / (one + e) : e / (one + e));
}

// Lanes rounded to T and stored, lane by lane as narrow<T>() does (bf16: bf16_halves of vec.h);
// roundv<T> is narrow then wide.
template <typename V>
[[gnu::always_inline]] inline void storev_as(float* p, V v) { storev<V>(p, v); }
template <typename V>
[[gnu::always_inline]] inline void storev_as(uint16_t* p, V v) {
    const typename Bits<V>::H h = bf16_halves(v);
    std::memcpy(p, &h, sizeof h);
}
template <typename T, typename V>
[[gnu::always_inline]] inline V roundv(V v) {
    if constexpr (std::is_same_v<T, float>) {
        return v;
    } else {
        const typename Bits<V>::U bits = bf16_lanes(v) << 16;
        V f;
        std::memcpy(&f, &bits, sizeof f);
        return f;
    }
}

// Columns [c0, c1) of rows [r0, r1) (c0 a multiple of V's lanes).
template <typename T, typename V>
[[gnu::always_inline]] inline void silu_mul_block(const T* x, T* out, int64_t d, int64_t r0, int64_t r1, int64_t c0,
                                                  int64_t c1) {
    constexpr int64_t L = sizeof(V) / sizeof(float);
    for (int64_t r = r0; r < r1; ++r) {
        const T* gate = x + r * 2 * d;
        const T* up = gate + d;
        T* o = out + r * d;
        int64_t i = c0;
        for (; i + L <= c1; i += L)  // whole groups in vector registers
            storev_as<V>(o + i, roundv<T, V>(siluv<V>(load_as_f32<V>(gate + i))) * load_as_f32<V>(up + i));
        if (i < c1) {  // the tail: zero-padded copies through the same line, lanes past it unused
            T g[L] = {}, u[L] = {}, out_l[L];
            std::copy(gate + i, gate + c1, g);
            std::copy(up + i, up + c1, u);
            storev_as<V>(out_l, roundv<T, V>(siluv<V>(load_as_f32<V>(g))) * load_as_f32<V>(u));
            std::copy(out_l, out_l + (c1 - i), o + i);
        }
    }
}

template <typename T>
__attribute__((target("avx512f"))) void silu_mul_avx512(const T* x, T* out, int64_t d, int64_t r0, int64_t r1,
                                                        int64_t c0, int64_t c1) {
    silu_mul_block<T, v16f>(x, out, d, r0, r1, c0, c1);
}

template <typename T>
__attribute__((target("avx2"))) void silu_mul_avx2(const T* x, T* out, int64_t d, int64_t r0, int64_t r1, int64_t c0,
                                                   int64_t c1) {
    silu_mul_block<T, v8f>(x, out, d, r0, r1, c0, c1);
}

template <typename T>
void silu_mul_default(const T* x, T* out, int64_t d, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
    silu_mul_block<T, v8f>(x, out, d, r0, r1, c0, c1);
}

constexpr int64_t kSiluChunk = 256;           // columns of a part (a multiple of 16)

// Each element depends only on its own two inputs, so the split into parts (rows x column
// chunks, on up to `threads` threads) does not change a bit.
template <typename T>
void silu_mul_kernel(const T* x, T* out, int64_t rows, int64_t d, int64_t threads) {
    if (rows < 0 || d <= 0) throw std::invalid_argument("silu_mul needs rows >= 0 and d > 0");
    static const bool avx512 = __builtin_cpu_supports("avx512f"), avx2 = __builtin_cpu_supports("avx2");
    const auto block = avx512 ? silu_mul_avx512<T> : avx2 ? silu_mul_avx2<T> : silu_mul_default<T>;
    if (rows * d < kOneThread || threads <= 1) {
        block(x, out, d, 0, rows, 0, d);
        return;
    }
    const int64_t chunks = (d + kSiluChunk - 1) / kSiluChunk, units = rows * chunks;
    const int64_t parts = rhyme_parts::parts_for(units, threads);
    rhyme_parts::run_in_parts(parts, threads, [&](int64_t part) {
        for (int64_t u = units * part / parts; u < units * (part + 1) / parts; ++u) {
            const int64_t r = u / chunks, c0 = (u % chunks) * kSiluChunk;
            block(x, out, d, r, r + 1, c0, std::min(d, c0 + kSiluChunk));
        }
    });
}

template <typename T>
void silu_mul(uintptr_t x, uintptr_t out, int64_t rows, int64_t d, int64_t threads) {
    py::gil_scoped_release release;
    silu_mul_kernel(reinterpret_cast<const T*>(x), reinterpret_cast<T*>(out), rows, d, threads);
}

const rhyme_kernels::Ops kKernels{rhyme_kernels::kVersion,       &rmsnorm_kernel<float>,
                                  &rotary_kernel<float>,         &silu_mul_kernel<float>,
                                  &rmsnorm_kernel<uint16_t>,     &rotary_kernel<uint16_t>,
                                  &silu_mul_kernel<uint16_t>};

}  // namespace

PYBIND11_MODULE(_rhyme_ops, m) {
    rhyme_parts::share_pool();
    m.doc() = "RMSNorm, rotary embedding and SiLU-and-mul for few-row CPU steps (see small_ops.cpp)";
    m.def("rmsnorm", &rmsnorm<float>);
    m.def("rotary", &rotary<float>);
    m.def("silu_mul", &silu_mul<float>);
    m.def("rmsnorm_bf16", &rmsnorm<uint16_t>);
    m.def("rotary_bf16", &rotary<uint16_t>);
    m.def("silu_mul_bf16", &silu_mul<uint16_t>);
    m.attr("_kernels") = py::capsule(&kKernels, "rhyme_kernels::Ops");
}
