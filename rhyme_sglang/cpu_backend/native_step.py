"""The lean forward's decoder stack as one native call (``_native/decoder_step.cpp``).

:func:`.lean_forward.forward` computes a DECODE or TARGET_VERIFY step layer by layer in
Python, calling a native kernel ~10 times a layer. At batch 1 on a small model most of the
step went to Python between those calls (argument handling, tensor allocation, dispatch: ~35-40%
of a SmolLM2 batch-1 step, py-spy). :func:`run` makes the same kernel calls, in the
same order on the same inputs, from one C++ loop, so it returns the same bits.

It applies where the Python loop would call only native kernels: every linear's measured
choice for this row bucket is the native GEMM, the native norms, rotary and SiLU are on, and
the attention has a :class:`.step_plan.StepPlan`. Anything else returns None and the Python
loop runs. ``RHYME_CPU_STEP=python`` keeps the Python loop everywhere (``native``: default).
fp32 and bf16 models (bf16: where the native product runs bf16 weights, i.e. avx512_bf16).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from rhyme_sglang.cpu_backend import hugepages, linear, small_ops
from rhyme_sglang import settings as _settings
from rhyme_sglang.machine import kernel_threads

try:
    from . import _rhyme_attention, _rhyme_gemm, _rhyme_ops, _rhyme_step

    _rhyme_step.bind(_rhyme_gemm._kernels, _rhyme_ops._kernels, _rhyme_attention._kernels)
    _native = _rhyme_step
except (ImportError, AttributeError):  # a module not built (or built before kernels.h)
    _native = None

MODE_ENV = _settings.ENV_NAMES["cpu_step"]
_STACK_ATTR = "_rhyme_native_stack"
_DTYPES = (torch.float32, torch.bfloat16)
# per column of a layer's row (decoder_step.cpp's Column): the dtype of a model of dtype d is d,
# except the native panels (bf16: int32 words of two bf16) and the biases (fp32 always)
_PANELS = {torch.bfloat16: torch.int32}
_FP32 = {torch.bfloat16: torch.float32}
_COLUMN_DTYPES = ({}, {}) + (_PANELS, _FP32) * 4 + ({}, {})


def revisions() -> str:
    """The native kernels' revisions (GEMM, attention), ISA, the panels' page size
    (:func:`hugepages.mode`) and how the linears' kernels are chosen
    (``linear.MEASURE_METHOD``), or ``"none"`` where the modules are not built: what a CPU
    step's measured cost depends on besides the machine."""
    if _native is None:
        return "none"
    return (f"gemm-r{getattr(_rhyme_gemm, 'revision', 0)}-attention-r"
            f"{getattr(_rhyme_attention, 'revision', 1)}-{_rhyme_gemm.isa()}-"
            f"{linear.MEASURE_METHOD}-{hugepages.mode()}")


def takes_bf16() -> bool:
    """Whether the built decoder step runs bf16 models (its products need avx512_bf16)."""
    return _native is not None and getattr(_native, "BF16", False) and linear.native_bf16()


def enabled(env: Optional[dict] = None) -> bool:
    return _settings.of(env).cpu_step == "native" and _native is not None


class _Stack(NamedTuple):
    """One model's layer table for one row bucket: per layer the pointers decoder_step.cpp
    reads (norm weights, native panels and biases, K/V cache), and the tensors behind them.
    ``table`` None: this model does not fit the native loop for this key (kept, so the check
    is not repeated every forward)."""

    key: tuple
    table: Optional[torch.Tensor]
    keep: tuple = ()
    dims: tuple = ()
    rotary: object = None
    scale: float = 0.0
    final_norm: Optional[torch.Tensor] = None
    eps: float = 0.0
    dtype: torch.dtype = torch.float32  # of the rows, norm weights, cos/sin table and K/V cache


class _NotYet(Exception):
    """A linear has no kernel state yet (the Python loop makes it): try again next forward."""


def _build(model, pool, bucket: int, key) -> _Stack:
    """The layer table, or a misfit (``table`` None) where a piece is not what the native loop
    computes; raises :class:`_NotYet` where the answer may still change."""
    misfit = _Stack(key, None)
    layers = [model.layers[i] for i in range(model.start_layer, model.end_layer)]
    if not layers:
        return misfit
    first = layers[0].self_attn
    rotary, radix = first.rotary_emb, first.attn
    cos_sin = rotary.cos_sin_cache
    dtype = model.norm.weight.dtype
    head_dim, heads, kv_heads = radix.qk_head_dim, radix.tp_q_head_num, radix.tp_k_head_num
    if (dtype not in _DTYPES or radix.v_head_dim != head_dim or first.q_size != heads * head_dim
            or first.kv_size != kv_heads * head_dim or cos_sin.dtype != dtype
            or cos_sin.device.type != "cpu" or not cos_sin.is_contiguous() or cos_sin.dim() != 2
            or cos_sin.shape[1] != rotary.rotary_dim or rotary.rotary_dim % 2
            or not 0 < rotary.rotary_dim <= rotary.head_size or rotary.head_size != head_dim):
        return misfit
    rows, keep, caches = [], [], []
    eps = layers[0].input_layernorm.variance_epsilon
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        other = attn.rotary_emb
        if (other is not rotary and (other.cos_sin_cache is not cos_sin
                                     or other.rotary_dim != rotary.rotary_dim
                                     or other.is_neox_style != rotary.is_neox_style)) \
                or attn.attn.scaling != radix.scaling \
                or layer.input_layernorm.variance_epsilon != eps \
                or layer.post_attention_layernorm.variance_epsilon != eps:
            return misfit
        row = [layer.input_layernorm.weight.data, layer.post_attention_layernorm.weight.data]
        for module in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            state = getattr(module, linear._STATE_ATTR, None)
            if state is None:  # the Python loop has not run this layer yet: it sets the state
                raise _NotYet
            if state.choice[bucket] != "native":
                return misfit
            panels = state.pack_for("native", module.weight)
            if panels is None:
                return misfit
            bias = getattr(module, "bias", None)
            if bias is not None:  # fp32, as the native products add it
                bias = bias.detach().to(torch.float32).contiguous()
            row += [panels, bias]
        kv = [pool.get_key_buffer(attn.attn.layer_id), pool.get_value_buffer(attn.attn.layer_id)]
        caches += kv
        row += kv
        if any(t is not None and (t.dtype != _COLUMN_DTYPES[i].get(dtype, dtype)
                                  or not t.is_contiguous()) for i, t in enumerate(row)):
            return misfit
        keep += [t for t in row if t is not None]
        rows.append([0 if t is None else t.data_ptr() for t in row])
    if len(rows[0]) != _native.COLUMNS or model.norm.variance_epsilon != eps:
        return misfit
    inter = layers[0].mlp.down_proj.weight.shape[1]
    hidden = layers[0].mlp.down_proj.weight.shape[0]
    cache_rows = min(t.shape[0] for t in caches)  # the store checks every row against it
    dims = (hidden, heads, kv_heads, head_dim, inter, cache_rows)
    return _Stack(key, torch.tensor(rows, dtype=torch.int64), tuple(keep), dims, rotary,
                  float(radix.scaling), model.norm.weight.data, eps, dtype)


def run(model, input_ids: torch.Tensor, positions: torch.Tensor, pool, plan) -> Optional[torch.Tensor]:
    """The final hidden states [T, hidden] of ``model`` for this step, computed natively, or
    None where the Python loop must run (see the module's docstring)."""
    tokens = input_ids.numel()
    if (plan is None or not enabled() or not small_ops.enabled() or positions.numel() != tokens
            or positions.dtype != torch.int64 or not positions.is_contiguous()):
        return None
    bucket = linear.bucket_index(tokens)
    first = model.layers[model.start_layer].self_attn.attn.layer_id
    key = (bucket, linear.generation(), pool.get_key_buffer(first).data_ptr())
    stacks = getattr(model, _STACK_ATTR, None)
    if stacks is None:
        stacks = {}
        setattr(model, _STACK_ATTR, stacks)
    stack = stacks.get(bucket)
    if stack is None or stack.key != key:
        try:
            stack = stacks[bucket] = _build(model, pool, bucket, key)
        except _NotYet:
            return None
    if stack.table is None:
        return None
    embeddings = model.embed_tokens(input_ids)  # [T, hidden]
    if embeddings.dtype != stack.dtype or not embeddings.is_contiguous():
        return None
    hidden, heads, kv_heads, head_dim, inter, cache_rows = stack.dims
    out = torch.empty(tokens, hidden, dtype=stack.dtype)
    rotary = stack.rotary
    req_to_token = plan.req_to_token
    longs = plan.longs
    tree = plan.tree
    _native.forward(
        embeddings.data_ptr(), out.data_ptr(), stack.table.data_ptr(), stack.table.shape[0],
        stack.final_norm.data_ptr(), float(stack.eps), tokens, hidden, heads, kv_heads, head_dim,
        inter, positions.data_ptr(), rotary.cos_sin_cache.data_ptr(), rotary.cos_sin_cache.shape[0],
        rotary.rotary_dim, bool(rotary.is_neox_style), req_to_token.data_ptr(),
        req_to_token.stride(0), *(x.data_ptr() for x in longs), plan.cache_loc.data_ptr(),
        cache_rows, 0 if tree is None else tree.data_ptr(),
        0 if tree is None else tree.shape[-1], longs[0].shape[0], plan.verify, stack.scale,
        kernel_threads(), stack.dtype == torch.bfloat16)
    return out
