"""The GRPO math (the project's only implementation): advantages, clipped ratio loss, KL.

Pure torch, no Ray or sglang, so it is unit-tested on its own. Shapes: ``[B, T]`` per-token
tensors with a 0/1 ``mask`` marking response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import torch


def group_advantages(rewards: Sequence[float], group_size: int, eps: float = 1e-6,
                     scale: bool = True) -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean, divided by the group's std.

    ``rewards`` is flat, ``group_size`` consecutive entries per prompt. A group whose rewards
    are all equal gets advantage 0 (it carries no learning signal).
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size!r}")
    r = torch.as_tensor(list(rewards), dtype=torch.float64)
    if r.numel() % group_size:
        raise ValueError(f"{r.numel()} rewards do not split into groups of {group_size}")
    if not torch.isfinite(r).all():
        raise ValueError("rewards must be finite")
    g = r.view(-1, group_size)
    centred = g - g.mean(dim=1, keepdim=True)
    if scale and group_size > 1:
        centred = centred / (g.std(dim=1, unbiased=True, keepdim=True) + eps)
    # exactly 0 where the group's rewards are equal (the mean's rounding would leave ~1e-11)
    equal = (g == g[:, :1]).all(dim=1, keepdim=True)
    centred = torch.where(equal, torch.zeros_like(centred), centred)
    return centred.reshape(-1).to(torch.float32)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) per position: ``logits`` [B, T, V], ``targets`` [B, T] -> [B, T]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token unbiased, non-negative KL(pi || ref) estimate: exp(d) - d - 1, d = ref - logp."""
    d = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
    return torch.exp(d) - d - 1.0


@dataclass(frozen=True)
class LossConfig:
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    kl_coef: float = 0.0

    def __post_init__(self):
        if not 0 <= self.clip_eps_low < 1:
            raise ValueError(f"clip_eps_low must be in [0, 1), got {self.clip_eps_low!r}")
        if self.clip_eps_high < 0:
            raise ValueError(f"clip_eps_high must be >= 0, got {self.clip_eps_high!r}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef!r}")


def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, config: LossConfig = LossConfig(),
              ref_logprobs: Optional[torch.Tensor] = None,
              num_tokens: Optional[float] = None) -> tuple[torch.Tensor, Dict[str, float]]:
    """Clipped-ratio policy loss (plus optional KL) summed over masked tokens / ``num_tokens``.

    ``old_logprobs`` are the rollout engine's logprobs of the sampled tokens (the behaviour
    policy); ``advantages`` is [B] (one per sequence, broadcast over tokens). ``num_tokens``
    normalises the sum, so micro-batches of one batch can share the whole batch's token count
    (token-mean over the batch); it defaults to ``mask.sum()``.
    """
    if not (logprobs.shape == old_logprobs.shape == mask.shape):
        raise ValueError(f"shape mismatch: logprobs {tuple(logprobs.shape)}, old_logprobs "
                         f"{tuple(old_logprobs.shape)}, mask {tuple(mask.shape)}")
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must be [B]={tuple(logprobs.shape[:1])}, got "
                         f"{tuple(advantages.shape)}")
    mask = mask.to(logprobs.dtype)
    denom = float(num_tokens) if num_tokens is not None else float(mask.sum().clamp(min=1.0))
    adv = advantages.to(logprobs.dtype).unsqueeze(-1)
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    kl_value = torch.zeros((), dtype=logprobs.dtype)
    if ref_logprobs is not None and config.kl_coef > 0:
        kl = kl_k3(logprobs, ref_logprobs)
        per_token = per_token + config.kl_coef * kl
        kl_value = (kl * mask).sum() / denom
    loss = (per_token * mask).sum() / denom
    with torch.no_grad():
        clip_frac = ((clipped < unclipped).to(mask.dtype) * mask).sum() / denom
        stats = {
            "clip_frac": float(clip_frac),
            "ratio_mean": float((ratio * mask).sum() / denom),
            "kl": float(kl_value),
        }
    return loss, stats
