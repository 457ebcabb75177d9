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
