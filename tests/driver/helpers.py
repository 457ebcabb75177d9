"""Driver test helpers: a trainer whose weight changes are observable from a test."""

from __future__ import annotations

from typing import List

import torch

from rl_driver.trainer import Trainer


class ProbeTrainer(Trainer):
    """``Trainer`` with the two calls the weight-sync tests make: a reference greedy decode and
    a seeded perturbation of every weight (run it as a Ray actor like ``Trainer``)."""

    def greedy(self, prompts: List[List[int]], max_new_tokens: int) -> List[List[int]]:
        """Transformers greedy decoding without EOS stop (the reference for sync checks)."""
        self.model.eval()
        out = []
        try:
            with torch.no_grad():
                for p in prompts:
                    ids = torch.tensor([p])
                    for _ in range(max_new_tokens):
                        logits = self.model(input_ids=ids).logits[0, -1]
                        ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
                    out.append(ids[0, len(p):].tolist())
        finally:
            self.model.train()
        return out

    def perturb(self, scale: float, seed: int = 0) -> None:
        """Add Gaussian noise to every weight (makes a sync observable)."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * scale)
        self.version += 1
