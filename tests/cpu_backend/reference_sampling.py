"""The full-sort top-p renorm that the CPU backend's partial-sort one replaced (test reference)."""

from __future__ import annotations

import torch


def top_p_renorm_ref(probs: torch.Tensor, ps: list) -> torch.Tensor:
    """Drop a token when the mass strictly before it in descending order exceeds ``p``."""
    p = torch.tensor(ps, dtype=probs.dtype).view(-1, 1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    exclusive = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(exclusive > p, 0.0)
    out = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return out / out.sum(-1, keepdim=True)
