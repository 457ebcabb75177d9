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
// stream kAhead steps of k ahead; with a few more rows than a tile, the tiles take turns over
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
// Called from rhyme_sglang/cpu_backend/linear.py with raw pointers to contiguous float32 tensors
// that Python checked; no torch headers are needed to build it.

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
// 2: row tiles take turns over blocks of k; 3: only up to kMaxBlockedRows rows.
constexpr int kRevision = 3;
constexpr int64_t kAhead = 32;  // k steps of the panel stream prefetched ahead
constexpr int64_t kBlock = 32;  // k steps of a panel that every row tile passes before the next
constexpr int64_t kMaxBlockedRows = 24;  // more rows than this run each tile over the whole of k

struct Problem {
    const float* x;       // [M, K], row stride K
    const float* panels;  // [N_pad / P][K][P]
    const float* bias;    // [N] or null
    float* y;             // [M, N], row stride N
    int64_t m, n, k;
};

// Rows r0 .. r0 + NR of one panel (columns c0 .. c0 + 2W, of which `valid` are real), over
// k in [k0, k1). A tile that does not start at k = 0 resumes its sums from `acc` ([NR][2W]),
// one that does not end at K leaves them there; otherwise they go to y (plus bias).
template <int W, int NR>
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
        if (prefetch) __builtin_prefetch(panel + (kk + kAhead) * 2 * W, 0, 3);
        const V a = loadv<V>(panel + kk * 2 * W), b = loadv<V>(panel + kk * 2 * W + W);
        for (int r = 0; r < NR; ++r) {
            const V s = splatv<V>(xr[r][kk]);
            lo[r] += s * a;
            hi[r] += s * b;
        }
    }
    if (k1 < p.k) {
        for (int r = 0; r < NR; ++r) {
            storev<V>(acc + r * 2 * W, lo[r]);
            storev<V>(acc + r * 2 * W + W, hi[r]);
        }
        return;
    }
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
        float* out = p.y + (r0 + r) * p.n + c0;
        const V l = has_bias ? lo[r] + blo : lo[r], h = has_bias ? hi[r] + bhi : hi[r];
        if (valid == 2 * W) {
            storev<V>(out, l);
            storev<V>(out + W, h);
        } else {
            storev<V>(buf, l);
            storev<V>(buf + W, h);
            std::memcpy(out, buf, valid * sizeof(float));
        }
    }
}

// Every row tile of one panel over k in [k0, k1); the first tile prefetches.
template <int W, int NR>
[[gnu::always_inline]] inline void run_block(const Problem& p, const float* panel, int64_t c0, int64_t valid,
                                             int64_t k0, int64_t k1, float* acc) {
    int64_t r0 = 0;
    for (; r0 + NR <= p.m; r0 += NR)
        tile<W, NR>(p, panel, r0, c0, valid, k0, k1, acc + r0 * 2 * W, r0 == 0);
    switch (p.m - r0) {  // the last rows: a tile of exactly that many
#define RHYME_TAIL(R) \
    case R: if constexpr (R < NR) tile<W, R>(p, panel, r0, c0, valid, k0, k1, acc + r0 * 2 * W, r0 == 0); break;
        RHYME_TAIL(1) RHYME_TAIL(2) RHYME_TAIL(3) RHYME_TAIL(4) RHYME_TAIL(5) RHYME_TAIL(6)
        RHYME_TAIL(7) RHYME_TAIL(8) RHYME_TAIL(9) RHYME_TAIL(10) RHYME_TAIL(11)
#undef RHYME_TAIL
        default: break;
    }
}

// Panels [p0, p1) for every row. With more rows than one tile (up to kMaxBlockedRows), every
// tile passes a block of kBlock steps of k (a few KB of the panel, found in L1 by all but the
// first tile) before any goes on, keeping its sums in `sums` between blocks: the first tile's
// prefetches then stream the panel from memory while the others compute, instead of memory
// idling while later tiles re-read a whole panel from L2. Storing a sum and loading it back is
// exact, so each output is still one running sum over k in order. Measured on an AVX2 EPYC
// (2 threads, stop 38), the 30 layers of SmolLM2 streamed from memory: 9 rows cost 1.22x one
// row before and 1.06x with blocks, 12 rows 1.41x and 1.13x, 18 rows 1.81x and 1.48x; at 24-32
// rows both ways cost the same, and from 48 rows, or with the weights in cache (prefill), the
// blocks' extra traffic made it slower (4096 rows: 160 -> 53 GFLOP/s), hence the bound.
template <int W, int NR>
[[gnu::always_inline]] inline void run_panels(const Problem& p, int64_t p0, int64_t p1) {
    constexpr int64_t P = 2 * W;
    const int64_t block = (p.m > NR && p.m <= kMaxBlockedRows) ? kBlock : p.k;
    alignas(64) float sums[kMaxBlockedRows * P];
    for (int64_t pi = p0; pi < p1; ++pi) {
        const float* panel = p.panels + pi * p.k * P;
        const int64_t c0 = pi * P, valid = std::min<int64_t>(P, p.n - c0);
        for (int64_t k0 = 0; k0 < p.k; k0 += block)
            run_block<W, NR>(p, panel, c0, valid, k0, std::min(p.k, k0 + block), sums);
    }
}

__attribute__((target("avx512f,fma"))) void panels_avx512(const Problem& p, int64_t p0, int64_t p1) {
    run_panels<16, 12>(p, p0, p1);
}

__attribute__((target("avx2,fma"))) void panels_avx2(const Problem& p, int64_t p0, int64_t p1) {
    run_panels<8, 6>(p, p0, p1);
}

void panels_default(const Problem& p, int64_t p0, int64_t p1) { run_panels<8, 4>(p, p0, p1); }

int isa() {
    static const int level = __builtin_cpu_supports("avx512f") ? 2
                             : (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) ? 1 : 0;
    return level;
}

// Output columns per panel on this CPU (the packed layout depends on it).
int64_t panel_width() { return isa() == 2 ? 32 : 16; }

const char* isa_name() { return isa() == 2 ? "avx512" : isa() == 1 ? "avx2" : "portable"; }

// packed [ceil(N / P) * K * P] <- w [N, K] (row stride K); columns past N are zero.
void pack(uintptr_t w, uintptr_t packed, int64_t n, int64_t k) {
    if (n <= 0 || k <= 0) throw std::invalid_argument("pack needs n > 0 and k > 0");
    const auto* src = reinterpret_cast<const float*>(w);
    auto* dst = reinterpret_cast<float*>(packed);
    const int64_t P = panel_width(), panels = (n + P - 1) / P;
    py::gil_scoped_release release;
    for (int64_t pi = 0; pi < panels; ++pi) {
        float* panel = dst + pi * k * P;
        for (int64_t kk = 0; kk < k; ++kk)
            for (int64_t c = 0; c < P; ++c) {
                const int64_t col = pi * P + c;
                panel[kk * P + c] = col < n ? src[col * k + kk] : 0.f;
            }
    }
}

// y [M, N] <- x [M, K] @ w^T (+ bias), w given packed; `threads` > 1 splits the panels
// (into several parts per thread, claimed as the threads come free: parts.h). Called without
// the GIL (the Python wrapper below releases it; the decoder step calls it directly).
void gemm_kernel(const float* x, const float* panels_ptr, const float* bias, float* y, int64_t m,
                 int64_t n, int64_t k, int64_t threads) {
    if (m < 0 || n <= 0 || k <= 0) throw std::invalid_argument("gemm needs m >= 0, n > 0, k > 0");
    if (m == 0) return;
    const Problem p{x, panels_ptr, bias, y, m, n, k};
    const int64_t panels = (n + panel_width() - 1) / panel_width();
    auto run = [&](int64_t p0, int64_t p1) {
        switch (isa()) {
            case 2: panels_avx512(p, p0, p1); break;
            case 1: panels_avx2(p, p0, p1); break;
            default: panels_default(p, p0, p1); break;
        }
    };
    const int64_t parts = rhyme_parts::parts_for(panels, threads);
    rhyme_parts::run_in_parts(parts, threads, [&](int64_t part) {
        run(panels * part / parts, panels * (part + 1) / parts);
    });
}

void gemm(uintptr_t x, uintptr_t packed, uintptr_t bias, uintptr_t y, int64_t m, int64_t n, int64_t k,
          int64_t threads) {
    py::gil_scoped_release release;
    gemm_kernel(reinterpret_cast<const float*>(x), reinterpret_cast<const float*>(packed),
                reinterpret_cast<const float*>(bias), reinterpret_cast<float*>(y), m, n, k, threads);
}

const rhyme_kernels::Gemm kKernels{rhyme_kernels::kVersion, &gemm_kernel};

}  // namespace

PYBIND11_MODULE(_rhyme_gemm, m) {
    rhyme_parts::share_pool();
    m.doc() = "fp32 few-row products over panel-packed weights (see skinny_gemm.cpp)";
    m.def("panel_width", &panel_width);
    m.def("isa", &isa_name);
    m.attr("revision") = kRevision;
    m.def("pack", &pack);
    m.def("gemm", &gemm);
    m.attr("_kernels") = py::capsule(&kKernels, "rhyme_kernels::Gemm");
}
