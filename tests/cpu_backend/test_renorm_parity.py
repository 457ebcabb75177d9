"""The partial-sort top-p renorm against the full-sort reference it replaced."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rhyme_sglang.cpu_backend.sampling import top_p_renorm_prob
from tests.cpu_backend.reference_sampling import top_p_renorm_ref

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True)


def _probs(draw):
    rows = draw(st.integers(1, 6))
    vocab = draw(st.sampled_from([5, 50, 700]))  # 700: past the first top-p head of 128
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    sharpness = draw(st.sampled_from([0.3, 1.0, 4.0]))
    return torch.softmax(torch.randn(rows, vocab, generator=gen) * sharpness, dim=-1)


@SETTINGS
@given(st.data())
def test_top_p_matches_full_sort_reference(data):
    probs = _probs(data.draw)
    rows = probs.shape[0]
    ps = data.draw(st.lists(st.floats(0.01, 0.999), min_size=rows, max_size=rows))
    got = top_p_renorm_prob(probs, torch.tensor(ps))
    want = top_p_renorm_ref(probs, ps)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want)


def test_top_p_of_one_keeps_every_token_and_a_scalar_applies_to_all_rows():
    probs = torch.softmax(torch.randn(3, 400, generator=torch.Generator().manual_seed(1)), -1)
    mixed = top_p_renorm_prob(probs, torch.tensor([1.0, 0.5, 1.0]))
    torch.testing.assert_close(mixed[[0, 2]], probs[[0, 2]] / probs[[0, 2]].sum(-1, keepdim=True))
    assert (mixed[1] == 0).any()
    torch.testing.assert_close(top_p_renorm_prob(probs, 0.5), top_p_renorm_ref(probs, [0.5] * 3))
