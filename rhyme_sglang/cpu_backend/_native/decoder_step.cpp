// A Llama/Qwen2 decoder stack for one CPU decode or verify step, as one call: per layer
// RMSNorm (+ residual), qkv product (+ bias), rotary, K/V store, paged attention, o product,
// RMSNorm (+ residual), gate_up product, SiLU-and-mul, down product; then the final norm.
//
// Why: at batch 1 a SmolLM2-135M step is ~150 kernel calls of 10-400 us; from Python each
// costs 10-40 us of argument handling, tensor allocation and dispatch (~35-40% of a batch-1
// step, py-spy, stop 37, AVX2 EPYC). Here the loop runs in C++ with the GIL released once.
//
// Lossless: it calls the very kernels the Python path (lean_forward.py) calls, through the
// function tables the other modules publish (kernels.h), in the same order on the same
// inputs, so it gives the same bits; RHYME_CPU_LEAN=check compares it with sglang's path.
// Nothing here does arithmetic of its own: the only data movement is one exact copy (the
// verify step's new V rows, made contiguous as the Python path's .contiguous() does).

#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels.h"

namespace py = pybind11;

namespace {

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

// out [T, hidden] <- the stack on embeddings [T, hidden]. `layers` [L][kColumns] int64.
// The attention arguments are those of attention.StepPlan (int64 per-request arrays, the
// cache rows of this step's tokens, the tree bytes or 0; `verify` passes the new K/V rows).
void forward(uintptr_t embeddings, uintptr_t out, uintptr_t layer_table, int64_t num_layers,
             uintptr_t final_norm, double eps, int64_t tokens, int64_t hidden, int64_t heads,
             int64_t kv_heads, int64_t head_dim, int64_t inter, uintptr_t positions,
             uintptr_t cos_sin, int64_t table_rows, int64_t rot_dim, bool neox,
             uintptr_t req_to_token, int64_t r2t_stride, uintptr_t pool_rows, uintptr_t seq_lens,
             uintptr_t ext_lens, uintptr_t starts, uintptr_t cache_loc, int64_t cache_rows,
             uintptr_t tree, int64_t tree_n, int64_t batch, bool verify, double scale,
             int64_t threads) {
    if (!bound()) throw std::runtime_error("decoder_step.bind() has not been called");
    if (num_layers <= 0 || tokens <= 0 || hidden <= 0 || heads <= 0 || kv_heads <= 0 || head_dim <= 0 ||
        inter <= 0 || heads % kv_heads != 0)
        throw std::invalid_argument("decoder step needs layers, tokens and shapes > 0, heads % kv_heads == 0");
    const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim;  // V heads as wide as K
    const int64_t qkv_n = q_size + 2 * kv_size;
    const auto* layers = reinterpret_cast<const int64_t*>(layer_table);
    const float* embed = reinterpret_cast<const float*>(embeddings);
    const float f_eps = static_cast<float>(eps);

    py::gil_scoped_release release;
    // scratch, [T, width] each
    std::vector<float> hid(tokens * hidden), res(tokens * hidden), x(tokens * hidden),
        qkv(tokens * qkv_n), q(tokens * q_size), k(tokens * kv_size),
        v(verify ? tokens * kv_size : 0), o(tokens * heads * head_dim), gate_up(tokens * 2 * inter),
        act(tokens * inter);
    const auto* pos = reinterpret_cast<const int64_t*>(positions);
    for (int64_t l = 0; l < num_layers; ++l) {
        const int64_t* w = layers + l * kColumns;
        if (l == 0) {  // the residual stream starts as the embedding
            g_ops->rmsnorm(embed, nullptr, ptr<const float>(w[kInNorm]), x.data(), nullptr, tokens, hidden, f_eps);
            std::memcpy(res.data(), embed, sizeof(float) * tokens * hidden);
        } else {
            g_ops->rmsnorm(hid.data(), res.data(), ptr<const float>(w[kInNorm]), x.data(), res.data(), tokens,
                           hidden, f_eps);
        }
        // attention
        g_gemm->gemm(x.data(), ptr<const float>(w[kQkv]), ptr<const float>(w[kQkvBias]), qkv.data(), tokens,
                     qkv_n, hidden, threads);
        g_ops->rotary(pos, qkv.data(), qkv_n, qkv.data() + q_size, qkv_n, q.data(), k.data(),
                      reinterpret_cast<const float*>(cos_sin), table_rows, tokens, heads, kv_heads, head_dim,
                      rot_dim, neox);
        const float* v_rows = qkv.data() + q_size + kv_size;  // row stride qkv_n
        g_attention->store_kv(ptr<void>(w[kKCache]), ptr<void>(w[kVCache]), k.data(), v_rows,
                              kv_size * sizeof(float), qkv_n * sizeof(float),
                              reinterpret_cast<const int64_t*>(cache_loc), tokens, kv_size * sizeof(float),
                              kv_heads * head_dim * sizeof(float), cache_rows);
        if (verify)
            for (int64_t t = 0; t < tokens; ++t)
                std::memcpy(v.data() + t * kv_size, v_rows + t * qkv_n, sizeof(float) * kv_size);
        g_attention->attend(q.data(), o.data(), ptr<const void>(w[kKCache]), ptr<const void>(w[kVCache]),
                            verify ? k.data() : nullptr, verify ? v.data() : nullptr,
                            reinterpret_cast<const int32_t*>(req_to_token),
                            reinterpret_cast<const int64_t*>(pool_rows),
                            reinterpret_cast<const int64_t*>(seq_lens),
                            reinterpret_cast<const int64_t*>(ext_lens),
                            reinterpret_cast<const int64_t*>(starts), reinterpret_cast<const uint8_t*>(tree),
                            tree_n, batch, heads, kv_heads, head_dim, head_dim, r2t_stride, scale, 0.0, false,
                            true, threads);
        g_gemm->gemm(o.data(), ptr<const float>(w[kO]), ptr<const float>(w[kOBias]), hid.data(), tokens, hidden,
                     heads * head_dim, threads);
        // MLP
        g_ops->rmsnorm(hid.data(), res.data(), ptr<const float>(w[kPostNorm]), x.data(), res.data(), tokens,
                       hidden, f_eps);
        g_gemm->gemm(x.data(), ptr<const float>(w[kGateUp]), ptr<const float>(w[kGateUpBias]), gate_up.data(),
                     tokens, 2 * inter, hidden, threads);
        g_ops->silu_mul(gate_up.data(), act.data(), tokens, inter);
        g_gemm->gemm(act.data(), ptr<const float>(w[kDown]), ptr<const float>(w[kDownBias]), hid.data(), tokens,
                     hidden, inter, threads);
    }
    g_ops->rmsnorm(hid.data(), res.data(), reinterpret_cast<const float*>(final_norm), reinterpret_cast<float*>(out),
                   x.data(), tokens, hidden, f_eps);
}

}  // namespace

PYBIND11_MODULE(_rhyme_step, m) {
    m.doc() = "A Llama/Qwen2 decoder stack for one CPU decode or verify step (see decoder_step.cpp)";
    m.def("bind", &bind);
    m.def("bound", &bound);
    m.def("forward", &forward);
    m.attr("COLUMNS") = static_cast<int64_t>(kColumns);
}
