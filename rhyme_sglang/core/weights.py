"""Response weights: group-relative reward factor times epoch recency, as exact integers."""

from __future__ import annotations

import math
from typing import Dict, Optional

WEIGHT_SCALE = 256          # fixed-point unit of one neutral, newest-epoch response
MAX_RECENCY_FACTOR = 2 ** 20  # rebase the epoch origin before recency factors grow past this


def check_reward(reward: Optional[float]) -> Optional[float]:
    """Validate a reward (None = unknown); NaN, inf and non-numbers raise ValueError."""
    if reward is None:
        return None
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        raise ValueError(f"reward must be a number or None, got {reward!r}")
    if not math.isfinite(reward):
        raise ValueError(f"reward must be finite, got {reward!r}")
    return float(reward)


def group_advantages(rewards: Dict[int, Optional[float]]) -> Dict[int, float]:
    """GRPO-style advantages (r - mean) / std over the known rewards of one group; 0 when unknown
    or when the group has no spread."""
    known = [r for r in rewards.values() if r is not None]
    if len(known) < 2:
        return {k: 0.0 for k in rewards}
    mean = sum(known) / len(known)
    std = math.sqrt(sum((r - mean) ** 2 for r in known) / len(known))
    if std < 1e-9:
        return {k: 0.0 for k in rewards}
    return {k: (0.0 if r is None else (r - mean) / std) for k, r in rewards.items()}


def reward_factor(advantage: float, reward_weight: float, clip: float) -> float:
    """exp(reward_weight * clip(advantage)): > 0 always, so low-reward branches stay possible."""
    return math.exp(reward_weight * max(-clip, min(clip, advantage)))


def response_weight(factor: float, epoch: int, epoch_origin: int, decay: float) -> int:
    """Integer weight of a response of `epoch`, relative to `epoch_origin` (the oldest epoch the
    store keeps weights relative to). Newer epochs get decay**-(epoch - origin); since drafting only
    uses weight ratios, this equals decaying older epochs by decay**age. Always >= 1."""
    age_up = max(0, epoch - epoch_origin)
    return max(1, int(round(WEIGHT_SCALE * factor * decay ** (-age_up))))


def needs_rebase(epoch: int, epoch_origin: int, decay: float) -> bool:
    return decay < 1.0 and decay ** (-(epoch - epoch_origin)) > MAX_RECENCY_FACTOR
