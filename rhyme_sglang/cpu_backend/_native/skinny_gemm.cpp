// fp32 products with few rows, y[M, N] = x[M, K] @ w[N, K]^T (+ bias), for the decode and
// verify steps of a small model on CPU, where M is 1 to a few dozen and the weight is streamed
// from memory once per step.
//
// The weight is packed once into panels of P = 2W output columns, panel-major, [N/P][K][P]
// (zero-padded to a whole panel), so a panel is read front to back as one stream, and every
// row of x passes over it while it is in cache. A micro-kernel keeps NR rows x 2 vectors of
// accumulators in registers and, for each k in order, loads the panel's two vectors once,
// broadcasts x[r][k] and adds the products: each output element is a single running sum over
// k = 0 .. K-1 in order, in its own lane. The first row tile of a panel prefetches the panel
// stream kAhead steps of k ahead (every cache line of the step); with a few more rows than a tile, the tiles take turns over
// short blocks of k (run_panels).
//
// So a row's result does not depend on how many other rows share the call or where the row
// sits among them: the same input row gives the same bits at M = 1 (a decode step) and as one
// of the rows of a verify tree. With the native paged attention (which has the same property)
// this is what makes a verify step's rows bit-identical to plain decode of the same tokens.
//
// ISA builds, chosen once by __builtin_cpu_supports: AVX-512 (W = 16, 12-row tiles), AVX2 with
// FMA (W = 8, 6-row tiles), and a portable build. The file is compiled with FMA contraction
// allowed (-ffp-contract=fast), so the AVX-512 and AVX2 builds both compute fma(x, w, acc) per
// element and should agree bit for bit (not yet checked on an AVX-512 CPU); the portable build
// rounds the product and the sum separately. Row invariance holds within any one build.
//
// bf16 weights and activations (y rounded to bf16 once, at the end) run the same panels and
// tiles with two k per step: a 32-bit lane of a panel holds w[c][2j] and w[c][2j + 1], a row's
// x[2j], x[2j + 1] are broadcast as one 32-bit word, and vdpbf16ps adds both products to the
// lane's fp32 sum (AVX512_BF16 only: bf16_kernel() is false elsewhere, and linear.py keeps
// bf16 weights on oneDNN). The bf16 panel is half the bytes of the fp32 one, which is what a
// memory-bound decode step pays for. Each output is still one running sum over k in order, in
// its own lane, so a row's bits do not depend on the other rows. The sum is rounded to bf16
// to nearest even, as torch's float -> bfloat16 conversion rounds (NaN -> 0x7FC0).
//
// Called from rhyme_sglang/cpu_backend/linear.py with raw pointers to contiguous float32 (or
// bf16) tensors that Python checked; no torch headers are needed to build it.

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "kernels.h"
#include "parts.h"
#include "vec.h"

namespace py = pybind11;

namespace {

using namespace rhyme_vec;

// Bumped when the kernel's speed changes: linear.py measures its choices again under it.
// 2: row tiles take turns over blocks of k; 3: only up to kMaxBlockedRows rows; 4: bf16;
// 5: the AVX-512 build prefetches both cache lines of a step (it prefetched the first only:
// issue 52, 2-core avx512_bf16 EPYC, SmolLM2's 30 layers streamed, 2 threads, in-process A/B:
// bf16 1 / 8 / 16 rows 9.1 / 10.7 / 18.3 -> 7.6 / 7.9 / 12.4 ms, fp32 16.1 / 18.6 / 35.1 ->
// 14.8 / 14.2 / 23.6 ms); 6: up to pair_rows() rows take two panels at a time; 7: no blocks of
// k on AVX-512 (blocked_rows()).
constexpr int kRevision = 7;
constexpr int64_t kAhead = 32;  // k steps of the panel stream prefetched ahead
constexpr int64_t kBlock = 32;  // k steps of a panel that every row tile passes before the next
constexpr int64_t kMaxBlockedRows = 24;  // more rows than this run each tile over the whole of k

// Rows up to which the tiles take turns over blocks of k (run_panels): kMaxBlockedRows with
// AVX2's 6-row tiles, where the blocks were measured to pay, none with AVX-512's 12-row tiles.
// On a 2-core avx512_bf16 EPYC (SmolLM2's 30 layers and lm_head streamed, 2 threads, two
// alternated rounds) the blocks made 16 / 18 / 24 rows slower: bf16 17.5-18.3 / 19.1-20.8 /
// 25.0-26.5 ms against 15.3-16.1 / 16.8-17.6 / 21.2-23.1 without, fp32 34.8-39.3 / 37.4-43.3 /
// 50.3-52.0 against 28.5-29.6 / 31.3-31.4 / 40.1-40.6; 9-12 and 36 rows the same either way.
template <int W>
constexpr int64_t blocked_rows() { return W == 16 ? 0 : kMaxBlockedRows; }

// In 32-bit words: a step of k is one word of x and one word per panel column (fp32: one k;
// bf16: a pair of k), so the fp32 and bf16 products share the layout and the loops below.
struct Problem {
    const float* x;       // [M, K], row stride K (words)
    const float* panels;  // [N_pad / P][K][P] (words)
    const float* bias;    // [N] or null (fp32)
    void* y;              // [M, N], row stride N (float or bf16 elements)
    int64_t m, n, k;      // k: steps (fp32: K; bf16: K / 2)
};

// The fp32 product: per step acc += x[k] * w[k], lane by lane (an FMA where the build fuses).
struct Fp32 {
    template <typename V>
    [[gnu::always_inline]] static inline V madd(V acc, V w, float x) { return acc + splatv<V>(x) * w; }
    // n values of v to out[0 .. n)
    template <typename V>
    [[gnu::always_inline]] static inline void put(void* y, int64_t at, V v, int64_t n) {
        if (n == static_cast<int64_t>(sizeof(V) / sizeof(float))) {
            storev<V>(static_cast<float*>(y) + at, v);
            return;
        }
        alignas(64) float buf[sizeof(V) / sizeof(float)];
        storev<V>(buf, v);
        std::memcpy(static_cast<float*>(y) + at, buf, n * sizeof(float));
    }
};

// The bf16 product: per step acc += x[2j] w[2j] + x[2j+1] w[2j+1] (vdpbf16ps: each bf16
// product is exact in fp32, the adds round to nearest even, denormals read and written as 0).
// Written as inline assembly so that the shared templates need no bf16 target of their own;
// only instantiated inside the AVX512_BF16 build below.
struct Bf16 {
    [[gnu::always_inline]] static inline v16f madd(v16f acc, v16f w, float x_pair) {
        const v16f x = splatv<v16f>(x_pair);  // the pair's bits in every lane
        asm("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
        return acc;
    }
    // fp32 -> bf16 to nearest even (torch's rounding; a NaN becomes 0x7FC0)
    [[gnu::always_inline]] static inline void put(void* y, int64_t at, v16f v, int64_t n) {
        const v16h out = bf16_halves(v);
        std::memcpy(static_cast<uint16_t*>(y) + at, &out, n * sizeof(uint16_t));
    }
};

// y[r0 .. r0 + NR][c0 .. c0 + valid) <- the finished sums (+ bias).
template <int W, int NR, typename S, typename V>
[[gnu::always_inline]] inline void put_sums(const Problem& p, int64_t r0, int64_t c0, int64_t valid, const V* lo,
                                            const V* hi) {
    V blo = splatv<V>(0.f), bhi = splatv<V>(0.f);
    const bool has_bias = p.bias != nullptr;
    alignas(64) float buf[2 * W];
    if (has_bias) {
        std::memset(buf, 0, sizeof buf);
        std::memcpy(buf, p.bias + c0, valid * sizeof(float));
        blo = loadv<V>(buf);
        bhi = loadv<V>(buf + W);
    }
    for (int r = 0; r < NR; ++r) {
        const int64_t at = (r0 + r) * p.n + c0;
        const V l = has_bias ? lo[r] + blo : lo[r], h = has_bias ? hi[r] + bhi : hi[r];
        S::put(p.y, at, l, std::min<int64_t>(valid, W));
        if (valid > W) S::put(p.y, at + W, h, valid - W);
    }
}

// Rows r0 .. r0 + NR of one panel (columns c0 .. c0 + 2W, of which `valid` are real), over
// steps of k in [k0, k1). A tile that does not start at k = 0 resumes its sums from `acc`
// ([NR][2W]), one that does not end at K leaves them there; otherwise they go to y (plus bias).
template <int W, int NR, typename S>
[[gnu::always_inline]] inline void tile(const Problem& p, const float* panel, int64_t r0, int64_t c0,
                                        int64_t valid, int64_t k0, int64_t k1, float* acc,
                                        bool prefetch) {
    typedef typename Lanes<W>::type V;
    V lo[NR], hi[NR];
    if (k0 == 0) {
        for (int r = 0; r < NR; ++r) lo[r] = hi[r] = splatv<V>(0.f);
    } else {
        for (int r = 0; r < NR; ++r) {
            lo[r] = loadv<V>(acc + r * 2 * W);
            hi[r] = loadv<V>(acc + r * 2 * W + W);
        }
    }
    const float* xr[NR];
    for (int r = 0; r < NR; ++r) xr[r] = p.x + (r0 + r) * p.k;
    for (int64_t kk = k0; kk < k1; ++kk) {
        if (prefetch) {  // both cache lines of the step (AVX-512: 2 x 64 bytes; AVX2: one line)
            __builtin_prefetch(panel + (kk + kAhead) * 2 * W, 0, 3);
            if constexpr (W == 16) __builtin_prefetch(panel + (kk + kAhead) * 2 * W + W, 0, 3);
        }
        const V a = loadv<V>(panel + kk * 2 * W), b = loadv<V>(panel + kk * 2 * W + W);
        for (int r = 0; r < NR; ++r) {
            lo[r] = S::madd(lo[r], a, xr[r][kk]);
            hi[r] = S::madd(hi[r], b, xr[r][kk]);
        }
    }
    if (k1 < p.k) {
        for (int r = 0; r < NR; ++r) {
            storev<V>(acc + r * 2 * W, lo[r]);
            storev<V>(acc + r * 2 * W + W, hi[r]);
        }
        return;
    }
    put_sums<W, NR, S>(p, r0, c0, valid, lo, hi);
}

// All NR rows (NR <= pair_rows<W>()) of panels pi and pi + 1 at once, over the whole of k: twice
// the independent sums of a one-panel tile, and two streams in flight, for the few-row steps
// that would otherwise wait on one chain of adds per register. Each output is still one
// running sum over k in order in its own lane: the same bits as tile().
template <int W, int NR, typename S>
[[gnu::always_inline]] inline void tile_pair(const Problem& p, int64_t pi) {
    typedef typename Lanes<W>::type V;
    constexpr int64_t P = 2 * W;
    const float* pa = p.panels + pi * p.k * P;
    const float* pb = pa + p.k * P;
    V alo[NR], ahi[NR], blo[NR], bhi[NR];
    for (int r = 0; r < NR; ++r) alo[r] = ahi[r] = blo[r] = bhi[r] = splatv<V>(0.f);
    const float* xr[NR];
    for (int r = 0; r < NR; ++r) xr[r] = p.x + r * p.k;
    for (int64_t kk = 0; kk < p.k; ++kk) {
        __builtin_prefetch(pa + (kk + kAhead) * P, 0, 3);
        __builtin_prefetch(pb + (kk + kAhead) * P, 0, 3);
        if constexpr (W == 16) {
            __builtin_prefetch(pa + (kk + kAhead) * P + W, 0, 3);
            __builtin_prefetch(pb + (kk + kAhead) * P + W, 0, 3);
        }
        const V a0 = loadv<V>(pa + kk * P), a1 = loadv<V>(pa + kk * P + W);
        const V b0 = loadv<V>(pb + kk * P), b1 = loadv<V>(pb + kk * P + W);
        for (int r = 0; r < NR; ++r) {
            alo[r] = S::madd(alo[r], a0, xr[r][kk]);
            ahi[r] = S::madd(ahi[r], a1, xr[r][kk]);
            blo[r] = S::madd(blo[r], b0, xr[r][kk]);
            bhi[r] = S::madd(bhi[r], b1, xr[r][kk]);
        }
    }
    const int64_t ca = pi * P, cb = ca + P;
    put_sums<W, NR, S>(p, 0, ca, std::min<int64_t>(P, p.n - ca), alo, ahi);
    put_sums<W, NR, S>(p, 0, cb, std::min<int64_t>(P, p.n - cb), blo, bhi);
}

// Rows that tile_pair takes: its 4 * NR sums and 4 loaded vectors fit the registers (32 on
// AVX-512, 16 on AVX2).
template <int W>
constexpr int64_t pair_rows() { return W == 16 ? 4 : 2; }

// Every row tile of one panel over k in [k0, k1); the first tile prefetches.
template <int W, int NR, typename S>
[[gnu::always_inline]] inline void run_block(const Problem& p, const float* panel, int64_t c0, int64_t valid,
                                             int64_t k0, int64_t k1, float* acc) {
    int64_t r0 = 0;
    for (; r0 + NR <= p.m; r0 += NR)
        tile<W, NR, S>(p, panel, r0, c0, valid, k0, k1, acc + r0 * 2 * W, r0 == 0);
    switch (p.m - r0) {  // the last rows: a tile of exactly that many
#define RHYME_TAIL(R) \
    case R: if constexpr (R < NR) tile<W, R, S>(p, panel, r0, c0, valid, k0, k1, acc + r0 * 2 * W, r0 == 0); break;
        RHYME_TAIL(1) RHYME_TAIL(2) RHYME_TAIL(3) RHYME_TAIL(4) RHYME_TAIL(5) RHYME_TAIL(6)
        RHYME_TAIL(7) RHYME_TAIL(8) RHYME_TAIL(9) RHYME_TAIL(10) RHYME_TAIL(11)
#undef RHYME_TAIL
        default: break;
    }
}

// Panels [p0, p1) for every row. With more rows than one tile (up to blocked_rows()), every
// tile passes a block of kBlock steps of k (a few KB of the panel, found in L1 by all but the
// first tile) before any goes on, keeping its sums in `sums` between blocks: the first tile's
// prefetches then stream the panel from memory while the others compute, instead of memory
// idling while later tiles re-read a whole panel from L2. Storing a sum and loading it back is
// exact, so each output is still one running sum over k in order. Measured on an AVX2 EPYC
// (2 threads), the 30 layers of SmolLM2 streamed from memory: 9 rows cost 1.22x one
// row before and 1.06x with blocks, 12 rows 1.41x and 1.13x, 18 rows 1.81x and 1.48x; at 24-32
// rows both ways cost the same, and from 48 rows, or with the weights in cache (prefill), the
// blocks' extra traffic made it slower (4096 rows: 160 -> 53 GFLOP/s), hence the bound.
template <int W, int NR, typename S = Fp32>
[[gnu::always_inline]] inline void run_panels(const Problem& p, int64_t p0, int64_t p1) {
    constexpr int64_t P = 2 * W;
    if (p.m <= pair_rows<W>()) {  // few rows: panels two at a time, a last odd one alone
        for (; p0 + 1 < p1; p0 += 2) {
            switch (p.m) {
                case 1: tile_pair<W, 1, S>(p, p0); break;
                case 2: tile_pair<W, 2, S>(p, p0); break;
                case 3: if constexpr (pair_rows<W>() >= 3) tile_pair<W, 3, S>(p, p0); break;
                case 4: if constexpr (pair_rows<W>() >= 4) tile_pair<W, 4, S>(p, p0); break;
                default: break;
            }
        }
    }
    const int64_t block = (p.m > NR && p.m <= blocked_rows<W>()) ? kBlock : p.k;
    alignas(64) float sums[kMaxBlockedRows * P];
    for (int64_t pi = p0; pi < p1; ++pi) {
        const float* panel = p.panels + pi * p.k * P;
        const int64_t c0 = pi * P, valid = std::min<int64_t>(P, p.n - c0);
        for (int64_t k0 = 0; k0 < p.k; k0 += block)
            run_block<W, NR, S>(p, panel, c0, valid, k0, std::min(p.k, k0 + block), sums);
    }
}

__attribute__((target("avx512f,fma"))) void panels_avx512(const Problem& p, int64_t p0, int64_t p1) {
    run_panels<16, 12>(p, p0, p1);
}

__attribute__((target("avx2,fma"))) void panels_avx2(const Problem& p, int64_t p0, int64_t p1) {
    run_panels<8, 6>(p, p0, p1);
}

void panels_default(const Problem& p, int64_t p0, int64_t p1) { run_panels<8, 4>(p, p0, p1); }

__attribute__((target("avx512f,avx512bf16"))) void panels_bf16(const Problem& p, int64_t p0, int64_t p1) {
    run_panels<16, 12, Bf16>(p, p0, p1);
}

int isa() {
    static const int level = __builtin_cpu_supports("avx512f") ? 2
                             : (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) ? 1 : 0;
    return level;
}

// Whether this CPU runs the bf16 product (vdpbf16ps); its panels are those of the AVX-512 build.
bool bf16_kernel() {
    static const bool ok = isa() == 2 && __builtin_cpu_supports("avx512bf16");
    return ok;
}

// Output columns per panel on this CPU (the packed layout depends on it).
int64_t panel_width() { return isa() == 2 ? 32 : 16; }

const char* isa_name() { return isa() == 2 ? "avx512" : isa() == 1 ? "avx2" : "portable"; }

// packed [ceil(N / P) * steps * P] words <- word(col, step) for col < n; columns past N are 0.
template <typename Word>
void pack_words(uint32_t* dst, int64_t n, int64_t steps, Word word) {
    const int64_t P = panel_width(), panels = (n + P - 1) / P;
    py::gil_scoped_release release;
    for (int64_t pi = 0; pi < panels; ++pi) {
        uint32_t* panel = dst + pi * steps * P;
        for (int64_t kk = 0; kk < steps; ++kk)
            for (int64_t c = 0; c < P; ++c) {
                const int64_t col = pi * P + c;
                panel[kk * P + c] = col < n ? word(col, kk) : 0u;
            }
    }
}

// packed [ceil(N / P) * K * P] floats <- w [N, K] (fp32, row stride K).
void pack(uintptr_t w, uintptr_t packed, int64_t n, int64_t k) {
    if (n <= 0 || k <= 0) throw std::invalid_argument("pack needs n > 0 and k > 0");
    const auto* src = reinterpret_cast<const uint32_t*>(w);  // the floats' bits
    pack_words(reinterpret_cast<uint32_t*>(packed), n, k,
               [&](int64_t col, int64_t kk) { return src[col * k + kk]; });
}

// packed [ceil(N / P) * K/2 * P] words of two bf16 <- w [N, K] (bf16, row stride K, K even):
// the word of (column c, step j) holds w[c][2j] in its low half and w[c][2j + 1] in its high.
void pack_bf16(uintptr_t w, uintptr_t packed, int64_t n, int64_t k) {
    if (n <= 0 || k <= 0 || k % 2) throw std::invalid_argument("pack_bf16 needs n > 0 and an even k > 0");
    const auto* src = reinterpret_cast<const uint16_t*>(w);
    pack_words(reinterpret_cast<uint32_t*>(packed), n, k / 2, [&](int64_t col, int64_t j) {
        return uint32_t(src[col * k + 2 * j]) | uint32_t(src[col * k + 2 * j + 1]) << 16;
    });
}

// The panels of `p` on `threads` threads, split into several parts per thread, claimed as the
// threads come free (parts.h), each running `panels_fn`.
void run_problem(const Problem& p, int64_t threads, void (*panels_fn)(const Problem&, int64_t, int64_t)) {
    const int64_t panels = (p.n + panel_width() - 1) / panel_width();
    const int64_t parts = rhyme_parts::parts_for(panels, threads);
    rhyme_parts::run_in_parts(parts, threads, [&](int64_t part) {
        panels_fn(p, panels * part / parts, panels * (part + 1) / parts);
    });
}

// y [M, N] <- x [M, K] @ w^T (+ bias), w given packed, fp32. Called without the GIL (the
// Python wrapper below releases it; the decoder step calls it directly).
void gemm_kernel(const float* x, const float* panels_ptr, const float* bias, float* y, int64_t m,
                 int64_t n, int64_t k, int64_t threads) {
    if (m < 0 || n <= 0 || k <= 0) throw std::invalid_argument("gemm needs m >= 0, n > 0, k > 0");
    if (m == 0) return;
    run_problem(Problem{x, panels_ptr, bias, y, m, n, k}, threads,
                isa() == 2 ? panels_avx512 : isa() == 1 ? panels_avx2 : panels_default);
}

// y [M, N] (bf16) <- x [M, K] (bf16) @ w^T (+ bias, fp32), w given by pack_bf16; K even.
// Only where bf16_kernel(). Called without the GIL.
void gemm_bf16_kernel(const uint16_t* x, const uint32_t* panels_ptr, const float* bias, uint16_t* y,
                      int64_t m, int64_t n, int64_t k, int64_t threads) {
    if (!bf16_kernel()) throw std::runtime_error("the bf16 product needs AVX512_BF16");
    if (m < 0 || n <= 0 || k <= 0 || k % 2) throw std::invalid_argument("gemm_bf16 needs m >= 0, n > 0, an even k > 0");
    if (m == 0) return;
    run_problem(Problem{reinterpret_cast<const float*>(x), reinterpret_cast<const float*>(panels_ptr), bias, y,
                        m, n, k / 2},
                threads, panels_bf16);
}

void gemm(uintptr_t x, uintptr_t packed, uintptr_t bias, uintptr_t y, int64_t m, int64_t n, int64_t k,
          int64_t threads) {
    py::gil_scoped_release release;
    gemm_kernel(reinterpret_cast<const float*>(x), reinterpret_cast<const float*>(packed),
                reinterpret_cast<const float*>(bias), reinterpret_cast<float*>(y), m, n, k, threads);
}

void gemm_bf16(uintptr_t x, uintptr_t packed, uintptr_t bias, uintptr_t y, int64_t m, int64_t n, int64_t k,
               int64_t threads) {
    py::gil_scoped_release release;
    gemm_bf16_kernel(reinterpret_cast<const uint16_t*>(x), reinterpret_cast<const uint32_t*>(packed),
                     reinterpret_cast<const float*>(bias), reinterpret_cast<uint16_t*>(y), m, n, k, threads);
}

const rhyme_kernels::Gemm kKernels{rhyme_kernels::kVersion, &gemm_kernel, &gemm_bf16_kernel};

}  // namespace

PYBIND11_MODULE(_rhyme_gemm, m) {
    rhyme_parts::share_pool();
    m.doc() = "fp32 and bf16 few-row products over panel-packed weights (see skinny_gemm.cpp)";
    m.def("panel_width", &panel_width);
    m.def("isa", &isa_name);
    m.attr("revision") = kRevision;
    m.def("pack", &pack);
    m.def("gemm", &gemm);
    m.def("bf16", &bf16_kernel);
    m.def("pack_bf16", &pack_bf16);
    m.def("gemm_bf16", &gemm_bf16);
    m.attr("_kernels") = py::capsule(&kKernels, "rhyme_kernels::Gemm");
}
