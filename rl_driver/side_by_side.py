"""One rollout of a run's final policy, vanilla SGLang vs RHYME, on the same engine settings.

``compare(config)`` reads ``runs/<name>/final`` (the policy the loop saved with
``loop.save_final``) and the run's trace, then times one synchronous rollout of every prompt x
``group_size`` samples twice, one engine at a time in this process: a vanilla engine, and a
RHYME engine given the run's whole history (every traced epoch, with rewards, imported with
``rhyme_import_history``). Both use the run's resolved dtype, the same sampling parameters and
the same maximum length, so the ratio shows what history drafting gives the next epoch.
Response lengths are sampled, so the figure of merit is output tokens per second; the
makespan ratio is reported too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Dict

logger = logging.getLogger(__name__)


async def _rollout(engine, prompts, group: int, params: Dict[str, Any]) -> Dict[str, Any]:
    start = time.perf_counter()

    async def one(prompt, sample):
        sp = dict(params, custom_params={"rhyme_prompt_id": prompt.prompt_id,
                                         "rhyme_sample": sample})
        out = await engine.async_generate(input_ids=list(prompt.token_ids), sampling_params=sp)
        return out

    outs = await asyncio.gather(*(one(p, s) for p in prompts for s in range(group)))
    seconds = time.perf_counter() - start
    tokens = sum(len(o["output_ids"]) for o in outs)
    steps = sum(o["meta_info"].get("spec_verify_ct", 0) or 0 for o in outs)
    return {"makespan_s": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds,
            "tau": tokens / steps if steps else 1.0}


def _history_states(config, before_epoch: int):
    from rhyme_sglang.core import read_trace
    from rhyme_sglang.core.transfer import states_from_responses

    records = read_trace(str(config.run_dir / "trace.jsonl.gz"))
    return states_from_responses(
        (r.prompt_id, r.prompt_token_ids, r.epoch, r.sample, r.response_token_ids, r.reward)
        for r in records if r.epoch < before_epoch)


def compare(config) -> Dict[str, Any]:
    """Time the final policy's rollout with vanilla and with RHYME (``config`` resolved)."""
    from transformers import AutoTokenizer

    from rhyme_sglang import Engine
    from rhyme_sglang.models import resolve_model_path
    from rl_driver.tasks import build_prompts

    final = config.run_dir / "final"
    if not final.is_dir():
        raise ValueError(f"{final} does not exist: run the loop with loop.save_final: true")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(config.model))
    prompts = build_prompts(config.task, tokenizer, config.seed)
    params = config.rollout.sampling_params()
    epochs = config.loop.epochs
    base = config.engine.server_args(str(final))
    base.pop("speculative_algorithm", None)
    base.pop("speculative_num_draft_tokens", None)
    base.pop("rhyme_schedule_policy", None)
    rhyme = config.engine.server_args(str(final))
    rhyme.update(speculative_algorithm="RHYME")
    out: Dict[str, Any] = {}
    for name, kwargs in (("vanilla", base), ("rhyme", rhyme)):
        engine = Engine(**kwargs)
        try:
            if name == "rhyme":
                for _ in range(epochs - 1):  # history epochs 0..E-1; the final policy is epoch E
                    engine.rhyme_advance_epoch()
                added = sum(engine.rhyme_import_history(s)["added"]
                            for s in _history_states(config, epochs))
                engine.rhyme_advance_epoch()
                logger.info("side by side: RHYME got %d history responses", added)
            out[name] = engine.loop.run_until_complete(
                _rollout(engine, prompts, config.rollout.group_size, params))
        finally:
            engine.shutdown()
    out["speedup_tokens_per_s"] = out["rhyme"]["tokens_per_s"] / out["vanilla"]["tokens_per_s"]
    out["speedup_makespan"] = out["vanilla"]["makespan_s"] / out["rhyme"]["makespan_s"]
    return out
