"""RHYME inside SGLang on the tiny model: lossless greedy + logprobs, history lifecycle,
rewards, snapshots across a restart, and longest-predicted-first admission."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

pytestmark = pytest.mark.sglang

PROMPTS = [[1, 5, 6, 7, 8], [3, 4, 5], [10, 11, 12, 13, 14, 15, 16, 17] * 3]
GREEDY = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
SAMPLE_PROMPT = [20, 21, 22, 23, 24]
DOZEN = [[7 + 3 * i, 100 + i, 200 + 5 * i, 50 + i] for i in range(12)]  # distinct prompts
# plain decoding as RHYME schedules it (synchronous), with custom logit processors allowed
SYNC_PLAIN = {"disable_overlap_schedule": True, "enable_custom_logit_processor": True}


@pytest.fixture(scope="module")
def baseline(tiny):
    """Non-speculative references, computed before any RHYME engine starts."""
    engine = tiny("tiny")
    greedy = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
    return {
        "dozen": [o["output_ids"] for o in engine.generate(input_ids=DOZEN, sampling_params=GREEDY)],
        "greedy": [o["output_ids"] for o in greedy],
        "greedy_logprobs": [[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in greedy],
        "engine": engine,
    }


@pytest.fixture(scope="module")
def sampled_sequences(tiny, baseline):
    """RHYME-sampled sequences with their reported logprobs (history built first)."""
    engine = tiny("tiny-rhyme")
    params = {"temperature": 1.0, "max_new_tokens": 24, "ignore_eos": True}
    for _ in range(3):  # history for the prompt, so later samples are drafted
        engine.generate(input_ids=[SAMPLE_PROMPT] * 8, sampling_params=params)
    out = engine.generate(input_ids=[SAMPLE_PROMPT] * 8, sampling_params=params, return_logprob=True)
    return [(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]],
             o["meta_info"].get("spec_num_correct_drafts", 0)) for o in out]


def test_greedy_identical_across_epochs(tiny, baseline):
    engine = tiny("tiny-rhyme")
    accepted = []
    for epoch in range(3):
        out = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
        assert [o["output_ids"] for o in out] == baseline["greedy"], f"epoch {epoch}"
        for o, ref in zip(out, baseline["greedy_logprobs"]):
            got = [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
            assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(got, ref))
        accepted.append(sum(o["meta_info"]["spec_num_correct_drafts"] for o in out))
        engine.rhyme_advance_epoch()
    assert accepted[2] > accepted[0], accepted  # history makes later epochs draft better
    stats = engine.rhyme_stats()
    assert stats["epoch"] >= 3 and stats["num_responses"] >= 9
    assert stats["per_epoch"]["1"]["tau"] > 3.0
    assert set(stats["decode_steps"]) == {"verify_w7"}  # adaptive off: always the widest verify


def _assert_greedy_matches(out, baseline):
    assert [o["output_ids"] for o in out] == baseline["greedy"]
    for o, ref in zip(out, baseline["greedy_logprobs"]):
        got = [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(got, ref))


def _greedy_epochs(engine, baseline, epochs: int) -> None:
    """``epochs`` greedy rounds, each equal to non-speculative decoding, the epoch advancing."""
    for _ in range(epochs):
        _assert_greedy_matches(
            engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True),
            baseline)
        engine.rhyme_advance_epoch()


def test_adaptive_mixes_plain_and_verify_steps_losslessly(tiny, baseline, tiny_model_path):
    engine = tiny("tiny-rhyme-adaptive")
    _greedy_epochs(engine, baseline, 3)
    # sampled tokens: reported logprobs equal the model's (plain steps included)
    for filters in ({}, {"top_k": 20, "top_p": 0.5, "min_p": 0.08}):  # verify filters rows too
        sampled = engine.generate(input_ids=PROMPTS[:2] * 4, return_logprob=True,
                                  sampling_params={"temperature": 1.0, "max_new_tokens": 24,
                                                   **filters})
        _assert_logprobs_match_model(tiny_model_path, PROMPTS[:2] * 4, sampled)
    stats = engine.rhyme_stats()
    # the cost model measured plain and verify steps (it explores promising cells once)
    steps = stats["decode_steps"]
    assert steps["plain"] > 0 and sum(v for k, v in steps.items() if k.startswith("verify")) > 0
    assert stats["cost_model"]["seconds_per_request_step"]


def test_speculation_comes_back_on_a_perfect_history_after_a_round_of_misses(tiny, baseline):
    """Issue 47's lock-out: a round whose drafts all miss (history of sampled answers, drafted
    against greedy decoding), then a round whose history is perfect (greedy repeats the round
    before token for token). Requests go one at a time, as a user's would. The perfect round
    must take most of its tokens from drafts: at least half of the tokens after each request's
    first (a perfect history and widths up to 7 allow 7 in 8; the probes and the calibration
    that has to climb back from the misses cost some), where the locked-out engine took ~2%.
    Every round's tokens are plain decoding's."""
    engine = tiny("tiny-rhyme-adaptive", rhyme_memory_mb=192)  # a fresh engine
    sampled = {"temperature": 1.0, "max_new_tokens": 48, "ignore_eos": True}
    for prompt in DOZEN:  # history that misses: sampled answers
        engine.generate(input_ids=[prompt] * 2, sampling_params=sampled)
    engine.rhyme_advance_epoch()
    drafted = []
    for _ in range(2):  # drafts that miss, then a perfect history
        outs = [engine.generate(input_ids=p, sampling_params=GREEDY) for p in DOZEN]
        assert [o["output_ids"] for o in outs] == baseline["dozen"]
        drafted.append(sum(o["meta_info"]["spec_num_correct_drafts"] for o in outs)
                       / sum(len(o["output_ids"]) - 1 for o in outs))
        engine.rhyme_advance_epoch()
    assert drafted[1] >= 0.5, drafted
    stats = engine.rhyme_stats()
    assert stats["speculation_health"]["status"] == "ok", stats["speculation_health"]
    assert stats["speculation_health"]["verified_promising_steps"] > 0


def test_cost_model_starts_from_the_last_engines_step_costs(tiny, engines, baseline,
                                                           monkeypatch, tmp_path):
    """An engine's measured step costs are saved when it shuts down; the next engine of the
    same model, dtype and threads starts with them (tests/conftest.py gives this process its
    own file) and stays lossless. That engine also writes the decision log."""
    engine = tiny("tiny-rhyme-adaptive")
    _greedy_epochs(engine, baseline, 2)
    measured = engine.rhyme_stats()["cost_model"]["seconds_per_request_step"]
    assert measured
    engines.close("tiny-rhyme-adaptive")  # shutdown flushes the table
    log = tmp_path / "decisions.jsonl"
    monkeypatch.setenv("RHYME_DECISION_LOG", str(log))
    warm = tiny("tiny-rhyme-adaptive", rhyme_memory_mb=256)  # another engine, same cost key
    stats = warm.rhyme_stats()
    assert stats["cost_model"]["seeded_cells"] == sum(len(cells) for cells in measured.values())
    flat = lambda table: {(b, w): s for b, cells in table.items() for w, s in cells.items()}  # noqa: E731
    assert flat(stats["cost_model"]["seconds_per_request_step"]) == pytest.approx(flat(measured))
    _assert_greedy_matches(
        warm.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True), baseline)
    import json

    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(lines) >= GREEDY["max_new_tokens"] // 8  # one per decode step
    reasons = {"best", "explore", "reexplore", "close_call", "baseline", "probe", "rest"}
    for line in lines:
        assert line["reason"] in reasons and line["bs"] >= 1 and line["seconds"] > 0
        assert line["keys"] >= line["bs"]  # every request's context
        if line["width"]:
            assert 0 <= line["accepted"] <= line["rows"] - line["bs"]
            assert line["estimate_s"] is None or line["estimate_s"] > 0
        else:
            assert line["accepted"] == 0 and line["rows"] == line["bs"]


def test_run_ahead_rows_leave_the_verifies_to_the_real_request(tiny, baseline):
    """A real request and six run-ahead requests (``rhyme_run_ahead``) in one batch, every
    prompt with a perfect history (greedy, the round before). While the real request runs the
    run-ahead rows are background work: their drafts are not verified, so none of them accepts
    a draft, while the real request takes most of its tokens from drafts, with plain
    decoding's tokens and logprobs. The run-ahead requests are aborted while it runs."""
    engine = tiny("tiny-rhyme-adaptive", rhyme_memory_mb=256)
    prompts = [PROMPTS[0]] + DOZEN[:6]
    pids = [f"bg-{i}" for i in range(len(prompts))]

    def params(pid, run_ahead=False, max_new_tokens=GREEDY["max_new_tokens"]):
        custom = {"rhyme_prompt_id": pid, "rhyme_sample": 0}
        if run_ahead:
            custom["rhyme_run_ahead"] = True
        return {**GREEDY, "max_new_tokens": max_new_tokens, "custom_params": custom}

    for _ in range(2):  # the history: greedy answers of every prompt, then one more round
        engine.generate(input_ids=prompts, sampling_params=[params(p) for p in pids])
        engine.rhyme_advance_epoch()

    async def step():
        ahead = [asyncio.ensure_future(engine.async_generate(
            input_ids=p, rid=f"bg-ahead-{k}", sampling_params=params(pid, True, 400)))
            for k, (p, pid) in enumerate(zip(prompts[1:], pids[1:]))]
        real, aborted = None, False
        async for real in await engine.async_generate(
                input_ids=prompts[0], sampling_params=params(pids[0]), return_logprob=True,
                stream=True):
            if not aborted and len(real["output_ids"]) >= 24:  # stop them while it still runs
                aborted = True
                for k in range(len(ahead)):
                    engine.tokenizer_manager.abort_request(f"bg-ahead-{k}")
        return real, await asyncio.gather(*ahead)

    real, ahead = engine.loop.run_until_complete(step())
    _assert_greedy_matches([real], {"greedy": baseline["greedy"][:1],
                                    "greedy_logprobs": baseline["greedy_logprobs"][:1]})
    assert all(a["meta_info"]["finish_reason"]["type"] == "abort" for a in ahead)
    assert [a["meta_info"].get("spec_num_correct_drafts", 0) for a in ahead] == [0] * len(ahead)
    drafted = real["meta_info"]["spec_num_correct_drafts"] / (len(real["output_ids"]) - 1)
    assert drafted >= 0.5, drafted


def _assert_logprobs_match_model(model_path, prompts, outputs):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    for prompt, o in zip(prompts, outputs):
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([prompt + o["output_ids"]])).logits[0], -1)
        ref = [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(o["output_ids"])]
        got = [x for x, _, _ in o["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-3


def test_every_verify_width_and_switch_is_lossless(tiny, baseline, tiny_model_path):
    """Decode steps walk through plain decode and widths 1, 2, 4, 8, 16 so that every switch
    between two of them happens: greedy tokens and logprobs stay those of normal decoding."""
    engine = tiny("tiny-rhyme-cycle")
    engine.rhyme_breakdown(reset=True)
    for _ in range(3):
        out = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
        _assert_greedy_matches(out, baseline)
        engine.rhyme_advance_epoch()
    assert sum(o["meta_info"]["spec_num_correct_drafts"] for o in out) > 0
    for filters in ({}, {"top_k": 20, "top_p": 0.5, "min_p": 0.08}):  # verify filters rows too
        sampled = engine.generate(input_ids=PROMPTS[:2] * 4, return_logprob=True,
                                  sampling_params={"temperature": 1.0, "max_new_tokens": 24,
                                                   **filters})
        _assert_logprobs_match_model(tiny_model_path, PROMPTS[:2] * 4, sampled)
    kinds = {"plain"} | {f"verify_w{w}" for w in (1, 2, 4, 8, 16)}
    stats = engine.rhyme_stats()
    assert kinds <= {k for k, v in stats["decode_steps"].items() if v > 0}
    breakdown = engine.rhyme_breakdown()
    assert kinds <= set(breakdown["decode"])
    assert breakdown["prefill"]["steps"] > 0 and breakdown["prefill"]["tokens"] > 0
    assert breakdown["prefill"]["cached_tokens"] > 0  # rounds 2-3 repeat the prompts
    emitted = sum(v["tokens"] for v in breakdown["decode"].values())
    assert emitted >= 3 * sum(len(b) - 1 for b in baseline["greedy"])  # first tokens: prefill
    assert all(e[1] in kinds | {"prefill"} for e in breakdown["timeline"])


def test_seeded_sampling_gives_plain_decodings_tokens_at_every_width(tiny):
    """With a ``sampling_seed`` a request draws each token with its position's seeded coin,
    plain or in a verify of any width (the cycle: every switch), so RHYME samples the very
    tokens plain decoding samples, with filters too; the history of a seeded round then
    drafts the next one's tokens exactly. Plain decoding on the overlap scheduler (vanilla's
    default) draws the same, seeds differ between requests, and unseeded ones stay random."""
    filters = {"top_k": 20, "top_p": 0.5, "min_p": 0.08}
    prompts = PROMPTS * 2
    params = [{"temperature": 1.0, "max_new_tokens": 40, "ignore_eos": True,
               "sampling_seed": 1000 + i, **(filters if i % 2 else {})}
              for i in range(len(prompts))]
    reference = [o["output_ids"] for o in tiny("tiny", **SYNC_PLAIN).generate(
        input_ids=prompts, sampling_params=params)]
    overlap = [o["output_ids"] for o in tiny("tiny").generate(input_ids=prompts,
                                                              sampling_params=params)]
    assert overlap == reference
    assert reference[0] != reference[3]  # same prompt, another seed
    engine = tiny("tiny-rhyme-cycle", enable_custom_logit_processor=True)
    engine.rhyme_breakdown(reset=True)
    for round_ in range(3):
        out = engine.generate(input_ids=prompts, sampling_params=params)
        assert [o["output_ids"] for o in out] == reference, f"round {round_}"
        engine.rhyme_advance_epoch()
    assert sum(o["meta_info"]["spec_num_correct_drafts"] for o in out) > 5 * len(prompts)
    kinds = {k for k, v in engine.rhyme_breakdown()["decode"].items() if v["steps"] > 0}
    assert {"plain"} | {f"verify_w{w}" for w in (1, 2, 4, 8, 16)} <= kinds
    unseeded = engine.generate(input_ids=[PROMPTS[0]] * 2, sampling_params={
        "temperature": 1.0, "max_new_tokens": 40, "ignore_eos": True})
    assert unseeded[0]["output_ids"] != unseeded[1]["output_ids"]


def test_penalised_requests_keep_plain_decodings_tokens(tiny):
    """Frequency, presence and repetition penalties and ``min_new_tokens`` depend on the tokens
    above each tree node, which sglang's verify does not see (it gives every node the penalties
    accumulated before the step): such requests get no drafts, and keep plain decoding's tokens
    through every width, while an unpenalised request in the same batch still speculates.
    Without the rule the first three differed here. The reference is plain decoding with the
    synchronous scheduler, as RHYME runs; sglang's overlap scheduler counts the penalties one
    token late (the prompt's last token at the first step)."""
    extras = ({"frequency_penalty": 1.0}, {"presence_penalty": 1.0}, {"repetition_penalty": 1.3},
              {"min_new_tokens": 30}, {})
    params = [{"temperature": 0, "max_new_tokens": 40, **extra} for extra in extras]
    prompts = [PROMPTS[1], PROMPTS[2], PROMPTS[1], PROMPTS[0], PROMPTS[2]]
    plain = tiny("tiny", **SYNC_PLAIN)
    reference = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=params)]
    engine = tiny("tiny-rhyme-cycle", enable_custom_logit_processor=True)
    for _ in range(3):  # later rounds draft from the earlier ones
        out = engine.generate(input_ids=prompts, sampling_params=params)
        assert [o["output_ids"] for o in out] == reference
        engine.rhyme_advance_epoch()
    accepted = [o["meta_info"]["spec_num_correct_drafts"] for o in out]
    assert accepted[:3] == [0, 0, 0] and accepted[4] > 0, accepted


def test_custom_logit_processors_run_in_plain_steps(tiny):
    """sglang's verify does not run custom logit processors (its sampler does): a batch with
    one decodes plain, so a processor that bans the tokens the history drafts keeps them out,
    and the tokens are plain decoding's."""
    from sglang.srt.sampling.custom_logit_processor import DisallowedTokensLogitsProcessor

    banned = {"custom_params": {"token_ids": [163, 67, 322]}}
    proc = [DisallowedTokensLogitsProcessor.to_str()] * len(PROMPTS)
    params = [{"temperature": 0, "max_new_tokens": 40, "ignore_eos": True, **banned}] * len(PROMPTS)
    reference = [o["output_ids"] for o in tiny("tiny", **SYNC_PLAIN).generate(
        input_ids=PROMPTS, sampling_params=params, custom_logit_processor=proc)]
    assert not {163, 67, 322} & {t for r in reference for t in r}
    engine = tiny("tiny-rhyme-cycle", enable_custom_logit_processor=True)
    engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)  # history with those tokens
    engine.rhyme_advance_epoch()
    engine.rhyme_breakdown(reset=True)
    out = engine.generate(input_ids=PROMPTS, sampling_params=params, custom_logit_processor=proc)
    assert [o["output_ids"] for o in out] == reference
    assert set(engine.rhyme_breakdown()["decode"]) == {"plain"}


def test_bf16_every_width_keeps_greedy_tokens_and_logprobs(tiny):
    """In bf16 too (the dtype ``auto`` picks on CPUs with AMX): plain decode and every verify
    width with every switch give the greedy tokens and logprobs of non-speculative bf16
    decoding. Logprobs are compared to 1e-4 as in fp32: the attention computes each row alike
    in decode and verify, so only GEMM rounding at different row counts could move them."""
    plain = tiny("tiny", dtype="bfloat16").generate(
        input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
    reference = {"greedy": [o["output_ids"] for o in plain],
                 "greedy_logprobs": [[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
                                     for o in plain]}
    engine = tiny("tiny-rhyme-cycle", dtype="bfloat16")
    for _ in range(3):
        _assert_greedy_matches(
            engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True),
            reference)
        engine.rhyme_advance_epoch()
    kinds = {"plain"} | {f"verify_w{w}" for w in (1, 2, 4, 8, 16)}
    assert kinds <= {k for k, v in engine.rhyme_stats()["decode_steps"].items() if v > 0}


def test_sampled_token_logprobs_match_non_speculative(tiny, baseline, sampled_sequences):
    assert sum(n for _, _, n in sampled_sequences) > 0  # drafts were accepted while sampling
    engine = tiny("tiny")
    for ids, logprobs, _ in sampled_sequences[:4]:
        ref = engine.generate(
            input_ids=SAMPLE_PROMPT + ids, sampling_params={"temperature": 1.0, "max_new_tokens": 1},
            return_logprob=True, logprob_start_len=len(SAMPLE_PROMPT) - 1,
        )
        ref_lps = [lp for lp, _, _ in ref["meta_info"]["input_token_logprobs"]][1:]
        assert len(ref_lps) == len(logprobs)
        for a, b in zip(logprobs, ref_lps):
            assert math.isclose(a, b, abs_tol=1e-4), (a, b)


def test_history_and_epoch_follow_weight_updates(tiny, tiny_model_path):
    engine = tiny("tiny-rhyme")
    before = engine.rhyme_stats()
    engine.generate(input_ids=PROMPTS[:1], sampling_params={"temperature": 0, "max_new_tokens": 8})
    ok, message = engine.update_weights_from_disk(tiny_model_path)[:2]
    assert ok, message
    engine.generate(input_ids=PROMPTS[:1], sampling_params={"temperature": 0, "max_new_tokens": 8})
    after = engine.rhyme_stats()
    assert after["epoch"] == before["epoch"] + 1
    assert after["num_responses"] == before["num_responses"] + 2


def test_rewards_change_drafting_preference(tiny):
    engine = tiny("tiny-rhyme")
    prompt = [30, 31, 32, 33]
    params = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True}
    out = engine.generate(input_ids=[prompt] * 16, sampling_params=params)
    firsts = [o["output_ids"][0] for o in out]
    engine.rhyme_advance_epoch()
    before = engine.rhyme_draft(prompt, max_tokens=8)
    root = {t: p for t, p, par in zip(before["token_ids"], before["probs"], before["parents"]) if par == -1}
    if len(root) < 2:
        pytest.skip(f"all samples started alike ({set(firsts)}); no branch to prefer")
    favourite = min(root, key=root.get)  # the least likely first token so far
    rewards = [{"rid": o["meta_info"]["id"], "reward": 1.0 if f == favourite else 0.0}
               for o, f in zip(out, firsts)]
    assert engine.rhyme_set_rewards(rewards)["updated"] == len(out)
    after = engine.rhyme_draft(prompt, max_tokens=8)
    root_after = {t: p for t, p, par in zip(after["token_ids"], after["probs"], after["parents"]) if par == -1}
    assert root_after.get(favourite, 0.0) > root[favourite]


def test_siblings_prefill_from_their_leaders_cached_prompt(tiny):
    """Group-aware prefill: of G samples of a prompt submitted at once, one prefills the
    prompt and the G-1 others wait a pass and take it from the prefix cache. (Measured with
    ``rhyme_group_prefill=False``: one pass of all 32 requests, 1280 tokens, 0 cached.)"""
    engine = tiny("tiny-rhyme")
    prompts = [[60 + i for i in range(40)], [110 + i for i in range(40)]]
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    engine.flush_cache_blocking()
    engine.rhyme_breakdown(reset=True)
    held = engine.rhyme_stats()["group_prefill_held"]
    out = engine.generate(input_ids=[p for p in prompts for _ in range(16)], sampling_params=params)
    prefill = engine.rhyme_breakdown()["prefill"]
    assert prefill["cached_tokens"] >= 30 * 32, prefill  # 30 siblings, ~39 cached tokens each
    assert prefill["tokens"] <= 2 * 40 + 30 * 8, prefill  # vs 32 x 40 with no sharing
    assert engine.rhyme_stats()["group_prefill_held"] >= held + 30
    for g in range(2):  # greedy siblings agree
        assert len({tuple(o["output_ids"]) for o in out[16 * g:16 * g + 16]}) == 1
    # the same prompts again: the cache holds them, so no sibling waits a pass for them
    held = engine.rhyme_stats()["group_prefill_held"]
    engine.rhyme_breakdown(reset=True)
    again = engine.generate(input_ids=[p for p in prompts for _ in range(16)], sampling_params=params)
    prefill = engine.rhyme_breakdown()["prefill"]
    assert engine.rhyme_stats()["group_prefill_held"] == held
    assert prefill["cached_tokens"] >= 32 * 32, prefill
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in out]


def test_bad_control_input_is_refused_and_history_intact(tiny, tmp_path):
    from rhyme_sglang.sglang_ext.control import ControlError

    engine = tiny("tiny-rhyme")
    before = engine.rhyme_stats()["num_responses"]
    for bad in ([{"rid": "no-such-request", "reward": 1.0}], [{"rid": "x", "reward": float("nan")}],
                [{"reward": 1.0}], [], "nope"):
        with pytest.raises(ControlError):
            engine.rhyme_set_rewards(bad)
    corrupt = tmp_path / "corrupt.snap"
    corrupt.write_bytes(b"definitely not a snapshot")
    with pytest.raises(ControlError):
        engine.rhyme_load(str(corrupt))
    with pytest.raises(ControlError):
        engine.rhyme_predict_lengths([{"a": 1}])
    for custom in ({"rhyme_prompt_id": 7}, {"rhyme_prompt_id": ""}, {"rhyme_sample": -2},
                   {"rhyme_sample": "0"}):
        with pytest.raises(ValueError, match="rhyme_"):
            engine.generate(input_ids=PROMPTS[0], sampling_params={**GREEDY, "custom_params": custom})
    assert engine.rhyme_stats()["num_responses"] == before
    assert len(engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"]) == 48


def test_snapshot_survives_engine_restart(tiny, engines, tmp_path, monkeypatch):
    import psutil

    from rhyme_sglang.sglang_ext import offline_engine as engine_module
    from rhyme_sglang.sglang_ext import forkserver, own_children

    engine = tiny("tiny-rhyme")
    engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    probes = [(p, [], 8) for p in PROMPTS] + [(PROMPTS[2], PROMPTS[2][:3], 8)]
    drafts = [engine.rhyme_draft(p, c, k) for p, c, k in probes]
    path = tmp_path / "history.snap"
    engine.rhyme_save(str(path))
    engines.close_all()
    restarted = tiny("tiny-rhyme", rhyme_snapshot_path=str(path))
    assert [restarted.rhyme_draft(p, c, k) for p, c, k in probes] == drafts
    own = set(restarted._own_children)
    if forkserver.start_method() == "forkserver":  # forked by the fork server, not by this process
        assert len(own) == 2 and not own & own_children.children()
    engines.close_all()
    alive = [p for p in own if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert not alive, alive
    # sglang calls shutdown again at interpreter exit: it must do nothing then (no step-cost
    # flush to a scheduler that is gone, no kill of PIDs other processes may hold by then)
    calls = []
    monkeypatch.setattr(engine_module, "ControlClient", lambda *a, **k: calls.append("flush"))
    monkeypatch.setattr(own_children, "kill_only", lambda *a, **k: calls.append("kill"))
    assert engine.shutdown() is None and restarted.shutdown() is None and not calls


def test_longest_predicted_prompt_admitted_first_and_policy_switches(tiny):
    from rhyme_sglang.sglang_ext.control import ControlError

    engine = tiny("tiny-rhyme", max_running_requests=1, rhyme_schedule_policy="lpt")
    long_prompt, short_prompt = [40, 41, 42, 43], [50, 51, 52, 53]
    engine.generate(input_ids=[long_prompt], sampling_params={"temperature": 0, "max_new_tokens": 40, "ignore_eos": True})
    engine.generate(input_ids=[short_prompt], sampling_params={"temperature": 0, "max_new_tokens": 4, "ignore_eos": True})
    engine.rhyme_advance_epoch()
    predicted = engine.rhyme_predict_lengths([long_prompt, short_prompt])
    assert predicted[0] > predicted[1]

    def admission_order(blocker_prompt):
        """Both requests must be in the scheduler's waiting queue together. (Pausing does not
        give that: sglang holds requests in the tokenizer manager while paused and releases them
        one by one, so the first may be admitted before the second arrives.) A blocker request
        with a fresh prompt occupies the only running slot while they queue."""
        order, times = [], {}

        async def run(prompt, n, tag, temperature=0.0):
            times[tag + " sent"] = time.monotonic()
            await engine.async_generate(input_ids=prompt, sampling_params={"temperature": temperature, "max_new_tokens": n, "ignore_eos": True})
            times[tag + " done"] = time.monotonic()
            order.append(tag)

        async def scenario():
            # sampled, so history drafts rarely hit and it decodes about one token per step
            tasks = [asyncio.ensure_future(run(blocker_prompt, 600, "blocker", 1.0))]
            await asyncio.sleep(0.15)
            tasks.append(asyncio.ensure_future(run(short_prompt, 4, "short")))
            await asyncio.sleep(0.15)
            tasks.append(asyncio.ensure_future(run(long_prompt, 40, "long")))
            await asyncio.gather(*tasks)

        engine.loop.run_until_complete(scenario())
        # the precondition, checked rather than assumed: both were queued behind the blocker
        assert times["blocker done"] > times["long sent"] + 0.1, (order, times)
        return order[1:]

    assert engine.rhyme_schedule_policy() == "lpt"
    assert admission_order([60, 61, 62]) == ["long", "short"]
    assert engine.rhyme_schedule_policy("fcfs") == "fcfs"
    assert admission_order([70, 71, 72]) == ["short", "long"]
    with pytest.raises(ControlError, match="schedule_policy"):
        engine.rhyme_schedule_policy("shortest-first")
    assert engine.rhyme_schedule_policy() == "fcfs"
    assert engine.rhyme_schedule_policy("lpt") == "lpt"
