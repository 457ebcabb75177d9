"""Our Engine on the tiny model: HF parity, weight updates, flush, pause/continue, and verify
steps bit-identical to plain decoding.

The engines here run every CPU linear and the lm_head through our native few-row kernel
(``RHYME_CPU_LINEAR=native``; the default measures per machine, shape and row count, and picks
it for most of SmolLM2's products on AVX2 machines), so HF parity and the weight updates cover
that path: a stale pack after an update would fail ``test_weight_update_from_tensor_then_disk``.
The oneDNN pack has the same checks at the kernel level (tests/cpu_backend/test_linear.py).
Where the module is not built, the mode falls back to ``F.linear`` and the tests still run.
"""

from __future__ import annotations

import os

import pytest

from tests.helpers import hf_greedy

pytestmark = pytest.mark.sglang

# before the module's engine starts (the Makefile runs each engine module in its own pytest)
os.environ["RHYME_CPU_LINEAR"] = "native"

PROMPTS = [[1, 5, 6, 7, 8], [3, 4, 5], [10, 11, 12, 13, 14, 15, 16, 17] * 3]
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}


def _generate(engine, prompts=PROMPTS, params=GREEDY):
    return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]


def test_greedy_matches_transformers(tiny_engine, tiny_model_path):
    assert _generate(tiny_engine) == hf_greedy(tiny_model_path, PROMPTS, 24)


def test_bad_token_ids_raise_and_engine_survives(tiny_engine):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny_engine.generate(input_ids=[1, 2, 10**6], sampling_params=GREEDY)
    assert len(_generate(tiny_engine, PROMPTS[:1])[0]) == 24


def test_weight_update_from_tensor_then_disk(tiny_engine, tiny_model_path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    original = _generate(tiny_engine)
    gen = torch.Generator().manual_seed(3)
    new_head = model.lm_head.weight.detach() + torch.randn(
        model.lm_head.weight.shape, generator=gen
    )
    with torch.no_grad():
        model.lm_head.weight.copy_(new_head)
    expected = hf_greedy(tiny_model_path, PROMPTS, 24, model=model)
    assert expected != original  # the perturbation really changes greedy output

    tiny_engine.begin_weight_update()
    result = tiny_engine.update_weights_from_tensor([("lm_head.weight", new_head.clone())])
    tiny_engine.end_weight_update()
    assert result[0] if isinstance(result, tuple) else result.success
    assert _generate(tiny_engine) == expected

    ok, message = tiny_engine.update_weights_from_disk(tiny_model_path)[:2]
    assert ok, message
    assert _generate(tiny_engine) == original


def test_flush_cache(tiny_engine):
    _generate(tiny_engine, PROMPTS[:1])
    assert tiny_engine.flush_cache_blocking()


def test_pause_and_continue_in_place(tiny_engine):
    import asyncio

    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    expected = _generate(tiny_engine, PROMPTS[:1], params)[0]

    async def scenario():
        await tiny_engine.async_pause_generation(mode="in_place")
        task = asyncio.ensure_future(
            tiny_engine.async_generate(input_ids=PROMPTS[0], sampling_params=params)
        )
        await asyncio.sleep(2.0)
        paused_done = task.done()
        await tiny_engine.async_continue_generation()
        return paused_done, await asyncio.wait_for(task, timeout=60)

    paused_done, out = tiny_engine.loop.run_until_complete(scenario())
    assert not paused_done, "a request finished while generation was paused"
    assert out["output_ids"] == expected
    with pytest.raises(ValueError, match="pause mode"):
        tiny_engine.pause_generation(mode="sideways")


def test_verify_steps_are_bit_identical_to_plain_decode(tiny, tiny_engine):
    """With the native linears and the native paged attention, a token's logits do not depend
    on the other rows of the step, so a verify tree's rows give the very bits that plain
    decode gives (not only the same greedy tokens)."""
    from rhyme_sglang.cpu_backend import linear

    if linear.native_pack(__import__("torch").zeros(16, 16)) is None:
        pytest.skip("the native GEMM module is not built")

    # prompts under NATIVE_MAX_EXTEND tokens, so that every row of both engines (prefill too)
    # runs through the native kernels: a longer prompt is prefilled through SDPA, and two
    # engines that reuse their prefix caches at different lengths then hold K/V of different
    # bits (measured: a 16- or 24-token prompt gave one token 3 ulp apart of 24)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2][:12]]

    def run(engine):
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
        return ([o["output_ids"] for o in outs],
                [[t[0] for t in o["meta_info"]["output_token_logprobs"]] for o in outs],
                sum(o["meta_info"].get("spec_num_correct_drafts", 0) for o in outs))

    tokens, logprobs, _ = run(tiny_engine)
    rhyme = tiny("tiny-rhyme")
    run(rhyme)  # its history now holds these answers
    spec_tokens, spec_logprobs, accepted = run(rhyme)
    assert accepted > 0, "the second pass accepted no drafts, so it ran no verify step"
    assert spec_tokens == tokens
    assert spec_logprobs == logprobs  # exact float equality, every token


def test_lean_forward_is_bit_identical_to_sglangs(tiny, tiny_engine, monkeypatch):
    """``RHYME_CPU_LEAN=check``: every decode and verify forward runs sglang's layer stack and
    the lean one (``cpu_backend/lean_forward.py``), and the scheduler fails on any bit of
    difference in their hidden states. Plain decode, then verify steps of every width (the
    cycling RHYME engine); the tokens are the default engine's. (A mismatch stops the
    scheduler, and sglang then kills its launcher: the run fails.)"""
    tokens = _generate(tiny_engine)
    monkeypatch.setenv("RHYME_CPU_LEAN", "check")  # read by the engine's scheduler
    checked = tiny("tiny-rhyme-cycle", random_seed=7)  # its own key: a fresh engine
    for _ in range(3):  # later rounds draft from the earlier rounds' history
        assert _generate(checked) == tokens
