"""The ragged verify's padded logits: one buffer kept across steps instead of a zero-filled
tensor per step (sglang_ext/step_kinds.py: padded_logits)."""

from types import SimpleNamespace

import torch

from rhyme_sglang.sglang_ext.step_kinds import padded_logits


def test_the_buffer_is_reused_grown_and_remade_for_another_shape():
    worker = SimpleNamespace()
    like = torch.ones(3, 10)
    first = padded_logits(worker, 8, like)
    assert first.shape == (8, 10) and first.dtype == like.dtype and bool((first == 0).all())
    first[2] = 5.0  # a step's real row
    again = padded_logits(worker, 6, like)  # a smaller step: a view of the same memory
    assert again.data_ptr() == first.data_ptr() and again.shape == (6, 10)
    bigger = padded_logits(worker, 12, like)  # grown: zeros again
    assert bigger.shape == (12, 10) and bool((bigger == 0).all())
    assert padded_logits(worker, 4, like).data_ptr() == bigger.data_ptr()
    other = padded_logits(worker, 4, torch.ones(2, 7, dtype=torch.float64))
    assert other.shape == (4, 7) and other.dtype == torch.float64
