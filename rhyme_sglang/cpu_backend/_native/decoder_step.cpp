// A Llama/Qwen2 decoder stack for one CPU decode or verify step, as one call: per layer
// RMSNorm (+ residual), qkv product (+ bias), rotary, K/V store, paged attention, o product,
// RMSNorm (+ residual), gate_up product, SiLU-and-mul, down product; then the final norm.
//
// Why: at batch 1 a SmolLM2-135M step is ~150 kernel calls of 10-400 us; from Python each
// costs 10-40 us of argument handling, tensor allocation and dispatch (~35-40% of a batch-1
// step, py-spy, AVX2 EPYC). Here the loop runs in C++ with the GIL released once.
//
// Lossless: it calls the very kernels the Python path (lean_forward.py) calls, through the
// function tables the other modules publish (kernels.h), in the same order on the same
// inputs, so it gives the same bits; RHYME_CPU_LEAN=check compares it with sglang's path.
// Nothing here does arithmetic of its own: the only data movement is one exact copy (the
// verify step's new V rows, made contiguous as the Python path's .contiguous() does), and in
// a bf16 model the attention's conversions the Python path makes too (q widened to fp32, its
// output rounded to bf16 to nearest even, as torch's copy into a bf16 tensor rounds).

#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "vec.h"

namespace py = pybind11;

namespace {

using rhyme_vec::bf16_to_f32;
using rhyme_vec::f32_to_bf16;

const rhyme_kernels::Gemm* g_gemm = nullptr;
const rhyme_kernels::Ops* g_ops = nullptr;
const rhyme_kernels::Attention* g_attention = nullptr;

template <typename T>
const T* table(const py::capsule& capsule, const char* name) {
    if (std::strcmp(capsule.name(), name) != 0)
        throw std::invalid_argument(std::string("expected a capsule named ") + name + ", got " + capsule.name());
    const T* t = capsule.get_pointer<const T>();
    if (t->version != rhyme_kernels::kVersion)
        throw std::invalid_argument(std::string(name) + " has another version: rebuild the native modules");
    return t;
}

// The kernel tables of _rhyme_gemm, _rhyme_ops and _rhyme_attention (their `_kernels`).
// All three are checked before any is kept.
void bind(const py::capsule& gemm, const py::capsule& ops, const py::capsule& attention) {
    const auto* g = table<rhyme_kernels::Gemm>(gemm, "rhyme_kernels::Gemm");
    const auto* o = table<rhyme_kernels::Ops>(ops, "rhyme_kernels::Ops");
    const auto* a = table<rhyme_kernels::Attention>(attention, "rhyme_kernels::Attention");
    g_gemm = g;
    g_ops = o;
    g_attention = a;
}

bool bound() { return g_gemm && g_ops && g_attention; }

// One layer's weights: pointers, one int64 row of the layer table (see Column).
enum Column : int64_t {
    kInNorm, kPostNorm, kQkv, kQkvBias, kO, kOBias, kGateUp, kGateUpBias, kDown, kDownBias,
    kKCache, kVCache, kColumns
};

template <typename T>
T* ptr(int64_t value) { return reinterpret_cast<T*>(static_cast<uintptr_t>(value)); }

// The kernels of one element type T: fp32 rows (float), or bf16 rows (uint16_t: bf16 weights,
// norm weights, cos/sin table and K/V cache; fp32 biases). A bf16 step attends in fp32, as
// the Python path's attention does: q widened, the output rounded back to bf16.
template <typename E>
struct Rows {
    typedef E T;
    static constexpr bool kBf16 = std::is_same_v<T, uint16_t>;
    typedef std::conditional_t<kBf16, uint32_t, float> Panel;  // a bf16 panel word holds two k
    template <typename A, typename B>
    static constexpr auto pick(A bf16, B fp32) {
        if constexpr (kBf16) return bf16; else return fp32;
    }
    static void gemm(const T* x, int64_t panels, int64_t bias, T* y, int64_t m, int64_t n, int64_t k, int64_t th) {
        pick(g_gemm->gemm_bf16, g_gemm->gemm)(x, ptr<const Panel>(panels), ptr<const float>(bias), y, m, n, k, th);
    }
    static void rmsnorm(const T* x, const T* res, int64_t w, T* out, T* res_out, int64_t rows, int64_t n, float eps) {
        pick(g_ops->rmsnorm_bf16, g_ops->rmsnorm)(x, res, ptr<const T>(w), out, res_out, rows, n, eps);
    }
    static void rotary(const int64_t* pos, const T* q, int64_t qs, const T* k, int64_t ks, T* q_out, T* k_out,
                       uintptr_t table, int64_t rows, int64_t tokens, int64_t qh, int64_t kh, int64_t d,
                       int64_t rot, bool neox, int64_t th) {
        pick(g_ops->rotary_bf16, g_ops->rotary)(pos, q, qs, k, ks, q_out, k_out, ptr<const T>(table), rows,
                                                tokens, qh, kh, d, rot, neox, th);
    }
    static void silu_mul(const T* x, T* out, int64_t rows, int64_t d, int64_t th) {
        pick(g_ops->silu_mul_bf16, g_ops->silu_mul)(x, out, rows, d, th);
    }
};

// What forward() passes for the attention of every layer (see attention.StepPlan).
struct AttendArgs {
    uintptr_t req_to_token, pool_rows, seq_lens, ext_lens, starts, tree;
    int64_t r2t_stride, tree_n, batch;
    bool verify;
    double scale;
};

// o [T, H * D] <- attention of q [T, H * D] over the layer's cache (and this step's k/v rows on
// a verify). fp32 rows directly; bf16 through fp32 copies of q and o.
template <typename R>
void attend(const AttendArgs& a, const typename R::T* q, typename R::T* o, int64_t k_cache, int64_t v_cache,
            const typename R::T* k_new, const typename R::T* v_new, int64_t tokens, int64_t heads,
            int64_t kv_heads, int64_t head_dim, int64_t threads, std::vector<float>& qf, std::vector<float>& of) {
    const float* q32 = reinterpret_cast<const float*>(q);
    float* o32 = reinterpret_cast<float*>(o);
    if constexpr (R::kBf16) {
        for (int64_t i = 0; i < tokens * heads * head_dim; ++i) qf[i] = bf16_to_f32(q[i]);
        q32 = qf.data();
        o32 = of.data();
    }
    g_attention->attend(q32, o32, ptr<const void>(k_cache), ptr<const void>(v_cache), a.verify ? k_new : nullptr,
                        a.verify ? v_new : nullptr, reinterpret_cast<const int32_t*>(a.req_to_token),
                        reinterpret_cast<const int64_t*>(a.pool_rows), reinterpret_cast<const int64_t*>(a.seq_lens),
                        reinterpret_cast<const int64_t*>(a.ext_lens), reinterpret_cast<const int64_t*>(a.starts),
                        reinterpret_cast<const uint8_t*>(a.tree), a.tree_n, a.batch, heads, kv_heads, head_dim,
                        head_dim, a.r2t_stride, a.scale, 0.0, R::kBf16, true, threads);
    if constexpr (R::kBf16)
        for (int64_t i = 0; i < tokens * heads * head_dim; ++i) o[i] = f32_to_bf16(of[i]);
}

// out [T, hidden] <- the stack on embeddings [T, hidden], rows of R::T. `layers` [L][kColumns].
template <typename R>
void run_stack(const typename R::T* embed, typename R::T* out_rows, const int64_t* layers, int64_t num_layers,
               int64_t final_norm, float eps, int64_t tokens, int64_t hidden, int64_t heads, int64_t kv_heads,
               int64_t head_dim, int64_t inter, const int64_t* pos, uintptr_t cos_sin, int64_t table_rows,
               int64_t rot_dim, bool neox, const AttendArgs& a, uintptr_t cache_loc, int64_t cache_rows,
               int64_t threads) {
    typedef typename R::T T;
    const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim;  // V heads as wide as K
    const int64_t qkv_n = q_size + 2 * kv_size;
    // scratch, [T, width] each
    std::vector<T> hid(tokens * hidden), res(tokens * hidden), x(tokens * hidden), qkv(tokens * qkv_n),
        q(tokens * q_size), k(tokens * kv_size), v(a.verify ? tokens * kv_size : 0), o(tokens * q_size),
        gate_up(tokens * 2 * inter), act(tokens * inter);
    std::vector<float> qf(R::kBf16 ? tokens * q_size : 0), of(R::kBf16 ? tokens * q_size : 0);
    for (int64_t l = 0; l < num_layers; ++l) {
        const int64_t* w = layers + l * kColumns;
        if (l == 0) {  // the residual stream starts as the embedding
            R::rmsnorm(embed, nullptr, w[kInNorm], x.data(), nullptr, tokens, hidden, eps);
            std::memcpy(res.data(), embed, sizeof(T) * tokens * hidden);
        } else {
            R::rmsnorm(hid.data(), res.data(), w[kInNorm], x.data(), res.data(), tokens, hidden, eps);
        }
        // attention
        R::gemm(x.data(), w[kQkv], w[kQkvBias], qkv.data(), tokens, qkv_n, hidden, threads);
        R::rotary(pos, qkv.data(), qkv_n, qkv.data() + q_size, qkv_n, q.data(), k.data(), cos_sin, table_rows, tokens,
                  heads, kv_heads, head_dim, rot_dim, neox, threads);
        const T* v_rows = qkv.data() + q_size + kv_size;  // row stride qkv_n
        g_attention->store_kv(ptr<void>(w[kKCache]), ptr<void>(w[kVCache]), k.data(), v_rows, kv_size * sizeof(T),
                              qkv_n * sizeof(T), reinterpret_cast<const int64_t*>(cache_loc), tokens,
                              kv_size * sizeof(T), kv_size * sizeof(T), cache_rows);
        if (a.verify)
            for (int64_t t = 0; t < tokens; ++t)
                std::memcpy(v.data() + t * kv_size, v_rows + t * qkv_n, sizeof(T) * kv_size);
        attend<R>(a, q.data(), o.data(), w[kKCache], w[kVCache], k.data(), v.data(), tokens, heads, kv_heads, head_dim,
                  threads, qf, of);
        R::gemm(o.data(), w[kO], w[kOBias], hid.data(), tokens, hidden, q_size, threads);
        // MLP
        R::rmsnorm(hid.data(), res.data(), w[kPostNorm], x.data(), res.data(), tokens, hidden, eps);
        R::gemm(x.data(), w[kGateUp], w[kGateUpBias], gate_up.data(), tokens, 2 * inter, hidden, threads);
        R::silu_mul(gate_up.data(), act.data(), tokens, inter, threads);
        R::gemm(act.data(), w[kDown], w[kDownBias], hid.data(), tokens, hidden, inter, threads);
    }
    R::rmsnorm(hid.data(), res.data(), final_norm, out_rows, x.data(), tokens, hidden, eps);
}

// out [T, hidden] <- the stack on embeddings [T, hidden], fp32 or (`bf16`) bf16 rows.
// `layers` [L][kColumns] int64. The attention arguments are those of attention.StepPlan (int64
// per-request arrays, the cache rows of this step's tokens, the tree bytes or 0; `verify`
// passes the new K/V rows).
void forward(uintptr_t embeddings, uintptr_t out, uintptr_t layer_table, int64_t num_layers,
             uintptr_t final_norm, double eps, int64_t tokens, int64_t hidden, int64_t heads,
             int64_t kv_heads, int64_t head_dim, int64_t inter, uintptr_t positions,
             uintptr_t cos_sin, int64_t table_rows, int64_t rot_dim, bool neox,
             uintptr_t req_to_token, int64_t r2t_stride, uintptr_t pool_rows, uintptr_t seq_lens,
             uintptr_t ext_lens, uintptr_t starts, uintptr_t cache_loc, int64_t cache_rows,
             uintptr_t tree, int64_t tree_n, int64_t batch, bool verify, double scale,
             int64_t threads, bool bf16) {
    if (!bound()) throw std::runtime_error("decoder_step.bind() has not been called");
    if (num_layers <= 0 || tokens <= 0 || hidden <= 0 || heads <= 0 || kv_heads <= 0 || head_dim <= 0 ||
        inter <= 0 || heads % kv_heads != 0)
        throw std::invalid_argument("decoder step needs layers, tokens and shapes > 0, heads % kv_heads == 0");
    const AttendArgs a{req_to_token, pool_rows, seq_lens, ext_lens, starts, tree, r2t_stride, tree_n, batch,
                       verify, scale};
    const auto* layers = reinterpret_cast<const int64_t*>(layer_table);
    const auto* pos = reinterpret_cast<const int64_t*>(positions);
    const int64_t norm = static_cast<int64_t>(final_norm);
    py::gil_scoped_release release;
    if (bf16)
        run_stack<Rows<uint16_t>>(ptr<const uint16_t>(embeddings), ptr<uint16_t>(out), layers, num_layers, norm,
                            static_cast<float>(eps), tokens, hidden, heads, kv_heads, head_dim, inter, pos, cos_sin,
                            table_rows, rot_dim, neox, a, cache_loc, cache_rows, threads);
    else
        run_stack<Rows<float>>(ptr<const float>(embeddings), ptr<float>(out), layers, num_layers, norm,
                            static_cast<float>(eps), tokens, hidden, heads, kv_heads, head_dim, inter, pos, cos_sin,
                            table_rows, rot_dim, neox, a, cache_loc, cache_rows, threads);
}

}  // namespace

PYBIND11_MODULE(_rhyme_step, m) {
    m.doc() = "A Llama/Qwen2 decoder stack for one CPU decode or verify step (see decoder_step.cpp)";
    m.def("bind", &bind);
    m.def("bound", &bound);
    m.def("forward", &forward);
    m.attr("COLUMNS") = static_cast<int64_t>(kColumns);
    m.attr("BF16") = true;  // forward() takes bf16 models (its last argument)
}
