"""The engine modes, prompt mixes, timed request rounds, checkpoint loads and GRPO samples that
bench_rollout, bench_ordering and dataset_scale share."""

from __future__ import annotations

import asyncio
import time

# Engine keyword arguments of each mode a rollout benchmark can run.
MODES = {
    "vanilla": {},
    "ngram": {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 9},
    "rhyme": {"speculative_algorithm": "RHYME", "speculative_num_draft_tokens": 17},
    "rhyme_fixed": {"speculative_algorithm": "RHYME", "speculative_num_draft_tokens": 9,
                    "rhyme_adaptive": False},
    # not in the default --modes: RHYME with one verify width per step for the whole batch
    # (each request padded to it) instead of per-request widths
    "rhyme_batch_width": {"speculative_algorithm": "RHYME", "speculative_num_draft_tokens": 17,
                          "rhyme_ragged": False},
    # not in the default --modes: RHYME scoring steps by batch tokens per second, without the
    # critical-path horizon (core/horizon.py)
    "rhyme_no_horizon": {"speculative_algorithm": "RHYME", "speculative_num_draft_tokens": 17,
                         "rhyme_horizon": False},
    # not in the default --modes: RHYME with each request's own acceptance evidence on top of
    # the shared calibration (rhyme_request_calibration)
    "rhyme_request_calibration": {"speculative_algorithm": "RHYME",
                                  "speculative_num_draft_tokens": 17,
                                  "rhyme_request_calibration": True},
}


def build_prompts(model_path: str, counts, datasets: list[str], seed: int):
    """``counts``: prompts in total (split evenly) or a list with one count per dataset."""
    from transformers import AutoTokenizer

    from rl_driver.config import TaskConfig
    from rl_driver.tasks import build_prompts as task_prompts

    tok = AutoTokenizer.from_pretrained(model_path)
    if isinstance(counts, int):
        counts = [max(1, counts // len(datasets))] * len(datasets)
    if len(counts) != len(datasets) or min(counts) < 1:
        raise ValueError(f"need one positive prompt count per dataset {datasets}, got {counts}")
    prompts = []
    for name, n in zip(datasets, counts):
        prompts += task_prompts(TaskConfig(dataset=name, num_prompts=n), tok, seed)
    return prompts, tok


async def timed_pairs(engine, pairs, max_new_tokens: int, exact_lengths=None,
                      return_logprob: bool = False, seeds=None):
    """Submit every (prompt, sample) pair at once at temperature 1.0; return per-request
    results (ids, meta_info, latency) and the makespan. With ``exact_lengths``
    ({(prompt_id, sample): n}) each request generates exactly n tokens; with ``seeds``
    ({(prompt_id, sample): seed}) each request draws with that ``sampling_seed``."""
    start = time.perf_counter()

    async def one(prompt, sample):
        params = {"temperature": 1.0, "max_new_tokens": max_new_tokens,
                  "custom_params": {"rhyme_prompt_id": prompt.prompt_id, "rhyme_sample": sample}}
        if seeds is not None:
            params["sampling_seed"] = seeds[prompt.prompt_id, sample]
        if exact_lengths is not None:
            params.update(max_new_tokens=max(1, exact_lengths[prompt.prompt_id, sample]),
                          ignore_eos=True)
        out = await engine.async_generate(input_ids=prompt.token_ids, sampling_params=params,
                                          return_logprob=return_logprob)
        return {"prompt": prompt, "sample": sample, "ids": out["output_ids"],
                "meta": out["meta_info"], "latency": time.perf_counter() - start}

    results = await asyncio.gather(*(one(p, s) for p, s in pairs))
    return results, time.perf_counter() - start


def load_checkpoint(engine, checkpoint) -> None:
    """The engine's weights from an HF folder (the history epoch advances with them)."""
    ok, msg = engine.update_weights_from_disk(checkpoint)[:2]
    if not ok:
        raise RuntimeError(f"weight update failed: {msg}")


def grpo_samples(results, rewards, group: int):
    """Trainer samples of timed requests (``timed_pairs`` results with logprobs) and their
    rewards, advantages normalised per group of ``group``."""
    from rl_driver.grpo import group_advantages

    adv = group_advantages(rewards, group)
    return [{"prompt_ids": r["prompt"].token_ids, "response_ids": r["ids"],
             "logprobs": [lp for lp, _, _ in r["meta"]["output_token_logprobs"]],
             "advantage": a} for r, a in zip(results, adv)]
