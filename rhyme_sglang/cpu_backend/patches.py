"""The few sglang patches the CPU backend needs, each named, applied per module.

Applied by :mod:`.bootstrap` right after the target module executes, only while the
``sgl_kernel`` stand-in is active (never next to a real CUDA ``sgl_kernel``):

* ``keep_intel_amx_attention`` (``sglang.srt.arg_groups.overrides``): sglang rewrites
  ``--attention-backend intel_amx`` to ``torch_native`` when its AMX GEMM op is missing;
  torch_native cannot run speculative TARGET_VERIFY batches, and our stand-in implements
  the intel_amx attention ops, so we declare the platform AMX-capable for that choice.
* ``lossless_sampling_verify`` (``sglang.srt.speculative.eagle_utils``): on CPU sglang
  commits the target argmax even for sampled requests (no CPU sampling-verify kernel);
  we route sampled requests through our lossless tree verification, whose target
  probabilities are computed only for the tree rows the walk reads and filtered as plain
  decoding filters them (sglang's verify renormalises top-k before top-p and drops min-p).
* ``fast_cpu_sampling`` (``sglang.srt.layers.sampler``): plain sampling draws each row with
  its seed (:func:`.seeded.seeded_sample_rows`; unseeded, :func:`.sampling.sample_rows`)
  instead of ``torch.multinomial``, which costs ~1.8 ms a row on CPU at a 49k-token
  vocabulary; top-k / top-p / min-p rows are filtered as a verify filters them
  (:func:`.sampling.filter_row`). Same distribution; ``RHYME_CPU_SAMPLING=torch`` keeps
  sglang's own draw (and ignores seeds, as sglang does without deterministic inference).
* ``seeded_cpu_sampling`` (``sglang.srt.sampling.sampling_batch_info``): every CPU batch
  carries its requests' seeds (``sampling_seed``, or a random one per request), so a plain
  step and a verify draw a position's token alike; the verify's walk draws seeded rows itself
  (``lossless_sampling_verify`` replaces sglang's Triton-hashed coins with plain ones).
* ``packed_cpu_linear`` (``sglang.srt.layers.quantization.unquant``) and
  ``packed_cpu_lm_head`` (``sglang.srt.layers.logits_processor``): CPU linears and the
  lm_head run through :mod:`.linear` (oneDNN with packed weights at the row counts where this
  machine measures it faster than ``F.linear``).
* ``ragged_verify_metadata`` (``sglang.srt.layers.attention.intel_amx_backend``): a RHYME
  verify whose requests verify different numbers of tree nodes (``rhyme_verify_lens`` on its
  spec input, see ``sglang_ext/step_kinds.py: ragged_verify``) gets per-request extend
  lengths and its ``[bs, n, n]`` trees; sglang's own verify (every request ``n`` nodes) is
  passed through unchanged.
* ``native_cpu_rmsnorm`` (``sglang.srt.layers.layernorm``) and ``native_cpu_rotary``
  (``sglang.srt.layers.rotary_embedding.base``): the plain fp32 or bf16 RMSNorm (with or without
  the residual add) and rotary embedding run as one native call each (:mod:`.small_ops`)
  instead of sglang's 7-25 PyTorch ops; every other variant keeps sglang's ``forward_native``.
* ``lean_cpu_forward`` (``sglang.srt.models.llama``, ``.qwen2``): the model's forward of a
  DECODE or TARGET_VERIFY batch runs the same kernels without sglang's per-layer dispatch
  (:mod:`.lean_forward`; ``RHYME_CPU_LEAN=off`` keeps sglang's path). The attention backend
  also calls our attention functions directly instead of through the boxed
  ``torch.ops.sgl_kernel`` dispatcher (``direct_attention_calls``).
* ``repack_after_weight_updates``
  (``sglang.srt.model_executor.model_runner_components.weight_updater``): every in-place
  weight update marks the packs of :mod:`.linear` stale.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)
APPLIED: set[str] = set()


def keep_intel_amx_attention(overrides_module) -> None:
    from sglang.srt import runtime_context

    runtime_context.override_platform(has_amx=True).install()
    APPLIED.add("keep_intel_amx_attention")


def lossless_sampling_verify(eagle_utils) -> None:
    import torch

    from rhyme_sglang.cpu_backend import sampling

    def _verify_uses_greedy(*, is_all_greedy, is_cpu, is_hip, is_xpu, use_rejection_sampling):
        return is_all_greedy or is_xpu or (is_hip and not use_rejection_sampling)

    eagle_utils._verify_uses_greedy = _verify_uses_greedy
    original_coins = eagle_utils._verify_coins

    def _verify_coins(*, sampling_info, seq_lens, draft_token_num, candidates, device):
        if torch.device(device).type != "cpu" or sampling_info.sampling_seed is None:
            return original_coins(sampling_info=sampling_info, seq_lens=seq_lens,
                                  draft_token_num=draft_token_num, candidates=candidates,
                                  device=device)
        # seeded rows: the walk takes each node's seeded coin itself (sglang's seeded coins
        # come from a Triton hash); these only fill the kernel's arguments
        return (torch.rand(candidates.shape, dtype=torch.float32),
                torch.rand(candidates.shape[0], dtype=torch.float32))

    eagle_utils._verify_coins = _verify_coins
    eagle_utils.tree_speculative_sampling_target_only = (
        sampling.tree_speculative_sampling_target_only
    )
    eagle_utils.top_k_renorm_prob = eagle_utils.top_p_renorm_prob = sampling.verify_renorm
    # the target probabilities of only the tree rows the walk reads (sampling.VerifyProbs)
    eagle_utils.sampling_softmax = sampling.lazy_verify_softmax(eagle_utils.sampling_softmax)
    # the verify filters its target rows as plain decoding does (top-k, top-p, min-p jointly);
    # ngram_worker imports eagle_sample from here after this runs
    eagle_utils.eagle_sample = sampling.with_verify_filters(eagle_utils.eagle_sample)
    APPLIED.add("lossless_sampling_verify")


def fast_cpu_sampling(sampler) -> None:
    import torch

    from rhyme_sglang.cpu_backend import sampling, seeded

    if sampling.sampling_impl() == "torch":  # RHYME_CPU_SAMPLING=torch: sglang's own draw
        return
    original = sampler.sampling_from_probs_torch
    original_filtered = sampler.top_k_top_p_min_p_sampling_from_probs_torch

    def sampling_from_probs_torch(probs, sampling_seed=None, positions=None):
        if probs.device.type != "cpu":
            return original(probs, sampling_seed=sampling_seed, positions=positions)
        out = (sampling.sample_rows(probs) if sampling_seed is None
               else seeded.seeded_sample_rows(probs, sampling_seed, positions))
        return out.view(-1).to(torch.int32)

    def top_k_top_p_min_p_sampling_from_probs_torch(
            probs, top_ks, top_ps, min_ps, need_min_p_sampling, sampling_seed, positions, *,
            return_filtered_probs=False, max_top_k=None):
        if probs.device.type != "cpu" or sampling_seed is None or return_filtered_probs:
            # sglang's own draw; on CPU unseeded (its seeded draw is a torch.compile'd kernel)
            seed = sampling_seed if probs.device.type != "cpu" else None
            return original_filtered(probs, top_ks, top_ps, min_ps, need_min_p_sampling, seed,
                                     positions, return_filtered_probs=return_filtered_probs,
                                     max_top_k=max_top_k)
        return sampling.sample_filtered_rows(probs, top_ks, top_ps,
                                             min_ps if need_min_p_sampling else None,
                                             sampling_seed, positions)

    sampler.sampling_from_probs_torch = sampling_from_probs_torch
    sampler.top_k_top_p_min_p_sampling_from_probs_torch = top_k_top_p_min_p_sampling_from_probs_torch
    APPLIED.add("fast_cpu_sampling")


def seeded_cpu_sampling(sampling_batch_info) -> None:
    """Every CPU batch carries its requests' seeds (``sampling_seed``; a random one for a
    request without), so plain draws and verify draws of a position are the same draw."""
    import torch

    from rhyme_sglang.cpu_backend import sampling, seeded

    if sampling.sampling_impl() == "torch":
        return
    cls = sampling_batch_info.SamplingBatchInfo
    original = cls.from_schedule_batch.__func__

    def from_schedule_batch(klass, batch, vocab_size):
        info = original(klass, batch, vocab_size)
        if info.sampling_seed is None and torch.device(batch.device).type == "cpu":
            info.sampling_seed = torch.tensor([seeded.request_seed(req) for req in batch.reqs],
                                              dtype=torch.int64)
        return info

    cls.from_schedule_batch = classmethod(from_schedule_batch)
    APPLIED.add("seeded_cpu_sampling")


def packed_cpu_linear(unquant) -> None:
    from rhyme_sglang.cpu_backend import linear

    method = unquant.UnquantizedLinearMethod
    original = method.apply

    def apply(self, layer, x, bias=None):
        weight = getattr(layer, "weight", None)
        if (weight is None or unquant.use_intel_amx_backend(layer)
                or not linear.applies(x, weight)):
            return original(self, layer, x, bias)
        return linear.linear(layer, x, weight, bias)

    method.apply = apply
    APPLIED.add("packed_cpu_linear")


def packed_cpu_lm_head(logits_processor) -> None:
    from rhyme_sglang.cpu_backend import linear

    processor = logits_processor.LogitsProcessor
    original = processor._compute_lm_head

    def _compute_lm_head(self, hidden_states, lm_head, embedding_bias=None, *, out=None):
        # only the branch sglang takes on CPU for a plain (tied or untied) lm_head:
        # ``torch.matmul(hidden_states, lm_head.weight.T)``
        weight = getattr(lm_head, "weight", None)
        if (weight is None or hasattr(lm_head, "set_lora")
                or logits_processor.should_apply_lm_head_quant_method(
                    lm_head, getattr(lm_head, "quant_method", None))
                or getattr(self, "use_fp32_lm_head", False)
                or getattr(self, "rl_on_policy_target", None) is not None
                or logits_processor.use_intel_amx_backend(lm_head)
                or not linear.applies(hidden_states, weight)):
            return original(self, hidden_states, lm_head, embedding_bias, out=out)
        return linear.linear(lm_head, hidden_states, weight)

    processor._compute_lm_head = _compute_lm_head
    APPLIED.add("packed_cpu_lm_head")


def native_cpu_rmsnorm(layernorm) -> None:
    import torch

    from rhyme_sglang.cpu_backend import small_ops

    norm = layernorm.RMSNorm
    original = norm.forward_native

    def forward_native(self, x, residual=None, post_residual_addition=None, quant_linear=None):
        weight = getattr(self, "weight", None)
        if (post_residual_addition is not None or quant_linear is not None or weight is None
                or self.variance_size_override is not None
                or self.override_orig_dtype not in (None, x.dtype)
                or (x.dtype != torch.float32 and (getattr(self, "fp32_residual", False)
                                                  or getattr(self, "cast_x_before_out_mul", False)))
                or not small_ops.enabled() or not small_ops.rmsnorm_fits(x, weight, residual)):
            return original(self, x, residual, post_residual_addition, quant_linear)
        return small_ops.rmsnorm(x, weight.data, self.variance_epsilon, residual)

    norm.forward_native = forward_native
    APPLIED.add("native_cpu_rmsnorm")


def native_cpu_rotary(rotary_base) -> None:
    from rhyme_sglang.cpu_backend import small_ops

    rope = rotary_base.RotaryEmbedding
    original = rope.forward_native

    def forward_native(self, positions, query, key, offsets=None, fused_set_kv_buffer_arg=None):
        cache = getattr(self, "cos_sin_cache", None)
        if (offsets is not None or fused_set_kv_buffer_arg is not None or cache is None
                or hasattr(self, "sin_cos_cache") or not small_ops.enabled()
                or not small_ops.rotary_fits(positions, query, key, cache, self.head_size,
                                             self.rotary_dim)):
            return original(self, positions, query, key, offsets, fused_set_kv_buffer_arg)
        return small_ops.rotary(positions, query, key, cache, self.head_size, self.rotary_dim,
                                self.is_neox_style)

    rope.forward_native = forward_native
    APPLIED.add("native_cpu_rotary")


def native_cpu_silu_mul(activation) -> None:
    """sglang's ``SiluAndMul`` on fp32 or bf16 CPU rows through :func:`.small_ops.silu_mul`, the kernel
    the lean forward uses too (so ``RHYME_CPU_LEAN=check`` compares the same arithmetic)."""
    from rhyme_sglang.cpu_backend import small_ops

    op = activation.SiluAndMul
    original = op.forward_native

    def forward_native(self, x):
        if not small_ops.enabled() or not small_ops.silu_mul_fits(x):
            return original(self, x)
        return small_ops.silu_mul(x)

    op.forward_native = forward_native
    APPLIED.add("native_cpu_silu_mul")


_UPDATE_METHODS = ("update_weights_from_disk", "update_weights_from_tensor",
                   "load_weights_from_distributed", "end_weight_update",
                   "update_weights_from_ipc")


def repack_after_weight_updates(weight_updater) -> None:
    from rhyme_sglang.cpu_backend import linear

    cls = weight_updater.WeightUpdater
    for name in _UPDATE_METHODS:
        original = getattr(cls, name, None)
        if original is None:
            raise AttributeError(f"sglang's WeightUpdater has no {name}: the repack hook needs it")

        def wrapped(self, *args, __original=original, **kwargs):
            try:
                return __original(self, *args, **kwargs)
            finally:  # even a failed update may have written part of the weights
                linear.weights_changed()

        wrapped.__name__ = name
        setattr(cls, name, wrapped)
    APPLIED.add("repack_after_weight_updates")


def ragged_verify_metadata(amx_backend) -> None:
    import torch

    cls = amx_backend.IntelAMXAttnBackend
    original = cls._build_extend_metadata

    def _build_extend_metadata(self, forward_batch):
        spec = forward_batch.spec_info
        lens = getattr(spec, "rhyme_verify_lens", None)
        if lens is None or not forward_batch.forward_mode.is_target_verify():
            return original(self, forward_batch)
        n, bs = spec.draft_token_num, forward_batch.batch_size
        lens = lens.to(device=forward_batch.seq_lens.device, dtype=torch.int32)
        starts = torch.cumsum(lens, 0, dtype=torch.int32) - lens
        tree = spec.custom_mask.reshape(-1)[: bs * n * n].view(bs, n, n)
        return forward_batch.seq_lens + lens, lens, starts, tree

    _build_extend_metadata.__name__ = "_build_extend_metadata"
    cls._build_extend_metadata = _build_extend_metadata
    APPLIED.add("ragged_verify_metadata")


def direct_attention_calls(cls) -> None:
    """The backend's two attention ops are ours (the stand-in registers them): call the Python
    functions, not the ``torch.ops`` packets, whose boxed dispatch cost ~0.1 ms a layer."""
    from rhyme_sglang.cpu_backend import attention

    original = cls.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.decode_attention_fwd = attention.decode_attention_cpu
        self.extend_attention_fwd = attention.extend_attention_cpu

    __init__.__name__ = "__init__"
    cls.__init__ = __init__
    APPLIED.add("direct_attention_calls")


def intel_amx_backend_patches(amx_backend) -> None:
    ragged_verify_metadata(amx_backend)
    direct_attention_calls(amx_backend.IntelAMXAttnBackend)


def lean_cpu_forward(models_module) -> None:
    from rhyme_sglang.cpu_backend import lean_forward

    lean_forward.patch_model(models_module)
    APPLIED.add("lean_cpu_forward")


_BY_MODULE = {
    "sglang.srt.arg_groups.overrides": keep_intel_amx_attention,
    "sglang.srt.speculative.eagle_utils": lossless_sampling_verify,
    "sglang.srt.layers.sampler": fast_cpu_sampling,
    "sglang.srt.sampling.sampling_batch_info": seeded_cpu_sampling,
    "sglang.srt.layers.quantization.unquant": packed_cpu_linear,
    "sglang.srt.layers.logits_processor": packed_cpu_lm_head,
    "sglang.srt.model_executor.model_runner_components.weight_updater": repack_after_weight_updates,
    "sglang.srt.layers.attention.intel_amx_backend": intel_amx_backend_patches,
    "sglang.srt.layers.layernorm": native_cpu_rmsnorm,
    "sglang.srt.layers.rotary_embedding.base": native_cpu_rotary,
    "sglang.srt.layers.activation": native_cpu_silu_mul,
    "sglang.srt.models.llama": lean_cpu_forward,
    "sglang.srt.models.qwen2": lean_cpu_forward,
}


def apply_to_module(module) -> None:
    patch = _BY_MODULE.get(module.__name__)
    if patch is not None:
        patch(module)
        logger.debug("rhyme cpu backend: applied %s", patch.__name__)


def declare_torchvision_ops() -> None:
    """Declare ``torchvision::nms``/``qnms`` so PyPI's CUDA torchvision imports on CPU torch."""
    import torch

    lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema in (
        "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
        "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    ):
        try:
            lib.define(schema)
        except RuntimeError:  # already declared (a real build loaded first)
            pass
    declare_torchvision_ops.library = lib  # keep the fragment alive
