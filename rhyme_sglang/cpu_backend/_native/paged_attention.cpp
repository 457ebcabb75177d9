// Paged attention read straight from sglang's KV pool, one request at a time, every query
// row computed on its own: its scores, softmax and V sum visit the keys it sees in position
// order with a fixed arithmetic order. A token's output therefore does not depend on how many
// other rows share the call: one decode row and the same token as a node of a verify tree (same
// visible keys, same values) give bit-identical results, which is what lossless speculation
// needs. K/V are read in place once per request for all of its query rows, in the cache's own
// dtype (float32, or bf16 widened to float32 in registers), so nothing is gathered or
// converted ahead.
//
// Built without fast-math and with -ffp-contract=off; the multiply-adds are written as fused
// ones (fused(): one rounding): each score is acc = fma(q[c], k[c], acc) over c in order and
// each V sum acc = fma(p, v, acc) over the keys in order, one lane per key or column. The
// AVX-512 (16-lane), AVX2+FMA (8-lane) and portable (fmaf per lane) builds give the same bits.
//
// Called from rhyme_sglang/cpu_backend/attention.py with raw pointers to contiguous tensors
// that Python checked (shapes, dtypes, strides); no torch headers are needed to build it.

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernels.h"
#include "parts.h"
#include "vec.h"

namespace py = pybind11;

namespace {

using namespace rhyme_vec;

// Bumped when the kernel's speed changes (saved step costs key on it). 2: rows read in place,
// fused multiply-adds, the softmax W lanes at a time.
constexpr int kRevision = 2;
constexpr int kVBlock = 64;  // keys of one V block (their rows found once; the next block prefetched)
constexpr int kRows = 4;     // query rows of one KV head computed together (sharing loads)
// The score tile (keys, one per lane), the V-sum column block and the softmax's row maximum and
// exp are W lanes (Lanes<W>, vec.h) wide: 16 where the CPU has AVX-512 (one zmm), 8 on AVX2
// (one ymm: 16-lane vectors there split in two and their accumulators spill, measured 5-9x
// slower on an AVX2 EPYC). Lanes never mix: a key's score and a column's V sum run in the same
// order whatever W is, so the bits do not change.

// Lanes i of a and b interleaved: the first halves (lo) or the second halves (hi).
[[gnu::always_inline]] inline v16f lo_half(v16f a, v16f b) {
    return __builtin_shufflevector(a, b, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
}
[[gnu::always_inline]] inline v16f hi_half(v16f a, v16f b) {
    return __builtin_shufflevector(a, b, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
}
[[gnu::always_inline]] inline v8f lo_half(v8f a, v8f b) { return __builtin_shufflevector(a, b, 0, 8, 1, 9, 2, 10, 3, 11); }
[[gnu::always_inline]] inline v8f hi_half(v8f a, v8f b) { return __builtin_shufflevector(a, b, 4, 12, 5, 13, 6, 14, 7, 15); }

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) { return bf16_to_f32(x); }

// tile [width][W] <- keys[jj][0 .. width) for jj < W (a key's values to one lane per key,
// widened to float), W x W blocks in registers: log2(W) rounds, each interleaving row i with
// row i + W/2, transpose a block (an exact copy: the scores read the same values as from an
// element-by-element transpose).
template <int W, typename T>
[[gnu::always_inline]] inline void transpose_keys(const T* const* keys, float* tile, int64_t width) {
    typedef typename Lanes<W>::type V;
    int64_t c0 = 0;
    for (; c0 + W <= width; c0 += W) {
        V m[W], t[W];
        for (int jj = 0; jj < W; ++jj) m[jj] = load_as_f32<V>(keys[jj] + c0);
        for (int round = 1; round < W; round *= 2) {
            for (int i = 0; i < W / 2; ++i) {
                t[2 * i] = lo_half(m[i], m[i + W / 2]);
                t[2 * i + 1] = hi_half(m[i], m[i + W / 2]);
            }
            for (int i = 0; i < W; ++i) m[i] = t[i];
        }
        for (int c = 0; c < W; ++c) storev<V>(tile + (c0 + c) * W, m[c]);
    }
    for (int64_t c = c0; c < width; ++c)  // a width that is not a whole number of blocks
        for (int64_t jj = 0; jj < W; ++jj) tile[c * W + jj] = to_float(keys[jj][c]);
}

// acc + a * b rounded once, lane by lane (a fused multiply-add). Hw: the build's vector FMA
// (vfmadd231ps, written as inline assembly so the shared templates need no target of their
// own); else each lane through fmaf, which rounds the same way. So every build, whatever its
// width, gives the same bits.
template <bool Hw, typename V>
[[gnu::always_inline]] inline V fused(V acc, V a, V b) {
    if constexpr (Hw) {
        asm("vfmadd231ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    } else {
        for (int i = 0; i < static_cast<int>(sizeof(V) / sizeof(float)); ++i)
            acc[i] = __builtin_fmaf(a[i], b[i], acc[i]);
    }
    return acc;
}

// acc + x * a with the scalar x in every lane; AVX-512 reads x straight from memory ({1to16}).
template <bool Hw, typename V>
[[gnu::always_inline]] inline V fused_splat(V acc, V a, const float* x) {
    if constexpr (Hw && sizeof(V) == 64) {
        asm("vfmadd231ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*x));
        return acc;
    } else {
        return fused<Hw>(acc, a, splatv<V>(*x));
    }
}

// Scores of NR query rows (same KV head) against one tile of W keys, kt [d][W]:
// each lane computes acc = fma(q[c], k[c], acc) for c = 0 .. d-1 in order, then scales.
template <int W, bool Hw, int NR>
[[gnu::always_inline]] inline void score_rows(const float* q, const int64_t* rows, const float* kt, int64_t d,
                       float scale, float* scores, int64_t padded, int64_t j0) {
    typedef typename Lanes<W>::type V;
    V acc[NR];
    const float* qr[NR];
    for (int r = 0; r < NR; ++r) {
        acc[r] = splatv<V>(0.f);
        qr[r] = q + rows[r] * d;
    }
    for (int64_t c = 0; c < d; ++c) {
        const V k = loadv<V>(kt + c * W);
        for (int r = 0; r < NR; ++r) acc[r] = fused_splat<Hw>(acc[r], k, qr[r] + c);
    }
    for (int r = 0; r < NR; ++r) storev<V>(scores + rows[r] * padded + j0, acc[r] * splatv<V>(scale));
}

// o[row] = fma(p[row][jj], v[jj], o[row]) over the nb keys, keys in order, for NR rows of one
// KV head; vals[jj] + at: this head's values of key jj (the cache's dtype), columns c0 .. c0 + 2W.
template <int W, bool Hw, int NR, typename T>
[[gnu::always_inline]] inline void value_rows(float* o, const int64_t* rows, int64_t dv, const float* p, int64_t padded,
                       const T* const* vals, int64_t at, int64_t nb, int64_t c0) {
    typedef typename Lanes<W>::type V;
    V lo[NR], hi[NR];
    const float* pr[NR];
    for (int r = 0; r < NR; ++r) {
        lo[r] = loadv<V>(o + rows[r] * dv + c0);
        hi[r] = loadv<V>(o + rows[r] * dv + c0 + W);
        pr[r] = p + rows[r] * padded;
    }
    for (int64_t jj = 0; jj < nb; ++jj) {
        const T* v = vals[jj] + at + c0;
        const V a = load_as_f32<V>(v), b = load_as_f32<V>(v + W);
        for (int r = 0; r < NR; ++r) {
            lo[r] = fused_splat<Hw>(lo[r], a, pr[r] + jj);
            hi[r] = fused_splat<Hw>(hi[r], b, pr[r] + jj);
        }
    }
    for (int r = 0; r < NR; ++r) {
        storev<V>(o + rows[r] * dv + c0, lo[r]);
        storev<V>(o + rows[r] * dv + c0 + W, hi[r]);
    }
}


// The largest of x[0 .. n) (n a multiple of W), W lanes at a time; a NaN never wins (each step
// keeps the larger by `>`, as a scalar loop would), so the result is the exact maximum.
template <int W>
[[gnu::always_inline]] inline float row_max(const float* x, int64_t n) {
    typedef typename Lanes<W>::type V;
    V m = splatv<V>(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < n; j += W) {
        const V v = loadv<V>(x + j);
        m = v > m ? v : m;
    }
    float out = -std::numeric_limits<float>::infinity();
    for (int i = 0; i < W; ++i) out = m[i] > out ? m[i] : out;
    return out;
}

// Per-thread working memory of attend_request_impl; `zeros`: the missing keys of a last tile.
struct Scratch {
    std::vector<float> scores, tile, row_sum, zeros;
    std::vector<int64_t> head_rows;
};

inline Scratch& scratch() {
    static thread_local Scratch s;
    return s;
}

struct Shapes {
    int64_t heads, kv_heads, head_dim, v_dim;
    float scale, logit_cap;
    bool kv_bf16, causal;
};

// One request, KV heads kh0 .. kh1 - 1 (and the query heads that share them): queries
// q [ext, heads, head_dim] (float32), output o [ext, heads, v_dim] (only those heads' rows
// are read or written, so calls for disjoint head ranges may run at once).
// Keys 0 .. prefix-1 come from the cache through `locs`; extend keys (offset r = j - prefix)
// come from k_new/v_new rows r when given, else from the cache too.
// `tree` [ext, ext] rows of `tree_stride` bytes (uint8, row t: which extend offsets query t
// sees; a request of a ragged verify uses the top-left ext x ext block of its n x n tree) or null.
//
// Why a row's result does not depend on the other rows or on where its keys sit:
// - a score is sum_d q[d] k[d] over d = 0 .. head_dim-1 in order, the same in every vector
//   lane and for every row block, so a key's score does not depend on its tile, lane or rows;
// - the row maximum is exact; exp is lane-wise;
// - the softmax sum and the V sum run over the keys in position order, a key the row does not
//   see adding an exact zero. Ancestors in a verify tree come in position order too, so a tree
//   node meets the same non-zero terms in the same order as the same token decoded alone;
// - a row's arithmetic does not depend on which other heads or rows share the call either.
template <int W, bool Hw, typename T>
[[gnu::always_inline]] inline void attend_typed(const Shapes& s, const float* q, float* o, const void* k_cache,
                    const void* v_cache, const void* k_new, const void* v_new,
                    const int32_t* locs, int64_t seq_len, int64_t ext, const uint8_t* tree,
                    int64_t tree_stride, int64_t kh0, int64_t kh1) {
    const int64_t h = s.heads, hkv = kh1 - kh0, d = s.head_dim, dv = s.v_dim;
    const int64_t group = h / s.kv_heads, prefix = seq_len - ext, rows = ext * h;
    const int64_t k_row = s.kv_heads * d, v_row = s.kv_heads * dv;  // a cache row
    const int64_t k_width = hkv * d, v_width = hkv * dv;  // the part of it these heads read
    const int64_t padded = (seq_len + W - 1) / W * W;
    // this thread's buffers, kept between calls (a call is ~20 us at batch 1, where a malloc
    // showed up in profiles); sized to this call, zeroed where read before written
    Scratch& buf = scratch();
    buf.scores.resize(static_cast<size_t>(rows * padded));  // rows of other heads stay unwritten
    buf.tile.resize(static_cast<size_t>(k_width * W));  // [hkv][d][key in tile]
    if (buf.zeros.size() < static_cast<size_t>(k_width)) buf.zeros.resize(static_cast<size_t>(k_width));
    float* const scores = buf.scores.data();
    std::vector<float>& tile = buf.tile;
    const T* const zero_row = reinterpret_cast<const T*>(buf.zeros.data());  // all bits 0

    // key / value row j: (buffer, row) of this step's new rows or of the cache; these heads'
    // part of it starts at column col0(is_key) and is n(is_key) values wide
    auto where = [&](bool is_key, int64_t j) -> std::pair<const void*, int64_t> {
        const void* fresh = is_key ? k_new : v_new;
        if (j >= prefix && fresh != nullptr) return {fresh, j - prefix};
        return {is_key ? k_cache : v_cache, locs[j]};
    };
    auto col0 = [&](bool is_key) { return kh0 * (is_key ? d : dv); };
    auto n = [&](bool is_key) { return is_key ? k_width : v_width; };
    // these heads' part of key / value row j, read in place
    auto row_of = [&](bool is_key, int64_t j) -> const T* {
        const auto [base, index] = where(is_key, j);
        return static_cast<const T*>(base) + index * (is_key ? k_row : v_row) + col0(is_key);
    };
    // the cache lines of row j's part, asked for ahead of time (a request's rows sit anywhere
    // in the pool: each is a memory latency otherwise)
    auto prefetch = [&](bool is_key, int64_t j) {
        if (j >= seq_len) return;
        const char* row = reinterpret_cast<const char*>(row_of(is_key, j));
        for (int64_t b = 0; b < n(is_key) * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(row + b, 0, 3);
    };
    // visible(t, j) for an extend key j >= prefix
    auto sees = [&](int64_t t, int64_t j) -> bool {
        const int64_t r = j - prefix;
        if (tree != nullptr) return tree[t * tree_stride + r] != 0;
        return !s.causal || r <= t;
    };

    // rows of each KV head of the range: t * h + kh * group + g
    const int64_t per_head = ext * group, mine = hkv * per_head;
    std::vector<int64_t>& head_rows = buf.head_rows;
    head_rows.resize(static_cast<size_t>(mine));
    for (int64_t kh = 0, i = 0; kh < hkv; ++kh)
        for (int64_t t = 0; t < ext; ++t)
            for (int64_t g = 0; g < group; ++g) head_rows[i++] = t * h + (kh0 + kh) * group + g;

    // 1. scores, a tile of W keys at a time (missing keys of the last tile are zeros)
    const T* krows[W];
    for (int64_t j0 = 0; j0 < seq_len; j0 += W) {
        const int64_t nb = std::min<int64_t>(W, seq_len - j0);
        for (int64_t jj = 0; jj < nb; ++jj) {
            prefetch(true, j0 + jj + W);  // the next tile's key
            krows[jj] = row_of(true, j0 + jj);
        }
        for (int64_t jj = nb; jj < W; ++jj) krows[jj] = zero_row;
        if (j0 == 0)  // the value rows of the first V block, while the scores are computed
            for (int64_t j = 0; j < std::min<int64_t>(kVBlock, seq_len); ++j) prefetch(false, j);
        transpose_keys<W>(krows, tile.data(), k_width);
        for (int64_t kh = 0; kh < hkv; ++kh) {
            const float* kt = tile.data() + kh * d * W;
            const int64_t* hr = head_rows.data() + kh * per_head;
            int64_t i = 0;
            for (; i + kRows <= per_head; i += kRows)
                score_rows<W, Hw, kRows>(q, hr + i, kt, d, s.scale, scores, padded, j0);
            switch (per_head - i) {
                case 3: score_rows<W, Hw, 3>(q, hr + i, kt, d, s.scale, scores, padded, j0); break;
                case 2: score_rows<W, Hw, 2>(q, hr + i, kt, d, s.scale, scores, padded, j0); break;
                case 1: score_rows<W, Hw, 1>(q, hr + i, kt, d, s.scale, scores, padded, j0); break;
                default: break;
            }
        }
    }
    // 2. softmax weights per row: invisible keys get an exact 0
    std::vector<float>& row_sum = buf.row_sum;
    row_sum.assign(static_cast<size_t>(rows), 0.f);
    for (const int64_t row : head_rows) {
        const int64_t t = row / h;
        float* sc = scores + row * padded;
        if (s.logit_cap > 0.f)
            for (int64_t j = 0; j < seq_len; ++j) sc[j] = s.logit_cap * std::tanh(sc[j] / s.logit_cap);
        for (int64_t j = std::max<int64_t>(prefix, 0); j < seq_len; ++j)
            if (!sees(t, j)) sc[j] = -std::numeric_limits<float>::infinity();
        for (int64_t j = seq_len; j < padded; ++j) sc[j] = -std::numeric_limits<float>::infinity();
        const float mx = row_max<W>(sc, padded);
        if (mx == -std::numeric_limits<float>::infinity()) {  // sees nothing: zeros
            std::fill(sc, sc + padded, 0.f);
            continue;
        }
        typedef typename Lanes<W>::type V;
        for (int64_t j = 0; j < padded; j += W) storev<V>(sc + j, expv<V>(loadv<V>(sc + j) - splatv<V>(mx)));
    }
    // each row's sum in key order; four rows at once so their add chains overlap
    for (int64_t i0 = 0; i0 < mine; i0 += 4) {
        float total[4] = {0.f, 0.f, 0.f, 0.f};
        const int64_t nr = std::min<int64_t>(4, mine - i0);
        const float* sc[4];
        for (int64_t r = 0; r < nr; ++r) sc[r] = scores + head_rows[i0 + r] * padded;
        if (nr == 4) {
            for (int64_t j = 0; j < seq_len; ++j) {
                total[0] += sc[0][j];
                total[1] += sc[1][j];
                total[2] += sc[2][j];
                total[3] += sc[3][j];
            }
        } else {
            for (int64_t r = 0; r < nr; ++r)
                for (int64_t j = 0; j < seq_len; ++j) total[r] += sc[r][j];
        }
        for (int64_t r = 0; r < nr; ++r) row_sum[head_rows[i0 + r]] = total[r];
    }
    // 3. weighted V sums, keys in position order: each output element adds p * v key after
    //    key (a key the row does not see adds an exact zero); accumulators stay in registers
    //    across a block of kVBlock keys, kRows rows of one KV head sharing each value load
    for (const int64_t row : head_rows) std::memset(o + row * dv, 0, sizeof(float) * static_cast<size_t>(dv));
    const int64_t wide = dv / (2 * W) * (2 * W);
    const T* vrows[kVBlock];
    for (int64_t j0 = 0; j0 < seq_len; j0 += kVBlock) {
        const int64_t nb = std::min<int64_t>(kVBlock, seq_len - j0);
        for (int64_t jj = 0; jj < nb; ++jj) {
            prefetch(false, j0 + jj + kVBlock);  // the next block's value
            vrows[jj] = row_of(false, j0 + jj);
        }
        const float* p = scores + j0;
        for (int64_t kh = 0; kh < hkv; ++kh) {
            const int64_t at = kh * dv;
            const int64_t* hr = head_rows.data() + kh * per_head;
            for (int64_t c0 = 0; c0 < wide; c0 += 2 * W) {
                int64_t i = 0;
                for (; i + kRows <= per_head; i += kRows)
                    value_rows<W, Hw, kRows>(o, hr + i, dv, p, padded, vrows, at, nb, c0);
                switch (per_head - i) {
                    case 3: value_rows<W, Hw, 3>(o, hr + i, dv, p, padded, vrows, at, nb, c0); break;
                    case 2: value_rows<W, Hw, 2>(o, hr + i, dv, p, padded, vrows, at, nb, c0); break;
                    case 1: value_rows<W, Hw, 1>(o, hr + i, dv, p, padded, vrows, at, nb, c0); break;
                    default: break;
                }
            }
            for (int64_t i = 0; i < per_head && wide < dv; ++i) {  // columns past the last 2W
                float* orow = o + hr[i] * dv;
                const float* pr = p + hr[i] * padded;
                for (int64_t c = wide; c < dv; ++c) {
                    float acc = orow[c];
                    for (int64_t jj = 0; jj < nb; ++jj) acc = __builtin_fmaf(pr[jj], to_float(vrows[jj][at + c]), acc);
                    orow[c] = acc;
                }
            }
        }
    }
    for (const int64_t row : head_rows) {
        if (row_sum[row] <= 0.f) continue;
        const float total = row_sum[row];
        for (int64_t c = 0; c < dv; ++c) o[row * dv + c] /= total;
    }
}

template <int W, bool Hw>
[[gnu::always_inline]] inline void attend_request_impl(const Shapes& s, const float* q, float* o, const void* k_cache,
                    const void* v_cache, const void* k_new, const void* v_new,
                    const int32_t* locs, int64_t seq_len, int64_t ext, const uint8_t* tree,
                    int64_t tree_stride, int64_t kh0, int64_t kh1) {
    if (s.kv_bf16)
        attend_typed<W, Hw, uint16_t>(s, q, o, k_cache, v_cache, k_new, v_new, locs, seq_len, ext, tree, tree_stride, kh0, kh1);
    else
        attend_typed<W, Hw, float>(s, q, o, k_cache, v_cache, k_new, v_new, locs, seq_len, ext, tree, tree_stride, kh0, kh1);
}

__attribute__((target("avx512f"))) void attend_request_avx512(const Shapes& s, const float* q, float* o, const void* k_cache,
                    const void* v_cache, const void* k_new, const void* v_new,
                    const int32_t* locs, int64_t seq_len, int64_t ext, const uint8_t* tree,
                    int64_t tree_stride, int64_t kh0, int64_t kh1) {
    attend_request_impl<16, true>(s, q, o, k_cache, v_cache, k_new, v_new, locs, seq_len, ext, tree, tree_stride, kh0, kh1);
}

__attribute__((target("avx2,fma"))) void attend_request_avx2(const Shapes& s, const float* q, float* o, const void* k_cache,
                    const void* v_cache, const void* k_new, const void* v_new,
                    const int32_t* locs, int64_t seq_len, int64_t ext, const uint8_t* tree,
                    int64_t tree_stride, int64_t kh0, int64_t kh1) {
    attend_request_impl<8, true>(s, q, o, k_cache, v_cache, k_new, v_new, locs, seq_len, ext, tree, tree_stride, kh0, kh1);
}

void attend_request_default(const Shapes& s, const float* q, float* o, const void* k_cache,
                    const void* v_cache, const void* k_new, const void* v_new,
                    const int32_t* locs, int64_t seq_len, int64_t ext, const uint8_t* tree,
                    int64_t tree_stride, int64_t kh0, int64_t kh1) {
    attend_request_impl<8, false>(s, q, o, k_cache, v_cache, k_new, v_new, locs, seq_len, ext, tree, tree_stride, kh0, kh1);
}

// The clone for this CPU, chosen once.
void attend_request(const Shapes& s, const float* q, float* o, const void* k_cache,
                    const void* v_cache, const void* k_new, const void* v_new,
                    const int32_t* locs, int64_t seq_len, int64_t ext, const uint8_t* tree,
                    int64_t tree_stride, int64_t kh0, int64_t kh1) {
    static const int isa = __builtin_cpu_supports("avx512f") ? 2
                           : (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) ? 1 : 0;
    if (isa == 2)
        attend_request_avx512(s, q, o, k_cache, v_cache, k_new, v_new, locs, seq_len, ext, tree, tree_stride, kh0, kh1);
    else if (isa == 1)
        attend_request_avx2(s, q, o, k_cache, v_cache, k_new, v_new, locs, seq_len, ext, tree, tree_stride, kh0, kh1);
    else
        attend_request_default(s, q, o, k_cache, v_cache, k_new, v_new, locs, seq_len, ext, tree, tree_stride, kh0, kh1);
}

// The whole batch. Per request b: pool_rows[b] (row of req_to_token), seq_lens[b],
// ext_lens[b], starts[b] (first query row in q / o, and first row of k_new / v_new).
// With threads > 1 the requests are split into runs of similar work, several per thread, or,
// where there are fewer than two requests a thread, into (request, KV head) parts. A row's
// arithmetic never depends on the split, so the results do not depend on the thread count.
// Called without the GIL (the Python wrapper below releases it; the decoder step calls it
// directly).
void attend_kernel(const float* q, float* o, const void* k_cache, const void* v_cache, const void* k_new,
                   const void* v_new, const int32_t* r2t, const int64_t* rows, const int64_t* lens,
                   const int64_t* exts, const int64_t* first, const uint8_t* tree, int64_t tree_n,
                   int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t v_dim,
                   int64_t r2t_stride, double scale, double logit_cap, bool kv_bf16, bool causal,
                   int64_t threads) {
    if (kv_heads <= 0 || heads % kv_heads != 0)
        throw std::invalid_argument("heads must be a multiple of kv_heads");
    const Shapes s{heads, kv_heads, head_dim, v_dim, static_cast<float>(scale),
                   static_cast<float>(logit_cap), kv_bf16, causal};
    const size_t kv_elem = kv_bf16 ? 2 : 4;
    std::vector<double> work(static_cast<size_t>(batch) + 1, 0.0);  // prefix sums of the cost
    for (int64_t b = 0; b < batch; ++b) {
        if (exts[b] > 0 && lens[b] < exts[b])
            throw std::invalid_argument("seq_len " + std::to_string(lens[b]) +
                                        " is shorter than its extend length " + std::to_string(exts[b]));
        if (tree != nullptr && exts[b] > tree_n)
            throw std::invalid_argument("a request of a tree batch extends by more than its tree's n");
        work[b + 1] = work[b] + (exts[b] > 0 ? static_cast<double>(lens[b]) * exts[b] : 0.0);
    }
    auto one = [&](int64_t b, int64_t kh0, int64_t kh1) {
        const int64_t ext = exts[b];
        if (ext <= 0) return;
        const int64_t start = first[b];
        const uint8_t* tree_b = tree ? tree + b * tree_n * tree_n : nullptr;
        const char* kn = k_new ? static_cast<const char*>(k_new) + start * kv_heads * head_dim * kv_elem : nullptr;
        const char* vn = v_new ? static_cast<const char*>(v_new) + start * kv_heads * v_dim * kv_elem : nullptr;
        attend_request(s, q + start * heads * head_dim, o + start * heads * v_dim, k_cache, v_cache,
                       kn, vn, r2t + rows[b] * r2t_stride, lens[b], ext, tree_b, tree_n, kh0, kh1);
    };
    if (threads > 1 && batch < threads * 2 && kv_heads > 1) {
        // few requests (batch 1 above all): each request's KV heads are parts of their own,
        // so the threads share a request (its rows' results do not change)
        rhyme_parts::run_in_parts(batch * kv_heads, threads, [&](int64_t part) {
            const int64_t kh = part % kv_heads;
            one(part / kv_heads, kh, kh + 1);
        });
        return;
    }
    auto run = [&](int64_t lo, int64_t hi) {
        for (int64_t b = lo; b < hi; ++b) one(b, 0, kv_heads);
    };
    const int64_t parts = rhyme_parts::parts_for(batch, threads);
    if (parts <= 1) {
        run(0, batch);
        return;
    }
    std::vector<int64_t> bounds{0};
    for (int64_t part = 1, b = 0; part < parts; ++part) {
        const double target = work[batch] * part / parts;
        while (b < batch && work[b + 1] <= target) ++b;
        bounds.push_back(std::max(b, bounds.back()));
    }
    bounds.push_back(batch);
    rhyme_parts::run_in_parts(parts, threads, [&](int64_t part) { run(bounds[part], bounds[part + 1]); });
}

// Writes this step's K and V rows into the cache: row i of k_src / v_src (rows src_stride
// bytes apart, so a row view of a fused projection needs no copy) goes to pool row loc[i] of
// k_cache / v_cache (k_row / v_row bytes a row, the cache's dtype). One call for both, in
// place of two index_put ops a layer.
void store_kv_kernel(void* k_cache, void* v_cache, const void* k_src, const void* v_src,
                     int64_t k_src_stride, int64_t v_src_stride, const int64_t* at, int64_t rows,
                     int64_t k_row, int64_t v_row, int64_t capacity) {
    for (int64_t i = 0; i < rows; ++i)
        if (at[i] < 0 || at[i] >= capacity)
            throw std::invalid_argument("cache location " + std::to_string(at[i]) +
                                        " is outside the pool's " + std::to_string(capacity) + " rows");
    auto* kc = static_cast<char*>(k_cache);
    auto* vc = static_cast<char*>(v_cache);
    const auto* ks = static_cast<const char*>(k_src);
    const auto* vs = static_cast<const char*>(v_src);
    for (int64_t i = 0; i < rows; ++i) {
        std::memcpy(kc + at[i] * k_row, ks + i * k_src_stride, static_cast<size_t>(k_row));
        std::memcpy(vc + at[i] * v_row, vs + i * v_src_stride, static_cast<size_t>(v_row));
    }
}

template <typename T>
const T* as(uintptr_t p) { return reinterpret_cast<const T*>(p); }

// The accepted draft tokens' K/V moved to their final rows, in every layer's buffers at once:
// for each buffer (raw address, row stride in bytes), row tgt[i] <- row src[i], all sources read
// before any target is written (as sglang's kernel: the two sets may overlap).
void copy_rows(uintptr_t buffer_ptrs, uintptr_t buffer_strides, int64_t buffers, uintptr_t tgt_loc,
               uintptr_t src_loc, int64_t n) {
    const auto* ptrs = reinterpret_cast<const int64_t*>(buffer_ptrs);
    const auto* strides = reinterpret_cast<const int64_t*>(buffer_strides);
    const auto* tgt = reinterpret_cast<const int64_t*>(tgt_loc);
    const auto* src = reinterpret_cast<const int64_t*>(src_loc);
    for (int64_t i = 0; i < n; ++i)
        if (tgt[i] < 0 || src[i] < 0) throw std::invalid_argument("copy_rows got a negative row");
    py::gil_scoped_release release;
    std::vector<char> staged;
    for (int64_t b = 0; b < buffers; ++b) {
        char* base = reinterpret_cast<char*>(static_cast<uintptr_t>(ptrs[b]));
        const int64_t stride = strides[b];
        staged.resize(static_cast<size_t>(n * stride));
        for (int64_t i = 0; i < n; ++i) std::memcpy(staged.data() + i * stride, base + src[i] * stride, stride);
        for (int64_t i = 0; i < n; ++i) std::memcpy(base + tgt[i] * stride, staged.data() + i * stride, stride);
    }
}


void attend(uintptr_t q, uintptr_t o, uintptr_t k_cache, uintptr_t v_cache, uintptr_t k_new,
            uintptr_t v_new, uintptr_t req_to_token, uintptr_t pool_rows, uintptr_t seq_lens,
            uintptr_t ext_lens, uintptr_t starts, uintptr_t tree, int64_t tree_n, int64_t batch,
            int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t v_dim,
            int64_t r2t_stride, double scale, double logit_cap, bool kv_bf16, bool causal,
            int64_t threads) {
    py::gil_scoped_release release;
    attend_kernel(as<float>(q), reinterpret_cast<float*>(o), as<void>(k_cache), as<void>(v_cache),
                  as<void>(k_new), as<void>(v_new), as<int32_t>(req_to_token), as<int64_t>(pool_rows),
                  as<int64_t>(seq_lens), as<int64_t>(ext_lens), as<int64_t>(starts), as<uint8_t>(tree),
                  tree_n, batch, heads, kv_heads, head_dim, v_dim, r2t_stride, scale, logit_cap, kv_bf16,
                  causal, threads);
}

void store_kv(uintptr_t k_cache, uintptr_t v_cache, uintptr_t k_src, uintptr_t v_src,
              int64_t k_src_stride, int64_t v_src_stride, uintptr_t loc, int64_t rows,
              int64_t k_row, int64_t v_row, int64_t capacity) {
    store_kv_kernel(reinterpret_cast<void*>(k_cache), reinterpret_cast<void*>(v_cache), as<void>(k_src),
                    as<void>(v_src), k_src_stride, v_src_stride, as<int64_t>(loc), rows, k_row, v_row,
                    capacity);
}

const rhyme_kernels::Attention kKernels{rhyme_kernels::kVersion, &attend_kernel, &store_kv_kernel};

}  // namespace

PYBIND11_MODULE(_rhyme_attention, m) {
    rhyme_parts::share_pool();
    m.doc() = "Paged CPU attention over sglang's KV pool (see paged_attention.cpp)";
    m.def("attend", &attend);
    m.def("store_kv", &store_kv);
    m.def("copy_rows", &copy_rows);
    m.attr("_kernels") = py::capsule(&kKernels, "rhyme_kernels::Attention");
    m.attr("revision") = kRevision;
}
