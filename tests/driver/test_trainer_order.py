"""The trainer's GRPO step does not depend on the order of its samples (it sorts each
minibatch by length into micro-batches to pad less)."""

import random

import pytest

torch = pytest.importorskip("torch")


def _samples(vocab: int, seed: int):
    rng = random.Random(seed)
    out = []
    for group in range(3):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 9))]
        for _ in range(4):
            resp = [rng.randrange(3, vocab) for _ in range(rng.choice([2, 5, 17, 31]))]
            out.append({"prompt_ids": prompt, "response_ids": resp,
                        "logprobs": [-rng.uniform(0.5, 3.0) for _ in resp],
                        "advantage": rng.uniform(-1, 1)})
    return out


def test_grpo_step_is_invariant_to_sample_order():
    from rhyme_sglang.models import resolve_model_path
    from rl_driver.config import TrainConfig
    from rl_driver.trainer import Trainer

    path = resolve_model_path("tiny")
    cfg = TrainConfig(lr=1e-3, micro_batch_size=3, num_minibatches=2, autocast_bf16=False,
                      num_threads=1)
    a, b = Trainer(path, cfg, seed=0), Trainer(path, cfg, seed=0)
    samples = _samples(a.model.config.vocab_size, seed=1)
    # the same minibatches (samples[i::2]) with each minibatch's samples in another order
    shuffled = list(samples)
    for i in range(2):
        part = shuffled[i::2]
        random.Random(2 + i).shuffle(part)
        shuffled[i::2] = part
    sa, sb = a.train_step(samples), b.train_step(shuffled)
    assert sa["loss"] == pytest.approx(sb["loss"], rel=1e-4, abs=1e-6)
    for (name, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.allclose(pa, pb, atol=1e-5), name


def test_shared_prompt_forward_matches_a_forward_per_sample():
    """One prompt forward per group, its KV shared by the group's responses, gives the same
    logprobs, gradients and GRPO step statistics as prompt + response per sample (ragged
    prompts and responses, groups split across micro-batches, a KL reference model)."""
    from rhyme_sglang.models import resolve_model_path
    from rl_driver.config import TrainConfig
    from rl_driver.grpo import grpo_loss
    from rl_driver.trainer import Trainer, pack_rows

    path = resolve_model_path("tiny")
    common = dict(lr=1e-3, micro_batch_size=5, num_minibatches=1, autocast_bf16=False,
                  num_threads=1, kl_coef=0.05)
    full = Trainer(path, TrainConfig(share_prompt_forward=False, **common), seed=0)
    shared = Trainer(path, TrainConfig(share_prompt_forward=True, **common), seed=0)
    samples = _samples(full.model.config.vocab_size, seed=3)
    old, mask, adv = full._targets(samples)
    a = full._full_logprobs(full.model, samples)
    b = shared._shared_logprobs(shared.model, samples)
    prompts = {tuple(s["prompt_ids"]): k for k, s in enumerate(samples)}
    lengths = [len(s["response_ids"]) for s in samples]
    rows = pack_rows([prompts[tuple(s["prompt_ids"])] for s in samples], lengths, max(lengths))
    assert len(rows) < len(samples)  # responses were packed side by side
    assert torch.allclose(a * mask, b * mask, atol=1e-5)
    grpo_loss(a, old, adv, mask, full.loss_config)[0].backward()
    grpo_loss(b, old, adv, mask, shared.loss_config)[0].backward()
    for (name, pa), (_, pb) in zip(full.model.named_parameters(), shared.model.named_parameters()):
        scale = float(pa.grad.abs().max())
        assert scale > 0, name  # every weight takes part
        assert torch.allclose(pa.grad, pb.grad, atol=1e-5 * scale), name
        pa.grad = pb.grad = None
    assert len(shared._micro_batches(samples)) == 3  # 12 samples by 5, groups kept together
    sa, sb = full.train_step(samples), shared.train_step(samples)
    for key in ("loss", "kl", "ratio_mean", "grad_norm", "logprob_abs_diff"):
        assert sa[key] == pytest.approx(sb[key], rel=1e-4, abs=1e-7), key


def test_pack_rows_places_every_response_once_with_its_own_prompt():
    from rl_driver.trainer import pack_rows

    rng = random.Random(5)
    prompt_of = [rng.randrange(3) for _ in range(40)]
    lengths = [rng.randint(1, 30) for _ in range(40)]
    rows = pack_rows(prompt_of, lengths, 30)
    placed = sorted(i for _, members in rows for i, _ in members)
    assert placed == list(range(40))
    for prompt, members in rows:
        assert all(prompt_of[i] == prompt for i, _ in members)
        spans = sorted((col, col + lengths[i]) for i, col in members)
        assert spans[0][0] >= 0 and spans[-1][1] <= 30
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no overlap
    assert len(rows) < 40
    assert len(pack_rows([0, 0, 1], [3, 3, 3], 3)) == 3  # full rows stay one per response
    with pytest.raises(ValueError, match="response lengths"):
        pack_rows([0], [0], 4)
    with pytest.raises(ValueError, match="response lengths"):
        pack_rows([0], [5], 4)


@pytest.mark.parametrize("old_logprobs", ["rollout", "recompute"])
def test_zero_advantage_samples_are_skipped_with_the_same_update(old_logprobs):
    """With no KL term a sample of advantage 0 has a zero loss and gradient: leaving it out of
    the forward (it still counts in the token-mean) gives the same update, also when a whole
    minibatch is skipped and AdamW steps on its momentum alone."""
    from rhyme_sglang.models import resolve_model_path
    from rl_driver.config import TrainConfig
    from rl_driver.trainer import Trainer

    path = resolve_model_path("tiny")
    common = dict(lr=1e-3, micro_batch_size=3, num_minibatches=2, autocast_bf16=False,
                  num_threads=1, old_logprobs=old_logprobs)
    full = Trainer(path, TrainConfig(skip_zero_advantage=False, **common), seed=0)
    lean = Trainer(path, TrainConfig(skip_zero_advantage=True, **common), seed=0)
    samples = _samples(full.model.config.vocab_size, seed=4)
    for s in samples[:4] + samples[8:]:  # groups 0 and 2 had equal rewards
        s["advantage"] = 0.0
    zero = [dict(s, advantage=0.0) for s in samples]
    for step, batch in enumerate((samples, zero, samples)):
        sa, sb = full.train_step(batch), lean.train_step(batch)
        skipped = sum(s["advantage"] == 0.0 for s in batch)
        assert (sa["skipped_samples"], sb["skipped_samples"]) == (0, skipped)
        assert sb["train_tokens"] == sa["train_tokens"] == sa["forward_tokens"]
        assert sb["forward_tokens"] == sum(len(s["response_ids"]) for s in batch
                                           if s["advantage"] != 0.0)
        assert sa["loss"] == pytest.approx(sb["loss"], rel=1e-4, abs=1e-6)
        # AdamW divides by the gradient's own scale, so where a gradient is as small as the
        # rounding of a differently shaped forward, the two updates may differ by up to ~lr:
        # on an AVX-512 Xeon (stop 44) 1-3 of 404,864 weights moved 2-2.5e-5 apart. Every
        # weight within a tenth of lr, all but 1e-4 of them within 1e-5.
        far = total = 0
        for (name, pa), (_, pb) in zip(full.model.named_parameters(),
                                       lean.model.named_parameters()):
            diff = (pa - pb).abs()
            assert diff.max().item() < 1e-4, (step, name, diff.max().item())
            far, total = far + int((diff > 1e-5).sum()), total + diff.numel()
        assert far <= 1e-4 * total, (step, far, total)
    # the momentum moved the weights on the all-zero step too, in both
    assert sa["optimizer_steps"] == 2


def test_skip_zero_advantage_keeps_the_kl_term():
    from rhyme_sglang.models import resolve_model_path
    from rl_driver.config import TrainConfig
    from rl_driver.trainer import Trainer

    cfg = TrainConfig(lr=1e-3, micro_batch_size=4, kl_coef=0.1, autocast_bf16=False,
                      num_threads=1)
    trainer = Trainer(resolve_model_path("tiny"), cfg, seed=0)
    samples = [dict(s, advantage=0.0) for s in _samples(trainer.model.config.vocab_size, 6)]
    stats = trainer.train_step(samples)
    assert stats["skipped_samples"] == 0 and stats["forward_tokens"] == stats["train_tokens"]
    with pytest.raises(ValueError, match="skip_zero_advantage"):
        TrainConfig(skip_zero_advantage="yes")


def test_micro_batches_keep_to_the_token_budget():
    from types import SimpleNamespace

    from rl_driver.config import TrainConfig
    from rl_driver.trainer import Trainer

    rng = random.Random(7)
    samples = [{"prompt_ids": [1, 2, k % 3], "response_ids": [5] * rng.randrange(1, 900)}
               for k in range(30)]
    for share in (True, False):
        for size, budget in ((8, 2048), (8, 0), (3, 100)):
            fake = SimpleNamespace(config=TrainConfig(micro_batch_size=size, micro_batch_tokens=budget,
                                                      share_prompt_forward=share))
            batches = Trainer._micro_batches(fake, samples)
            assert sorted(id(s) for b in batches for s in b) == sorted(id(s) for s in samples)
            for b in batches:
                assert len(b) <= size
                longest = max(len(s["response_ids"]) for s in b)
                assert len(b) == 1 or not budget or longest * len(b) <= budget
            if not budget:
                assert len(batches) == -(-len(samples) // size)
