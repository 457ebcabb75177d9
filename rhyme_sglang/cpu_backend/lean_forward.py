"""sglang's Llama and Qwen2 decoder stacks for CPU decode and verify steps, without per-op dispatch.

A SmolLM2-135M decode step at batch 1 spent ~60% of its time outside the GEMMs (AVX2,
2 kernel threads): each of the 30 layers walks sglang's stage boundaries, the
``CustomOp``/``BaseFusedOp`` dispatch of its norms and rotary, the parallel-linear wrappers and
the patched quant method, ``RadixAttention`` and a boxed ``torch.ops`` call into the attention.
On a GPU CUDA graphs hide this; a CPU eager step pays it on every layer.

:func:`forward` computes what ``LlamaModel.forward`` (or ``Qwen2Model.forward``) computes,
layer by layer, calling **the same kernels** the patched sglang path reaches (:mod:`.small_ops`
norms, rotary and SiLU-and-mul, :func:`.linear.linear` with each layer's measured kernel choice,
the native paged attention through an :class:`.step_plan.StepPlan` or else the backend's own
``forward``) in the same order, so its outputs are the same bits. Where every one of those
kernels is native, :mod:`.native_step` runs the same calls from one C++ loop instead. It applies
only where every piece is the plain one (:func:`model_fits`: one rank, unquantized fp32 or
bf16 CPU weights, no LoRA, the plain norm and rotary, sglang's ``intel_amx`` backend on our
stand-in ops) and only to DECODE and TARGET_VERIFY batches; prefill and anything else keeps
sglang's path.

``RHYME_CPU_LEAN``: ``on`` (default), ``off`` (sglang's path everywhere), ``check`` (both paths
on every lean-eligible forward, raising if their hidden states differ in any bit: for tests).
"""

from __future__ import annotations

import logging
import sys
from typing import Optional

import torch
import torch.nn.functional as F

from rhyme_sglang.cpu_backend import linear, native_step, small_ops, step_plan
from rhyme_sglang import settings as _settings

logger = logging.getLogger(__name__)
MODE_ENV = _settings.ENV_NAMES["cpu_lean"]
_FITS_ATTR = "_rhyme_lean_fits"


def mode(env: Optional[dict] = None) -> str:
    return _settings.of(env).cpu_lean


class LeanMismatch(RuntimeError):
    """``RHYME_CPU_LEAN=check`` found the lean and sglang paths disagreeing."""


_DTYPES = (torch.float32, torch.bfloat16)


def _plain_linear(module, unquant, dtype: torch.dtype) -> bool:
    weight = getattr(module, "weight", None)
    return (isinstance(getattr(module, "quant_method", None), unquant.UnquantizedLinearMethod)
            and weight is not None and weight.dtype == dtype
            and weight.device.type == "cpu" and weight.dim() == 2
            and not weight.requires_grad and not getattr(module, "use_intel_amx_backend", False)
            and not getattr(module, "skip_bias_add", False) and not hasattr(module, "set_lora")
            and (getattr(module, "bias", None) is None or module.bias.dtype == dtype))


def _plain_norm(norm, dtype: torch.dtype) -> bool:
    """An RMSNorm of ``dtype`` weights that computes as sglang's plain one (in bf16 the sum
    rounded to bf16 as the residual, the output rounded once: :mod:`.small_ops`)."""
    weight = getattr(norm, "weight", None)
    return (weight is not None and weight.dtype == dtype and weight.dim() == 1
            and weight.device.type == "cpu" and weight.is_contiguous()
            and getattr(norm, "variance_size_override", None) is None
            and getattr(norm, "override_orig_dtype", None) in (None, dtype)
            and (dtype == torch.float32 or not (getattr(norm, "fp32_residual", False)
                                                or getattr(norm, "cast_x_before_out_mul", False))))


def _check_model(model) -> bool:
    """Whether every layer of ``model`` (a model class of :data:`FAMILIES`) is the plain kind
    this path computes."""
    from sglang.srt.distributed.utils import get_group_rank_size
    from sglang.srt.layers.activation import SiluAndMul
    from sglang.srt.layers.quantization import unquant
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding

    family = _CLASSES.get(type(model))
    dtype = getattr(getattr(model, "norm", None), "weight", torch.empty(0)).dtype
    if (family is None or dtype not in _DTYPES or model.pp_group.world_size != 1
            or model.layers_to_capture or not _plain_norm(model.norm, dtype) or _on_policy_target()):
        return False
    layer_cls, attn_cls, mlp_cls = family
    for i in range(model.start_layer, model.end_layer):
        layer = model.layers[i]
        if type(layer) is not layer_cls:
            return False
        attn, mlp = layer.self_attn, layer.mlp
        rotary = attn.rotary_emb
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if (type(attn) is not attn_cls or type(mlp) is not mlp_cls
                or type(rotary) is not RotaryEmbedding or type(mlp.act_fn) is not SiluAndMul
                or not all(_plain_linear(m, unquant, dtype) for m in linears)
                or any(get_group_rank_size(getattr(m, "tp_group", None))[1] != 1 for m in linears)
                or not _plain_norm(layer.input_layernorm, dtype)
                or not _plain_norm(layer.post_attention_layernorm, dtype)
                or attn.attn.logit_cap or attn.attn.sliding_window_size not in (None, -1)
                or attn.attn.is_cross_attention):
            return False
    return True


def _on_policy_target() -> bool:
    """sglang's ``rl_on_policy_target`` mode casts MLP inputs to bf16 (Qwen2): not ours."""
    try:
        from sglang.srt.runtime_context import get_exec

        return get_exec().deterministic.rl_on_policy_target is not None
    except (ImportError, AttributeError):
        return False


def model_fits(model) -> bool:
    """:func:`_check_model`, decided once per model."""
    fits = getattr(model, _FITS_ATTR, None)
    if fits is None:
        fits = _check_model(model)
        setattr(model, _FITS_ATTR, fits)
        logger.info("cpu lean forward: %s for decode and verify steps",
                    "on" if fits else "off (a layer is not the plain fp32 or bf16 kind)")
    return fits


def batch_fits(forward_batch, input_ids: torch.Tensor, input_embeds, pp_proxy_tensors) -> bool:
    """Whether this batch takes the lean path: a DECODE or TARGET_VERIFY batch of token ids on
    the CPU, attended by sglang's ``intel_amx`` backend."""
    from sglang.srt.layers.attention.intel_amx_backend import IntelAMXAttnBackend
    from sglang.srt.model_executor.forward_context import get_attn_backend

    mode_ = forward_batch.forward_mode
    return (input_embeds is None and pp_proxy_tensors is None and input_ids.device.type == "cpu"
            and input_ids.numel() > 0 and (mode_.is_decode() or mode_.is_target_verify())
            and type(get_attn_backend()) is IntelAMXAttnBackend)


def _linear(module, x: torch.Tensor) -> torch.Tensor:
    return linear.linear(module, x, module.weight, module.bias)


class _Step:
    """One forward's kernels for the norms and rotary: the native ones where the first layer
    shows they fit (every layer has the same shapes and layouts), else sglang's modules."""

    __slots__ = ("native", "rotary_native", "plan")

    def __init__(self, hidden: torch.Tensor, plan):
        self.native = (small_ops.enabled() and hidden.dtype in _DTYPES
                       and hidden.device.type == "cpu")
        self.rotary_native = None  # decided at the first layer
        self.plan = plan  # the attention's StepPlan, or None

    def norm(self, norm, x: torch.Tensor, residual: Optional[torch.Tensor]):
        """``norm(x)`` / ``norm(x, residual)`` as sglang's ``RMSNorm`` returns them."""
        if (self.native and x.is_contiguous()
                and (residual is None or residual.is_contiguous())):
            return small_ops.rmsnorm(x, norm.weight.data, norm.variance_epsilon, residual)
        return norm(x) if residual is None else norm(x, residual)

    def rotary(self, rotary, positions, q, k):
        if self.rotary_native is None:
            self.rotary_native = self.native and small_ops.rotary_fits(
                positions, q, k, rotary.cos_sin_cache, rotary.head_size, rotary.rotary_dim)
        if self.rotary_native:
            return small_ops.rotary(positions, q, k, rotary.cos_sin_cache, rotary.head_size,
                                    rotary.rotary_dim, rotary.is_neox_style)
        return rotary(positions, q, k)


def _attention(step: _Step, layer, positions, x, forward_batch, backend) -> torch.Tensor:
    """``LlamaAttention.forward``: qkv, rotary, attention, o_proj. The attention runs on the
    forward's :class:`.step_plan.StepPlan` where there is one, else through the backend."""
    attn = layer.self_attn
    qkv = _linear(attn.qkv_proj, x)  # [T, (H + 2 Hkv) D]
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q, k = step.rotary(attn.rotary_emb, positions, q, k)  # contiguous copies
    radix = attn.attn
    if step.plan is not None and q.is_contiguous() and k.is_contiguous():
        pool = backend.token_to_kv_pool
        out = step.plan.attend(q, k, v, pool.get_key_buffer(radix.layer_id),
                               pool.get_value_buffer(radix.layer_id), radix.scaling)
    else:
        k = k.view(-1, radix.tp_k_head_num, radix.qk_head_dim)
        v = v.view(-1, radix.tp_v_head_num, radix.v_head_dim)
        out = backend.forward(q, k, v, radix, forward_batch)  # [T, H Dv]
    return _linear(attn.o_proj, out)


def _mlp(step: _Step, layer, x: torch.Tensor) -> torch.Tensor:
    mlp = layer.mlp
    gate_up = _linear(mlp.gate_up_proj, x)  # [T, 2 I]
    if step.native and small_ops.silu_mul_fits(gate_up):  # as the patched SiluAndMul
        return _linear(mlp.down_proj, small_ops.silu_mul(gate_up))
    d = gate_up.shape[-1] // 2
    return _linear(mlp.down_proj, F.silu(gate_up[..., :d]) * gate_up[..., d:])


def forward(model, input_ids: torch.Tensor, positions: torch.Tensor,
            forward_batch) -> torch.Tensor:
    """The model's ``forward``: its final hidden states [T, hidden] for a batch that
    :func:`batch_fits` a model that :func:`model_fits`."""
    from sglang.srt.model_executor.forward_context import get_attn_backend

    backend = get_attn_backend()
    first = model.layers[model.start_layer].self_attn.attn.layer_id
    pool = backend.token_to_kv_pool
    plan = step_plan.plan_step(backend, forward_batch, pool.get_key_buffer(first),
                               pool.get_value_buffer(first), input_ids.numel())
    out = native_step.run(model, input_ids, positions, pool, plan)
    if out is not None:
        return out
    hidden = model.embed_tokens(input_ids)  # [T, hidden]
    step = _Step(hidden, plan)
    residual = None
    for i in range(model.start_layer, model.end_layer):
        layer = model.layers[i]
        if residual is None:  # the first layer: the residual stream starts as the embedding
            x, residual = step.norm(layer.input_layernorm, hidden, None), hidden
        else:
            x, residual = step.norm(layer.input_layernorm, hidden, residual)
        hidden = _attention(step, layer, positions, x, forward_batch, backend)
        x, residual = step.norm(layer.post_attention_layernorm, hidden, residual)
        hidden = _mlp(step, layer, x)
    if residual is None:
        return step.norm(model.norm, hidden, None)
    return step.norm(model.norm, hidden, residual)[0]


# sglang model module -> (model, decoder layer, attention, MLP) class names whose forward
# this module computes (the same structure: fused qkv with optional bias, rotary, RadixAttention,
# o_proj, fused gate_up, SiLU-and-mul, down, pre-norms with the residual add)
FAMILIES = {
    "sglang.srt.models.llama": ("LlamaModel", "LlamaDecoderLayer", "LlamaAttention", "LlamaMLP"),
    "sglang.srt.models.qwen2": ("Qwen2Model", "Qwen2DecoderLayer", "Qwen2Attention", "Qwen2MLP"),
}
_CLASSES: dict = {}  # model class -> (layer, attention, MLP) classes, filled by patch_model


def patch_model(module) -> None:
    """Route the model class of ``module`` (a key of :data:`FAMILIES`) through :func:`forward`
    where it applies."""
    model_name, *parts = FAMILIES[module.__name__]
    cls = getattr(module, model_name)
    _CLASSES[cls] = tuple(getattr(module, name) for name in parts)
    original = cls.forward

    def lean_or_sglang(self, input_ids, positions, forward_batch, input_embeds=None,
                       pp_proxy_tensors=None):
        current = mode()
        if (current == "off" or not model_fits(self)
                or not batch_fits(forward_batch, input_ids, input_embeds, pp_proxy_tensors)):
            return original(self, input_ids, positions, forward_batch, input_embeds,
                            pp_proxy_tensors)
        if current == "check":  # sglang first; the lean pass writes the same K/V again
            expected = original(self, input_ids, positions, forward_batch)
            got = forward(self, input_ids, positions, forward_batch)
            if not torch.equal(expected, got):
                diff = (expected - got).abs().max().item()
                message = (f"lean forward differs from sglang's by up to {diff:.3g} "
                           f"({forward_batch.forward_mode}, {input_ids.numel()} tokens)")
                print(f"{MODE_ENV}=check: {message}", file=sys.stderr, flush=True)
                raise LeanMismatch(message)  # sglang stops the server (and its launcher)
            return got
        return forward(self, input_ids, positions, forward_batch)

    lean_or_sglang.__name__ = "forward"
    lean_or_sglang.__wrapped__ = original
    cls.forward = lean_or_sglang
