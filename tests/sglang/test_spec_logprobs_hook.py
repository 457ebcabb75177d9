"""``plugin.spec_logprobs_hook`` hands sglang's ``compute_spec_logprobs`` only the accept slots
some request uses (the lossless logprob tests in tests/sglang check the values end to end)."""

from __future__ import annotations

import torch

from rhyme_sglang.sglang_ext.plugin import spec_logprobs_hook


def _seen(accept_index):
    got = {}

    def original(batch, logits_output, predict, *, accept_index=None, chain_stride=None):
        got.update(accept_index=accept_index, chain_stride=chain_stride)

    spec_logprobs_hook(original, "batch", "out", "predict", accept_index=accept_index)
    return got["accept_index"]


def test_unused_columns_are_dropped_and_used_ones_kept():
    plain = torch.full((3, 17), -1, dtype=torch.int32)
    plain[:, 0] = torch.arange(3)
    assert _seen(plain).tolist() == [[0], [1], [2]]
    verify = torch.tensor([[0, 2, -1, -1], [4, -1, -1, -1]], dtype=torch.int32)
    assert torch.equal(_seen(verify), verify[:, :2])
    full = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    assert torch.equal(_seen(full), full)


def test_chain_layout_passes_through():
    got = {}

    def original(batch, logits_output, predict, *, accept_index=None, chain_stride=None):
        got.update(accept_index=accept_index, chain_stride=chain_stride)

    spec_logprobs_hook(original, "b", "o", "p", chain_stride=4)
    assert got == {"accept_index": None, "chain_stride": 4}
