"""One rollout of a run's final policy, vanilla SGLang vs RHYME, on the same engine settings.

``compare(config)`` reads ``runs/<name>/final`` (the policy the loop saved with
``loop.save_final``) and the run's trace, then times one synchronous rollout of every prompt x
``group_size`` samples with a vanilla engine and with a RHYME engine given the run's whole
history (every traced epoch, with rewards, imported with ``rhyme_import_history``). Both use
the run's resolved dtype and threads, the same sampling parameters and the same maximum
length, so the ratio shows what history drafting gives the next epoch. Request (prompt, sample)
draws with the same ``sampling_seed`` on both engines (:func:`rl_driver.tasks.sampling_seed`),
and a seeded request decodes the same tokens with or without speculation, so both engines
decode the same answers (``same_tokens``: the share of requests whose tokens are equal) and
the makespan ratio compares the same work; output tokens per second is reported too, and
each engine's time breakdown of the timed rollout (decode steps by kind with their
seconds, prefill, overheads: :func:`rl_driver.metrics.summarize_breakdown`).

Each engine runs in a child process whose output (SGLang's start-up logs and warnings) goes to
``runs/<name>/side_by_side_{vanilla,rhyme}.log``.

A run with two or more engines shares the machine's cores between them, so the two engines
run at the same time, each in its own process, and their timed rollouts start together (a
barrier after start-up and history import): each gets the share of the machine a loop engine
has. Whichever finishes first leaves the other the whole machine for its last part, which
favours the slower one. A one-engine run times them one after another.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import time
from typing import Any, Dict, Optional

logger = logging.getLogger(__name__)


async def _rollout(engine, prompts, group: int, params: Dict[str, Any],
                   seeds: Dict[Any, int]) -> Dict[str, Any]:
    start = time.perf_counter()

    async def one(prompt, sample):
        sp = dict(params, sampling_seed=seeds[prompt.prompt_id, sample],
                  custom_params={"rhyme_prompt_id": prompt.prompt_id, "rhyme_sample": sample})
        out = await engine.async_generate(input_ids=list(prompt.token_ids), sampling_params=sp)
        return out

    keys = [(p, s) for p in prompts for s in range(group)]
    outs = await asyncio.gather(*(one(p, s) for p, s in keys))
    seconds = time.perf_counter() - start
    tokens = sum(len(o["output_ids"]) for o in outs)
    steps = sum(o["meta_info"].get("spec_verify_ct", 0) or 0 for o in outs)
    return {"makespan_s": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds,
            "tau": tokens / steps if steps else 1.0,
            "output_ids": [[p.prompt_id, s, o["output_ids"]] for (p, s), o in zip(keys, outs)]}


def _history_states(config, before_epoch: int):
    from rhyme_sglang.core import read_trace
    from rhyme_sglang.core.transfer import states_from_responses

    records = read_trace(str(config.run_dir / "trace.jsonl.gz"))
    return states_from_responses(
        (r.prompt_id, r.prompt_token_ids, r.epoch, r.sample, r.response_token_ids, r.reward)
        for r in records if r.epoch < before_epoch)


def _engine_args(config, name: str) -> Dict[str, Any]:
    kwargs = config.engine.server_args(str(config.run_dir / "final"))
    if name == "vanilla":  # plain sglang: no speculation and none of RHYME's knobs
        for key in [k for k in kwargs if k.startswith(("speculative_", "rhyme_"))]:
            del kwargs[key]
    else:
        kwargs.update(speculative_algorithm="RHYME")
    return kwargs


def _time_one(config, name: str, barrier=None) -> Dict[str, Any]:
    """Start ``name``'s engine (RHYME: import the run's history), wait at ``barrier``, time
    one rollout, shut the engine down."""
    from transformers import AutoTokenizer

    from rhyme_sglang import Engine
    from rhyme_sglang.models import resolve_model_path
    from rl_driver.metrics import summarize_breakdown
    from rl_driver.tasks import build_prompts, sampling_seed

    prompts = build_prompts(config.task, AutoTokenizer.from_pretrained(
        resolve_model_path(config.model)), config.seed)
    epochs = config.loop.epochs
    group = config.rollout.group_size
    seeds = {(p.prompt_id, k): sampling_seed(config.seed, epochs, p.prompt_id, k)
             for p in prompts for k in range(group)}
    engine = Engine(**_engine_args(config, name))
    try:
        if name == "rhyme":
            for _ in range(epochs - 1):  # history epochs 0..E-1; the final policy is epoch E
                engine.rhyme_advance_epoch()
            added = sum(engine.rhyme_import_history(s)["added"]
                        for s in _history_states(config, epochs))
            engine.rhyme_advance_epoch()
            logger.info("side by side: RHYME got %d history responses", added)
        if barrier is not None:
            barrier.wait()
        engine.rhyme_breakdown(reset=True)  # the timed rollout's window only
        out = engine.loop.run_until_complete(
            _rollout(engine, prompts, group, config.rollout.sampling_params(), seeds))
        out["breakdown"] = summarize_breakdown(engine.rhyme_breakdown())
        return out
    finally:
        engine.shutdown()


def log_path(config, name: str):
    """Where a side-by-side child's output (its engine's start-up and warnings) goes."""
    return config.run_dir / f"side_by_side_{name}.log"


def _child(config, name: str, barrier, results) -> None:
    import os
    import sys

    # the engine's start-up output (sglang's import warnings and logs, its scheduler's too)
    # goes to a file of the run, not into the demo's progress lines
    log = open(log_path(config, name), "w")
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    try:
        results.put((name, _time_one(config, name, barrier)))
    except BaseException as exc:
        barrier.abort()  # the other side must not wait for an engine that never comes
        results.put((name, {"error": f"{type(exc).__name__}: {exc} (log: {log_path(config, name)})"}))
        raise


def _concurrent(config) -> Dict[str, Any]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # sglang engines start their own processes: not daemonic
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_child, args=(config, name, barrier, results), name=name)
             for name in ("vanilla", "rhyme")]
    for p in procs:
        p.start()
    out: Dict[str, Any] = {}
    while len(out) < len(procs):
        try:
            name, result = results.get(timeout=5.0)
            out[name] = result
        except queue.Empty:  # a child that died without a word (killed, crashed)
            for p in procs:
                if p.exitcode not in (None, 0) and p.name not in out:
                    out[p.name] = {"error": f"process exited with code {p.exitcode}"}
                    barrier.abort()
    for p in procs:
        p.join()
    failed = {k: v["error"] for k, v in out.items() if "error" in v}
    if failed:
        raise RuntimeError(f"side by side failed: {failed}")
    return out


def compare(config, concurrent: Optional[bool] = None) -> Dict[str, Any]:
    """Time the final policy's rollout with vanilla and with RHYME (``config`` resolved).
    ``concurrent``: both engines at once (default: when the run has two or more engines)."""
    final = config.run_dir / "final"
    if not final.is_dir():
        raise ValueError(f"{final} does not exist: run the loop with loop.save_final: true")
    if concurrent is None:
        concurrent = config.engine.num_engines >= 2
    if concurrent:
        out = _concurrent(config)
    else:
        out = {name: _time_one(config, name) for name in ("vanilla", "rhyme")}
    out["concurrent"] = concurrent
    tokens = {(pid, k): ids for pid, k, ids in out["vanilla"]["output_ids"]}
    same = [tokens.get((pid, k)) == ids for pid, k, ids in out["rhyme"]["output_ids"]]
    out["same_tokens"] = sum(same) / len(same)
    out["speedup_tokens_per_s"] = out["rhyme"]["tokens_per_s"] / out["vanilla"]["tokens_per_s"]
    out["speedup_makespan"] = out["vanilla"]["makespan_s"] / out["rhyme"]["makespan_s"]
    return out
