"""GRPO math: group advantages, the clipped ratio, KL, and micro-batch token normalisation."""

from __future__ import annotations

import math

import pytest
import torch

from rl_driver.grpo import LossConfig, grpo_loss, group_advantages, kl_k3, token_logprobs


def test_group_advantages_normalise_within_groups():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0, 5.0, 5.0, 5.0, 5.0], group_size=4)
    first = adv[:4]
    assert torch.allclose(first.mean(), torch.tensor(0.0), atol=1e-6)
    assert torch.allclose(first.std(), torch.tensor(1.0), atol=1e-4)
    assert first[0] > 0 > first[1]
    assert torch.equal(adv[4:], torch.zeros(4))  # equal rewards: no signal


def test_equal_rewards_give_exactly_zero_advantages():
    # the mean of six 0.1s is not 0.1 in floating point; the advantage is still exactly 0,
    # which is what lets the trainer skip the group (train.skip_zero_advantage)
    rewards = torch.tensor([0.1] * 6, dtype=torch.float64)
    assert bool((rewards - rewards.mean() != 0).any())
    adv = group_advantages([0.1] * 6 + [1.1, 0.1] * 3, group_size=6)
    assert torch.equal(adv[:6], torch.zeros(6))
    assert bool((adv[6:] != 0).all())
    assert torch.equal(group_advantages([0.1] * 4, 4, scale=False), torch.zeros(4))


def test_group_advantages_reject_bad_input():
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages([1.0, 2.0], group_size=3)
    with pytest.raises(ValueError, match="finite"):
        group_advantages([1.0, math.nan], group_size=2)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages([1.0], group_size=0)


def test_on_policy_loss_is_policy_gradient():
    """With logprobs == old logprobs the ratio is 1: loss = -mean(A), gradient = -A/N per token."""
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    adv = torch.tensor([2.0])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, stats = grpo_loss(logp, logp.detach(), adv, mask)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-2.0)
    assert torch.allclose(logp.grad, torch.tensor([[-1.0, -1.0, 0.0]]))
    assert stats["clip_frac"] == 0.0 and stats["ratio_mean"] == pytest.approx(1.0)


def test_clipping_stops_gradient_outside_the_trust_region():
    old = torch.zeros(1, 2)
    # ratio e^0.5 = 1.65 > 1.28 with positive advantage: clipped, no gradient
    logp = torch.tensor([[0.5, 0.0]], requires_grad=True)
    loss, stats = grpo_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 2),
                            LossConfig(clip_eps_low=0.2, clip_eps_high=0.28))
    loss.backward()
    assert logp.grad[0, 0] == 0.0 and logp.grad[0, 1] != 0.0
    assert stats["clip_frac"] == pytest.approx(0.5)
    assert float(loss) == pytest.approx(-(1.28 + 1.0) / 2)
    # negative advantage with a ratio below 1 - eps: clipped too
    logp2 = torch.tensor([[-0.5]], requires_grad=True)
    loss2, _ = grpo_loss(logp2, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1))
    loss2.backward()
    assert logp2.grad.item() == 0.0 and float(loss2) == pytest.approx(0.8)


def test_kl_k3_properties_and_penalty():
    x = torch.tensor([-1.0, -2.0, -0.1])
    assert torch.allclose(kl_k3(x, x), torch.zeros(3))
    assert (kl_k3(x, x + 0.3) > 0).all() and (kl_k3(x, x - 0.3) > 0).all()
    logp = torch.tensor([[-1.0, -1.0]])
    ref = torch.tensor([[-1.5, -0.5]])
    plain, _ = grpo_loss(logp, logp, torch.tensor([0.0]), torch.ones(1, 2))
    with_kl, stats = grpo_loss(logp, logp, torch.tensor([0.0]), torch.ones(1, 2),
                               LossConfig(kl_coef=0.5), ref_logprobs=ref)
    expected_kl = float(kl_k3(logp, ref).mean())
    assert stats["kl"] == pytest.approx(expected_kl)
    assert float(with_kl) - float(plain) == pytest.approx(0.5 * expected_kl)


def test_micro_batches_sum_to_the_full_batch_loss():
    torch.manual_seed(0)
    logp = torch.randn(4, 5)
    old = logp + 0.1 * torch.randn(4, 5)
    adv = torch.randn(4)
    mask = (torch.rand(4, 5) > 0.3).float()
    full, _ = grpo_loss(logp, old, adv, mask)
    n = float(mask.sum())
    parts = [grpo_loss(logp[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], num_tokens=n)[0]
             for i in (0, 2)]
    assert float(sum(parts)) == pytest.approx(float(full), rel=1e-6)


def test_shapes_and_config_are_checked():
    with pytest.raises(ValueError, match="shape mismatch"):
        grpo_loss(torch.zeros(1, 2), torch.zeros(1, 3), torch.zeros(1), torch.ones(1, 2))
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(3), torch.ones(2, 2))
    with pytest.raises(ValueError, match="clip_eps_low"):
        LossConfig(clip_eps_low=1.5)


def test_token_logprobs_gathers_the_target():
    logits = torch.tensor([[[0.0, 0.0], [2.0, 0.0]]])
    out = token_logprobs(logits, torch.tensor([[1, 0]]))
    assert torch.allclose(out, torch.log_softmax(logits, -1)[0, [0, 1], [1, 0]].unsqueeze(0))
