// The native CPU kernels as plain function pointers, so one module can call another's kernels
// without Python in between (the decoder step of decoder_step.cpp calls the GEMM, norm,
// rotary, SiLU and attention kernels of the other modules 10+ times a layer).
//
// Each kernel module publishes its table as a capsule attribute `_kernels` (named by the
// struct below); decoder_step.cpp receives the capsules from Python at bind time. Calling the
// very functions the Python wrappers call keeps the results bit-identical between the two
// paths. None of these functions touches the GIL: callers release it around them.
#pragma once

#include <cstdint>

namespace rhyme_kernels {

constexpr int kVersion = 3;  // bumped when a signature below changes

// _rhyme_gemm: y[m, n] = x[m, k] @ w^T (+ bias), w panel-packed (skinny_gemm.cpp); gemm_bf16
// with bf16 x, w and y (fp32 bias; AVX512_BF16 only).
struct Gemm {
    int version;
    void (*gemm)(const float* x, const float* panels, const float* bias, float* y, int64_t m,
                 int64_t n, int64_t k, int64_t threads);
    void (*gemm_bf16)(const uint16_t* x, const uint32_t* panels, const float* bias, uint16_t* y,
                      int64_t m, int64_t n, int64_t k, int64_t threads);
};

// _rhyme_ops: RMSNorm (with the residual add), rotary embedding, SiLU-and-mul (small_ops.cpp).
struct Ops {
    int version;
    void (*rmsnorm)(const float* x, const float* residual, const float* weight, float* out,
                    float* residual_out, int64_t rows, int64_t n, float eps);
    void (*rotary)(const int64_t* positions, const float* q, int64_t q_stride, const float* k,
                   int64_t k_stride, float* q_out, float* k_out, const float* cos_sin,
                   int64_t table_rows, int64_t tokens, int64_t q_heads, int64_t k_heads,
                   int64_t head_size, int64_t rot_dim, bool neox, int64_t threads);
    void (*silu_mul)(const float* x, float* out, int64_t rows, int64_t d, int64_t threads);
    // the same on bf16 rows (bf16 weights and cos/sin table), rounding as PyTorch's bf16 ops
    void (*rmsnorm_bf16)(const uint16_t* x, const uint16_t* residual, const uint16_t* weight,
                         uint16_t* out, uint16_t* residual_out, int64_t rows, int64_t n, float eps);
    void (*rotary_bf16)(const int64_t* positions, const uint16_t* q, int64_t q_stride,
                        const uint16_t* k, int64_t k_stride, uint16_t* q_out, uint16_t* k_out,
                        const uint16_t* cos_sin, int64_t table_rows, int64_t tokens,
                        int64_t q_heads, int64_t k_heads, int64_t head_size, int64_t rot_dim,
                        bool neox, int64_t threads);
    void (*silu_mul_bf16)(const uint16_t* x, uint16_t* out, int64_t rows, int64_t d, int64_t threads);
};

// _rhyme_attention: paged attention and the K/V store (paged_attention.cpp).
struct Attention {
    int version;
    void (*attend)(const float* q, float* o, const void* k_cache, const void* v_cache,
                   const void* k_new, const void* v_new, const int32_t* req_to_token,
                   const int64_t* pool_rows, const int64_t* seq_lens, const int64_t* ext_lens,
                   const int64_t* starts, const uint8_t* tree, int64_t tree_n, int64_t batch,
                   int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t v_dim,
                   int64_t r2t_stride, double scale, double logit_cap, bool kv_bf16, bool causal,
                   int64_t threads);
    void (*store_kv)(void* k_cache, void* v_cache, const void* k_src, const void* v_src,
                     int64_t k_src_stride, int64_t v_src_stride, const int64_t* loc, int64_t rows,
                     int64_t k_row, int64_t v_row, int64_t capacity);
};

}  // namespace rhyme_kernels
