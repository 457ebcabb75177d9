"""The few sglang patches the CPU backend needs, each named, applied per module.

Applied by :mod:`.bootstrap` right after the target module executes, only while the
``sgl_kernel`` stand-in is active (never next to a real CUDA ``sgl_kernel``):

* ``keep_intel_amx_attention`` (``sglang.srt.arg_groups.overrides``): sglang rewrites
  ``--attention-backend intel_amx`` to ``torch_native`` when its AMX GEMM op is missing;
  torch_native cannot run speculative TARGET_VERIFY batches, and our stand-in implements
  the intel_amx attention ops, so we declare the platform AMX-capable for that choice.
* ``lossless_sampling_verify`` (``sglang.srt.speculative.eagle_utils``): on CPU sglang
  commits the target argmax even for sampled requests (no CPU sampling-verify kernel);
  we route sampled requests through our lossless tree verification and prob renorms.
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
    from rhyme_sglang.cpu_backend import sampling

    def _verify_uses_greedy(*, is_all_greedy, is_cpu, is_hip, is_xpu, use_rejection_sampling):
        return is_all_greedy or is_xpu or (is_hip and not use_rejection_sampling)

    eagle_utils._verify_uses_greedy = _verify_uses_greedy
    eagle_utils.tree_speculative_sampling_target_only = (
        sampling.tree_speculative_sampling_target_only
    )
    eagle_utils.top_k_renorm_prob = sampling.top_k_renorm_prob
    eagle_utils.top_p_renorm_prob = sampling.top_p_renorm_prob
    APPLIED.add("lossless_sampling_verify")


_BY_MODULE = {
    "sglang.srt.arg_groups.overrides": keep_intel_amx_attention,
    "sglang.srt.speculative.eagle_utils": lossless_sampling_verify,
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
