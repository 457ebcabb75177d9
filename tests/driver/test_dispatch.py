"""The dispatcher over small hand-written fake engine actors (real Ray, no sglang).

The fake "model" is deterministic: the next token is a function of the whole context, so a
response continued on another engine from its prefix must equal the uninterrupted one.
A prompt ``[L, pid, 0, 0]`` asks for a response of exactly ``L`` tokens ('stop' after it).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from rl_driver.dispatch import DispatchConfig, Dispatcher, Job

pytestmark = pytest.mark.ray
PROMPT_LEN = 4


def next_token(context):
    return (sum(context) * 31 + len(context) * 7) % 997


def reference(prompt, n):
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(next_token(ctx))
    return ctx[len(prompt):]


class FakeEngine:
    """Generates one token per ``step_s`` per request; honours progress/abort like RolloutActor."""

    def __init__(self, name, step_s=0.01):
        self.name, self.step_s = name, step_s
        self.progress_ = {}
        self.aborted = set()

    async def generate_one(self, request):
        rid, ctx = request["rid"], list(request["input_ids"])
        budget = request["sampling_params"]["max_new_tokens"]
        target = ctx[0] - (len(ctx) - PROMPT_LEN)  # tokens left until 'stop'
        out, start, reason = [], time.time(), None
        self.progress_[rid] = 0
        while reason is None:
            if rid in self.aborted:
                reason = "abort"
            elif len(out) >= target:
                reason = "stop"
            elif len(out) >= budget:
                reason = "length"
            else:
                await asyncio.sleep(self.step_s)
                tok = next_token(ctx + out)
                out.append(tok)
                self.progress_[rid] = len(out)
        self.progress_.pop(rid, None)
        return {"rid": rid, "engine": self.name, "output_ids": out,
                "logprobs": [-0.5] * len(out), "finish_reason": reason, "spec_verify_ct": len(out),
                "completion_tokens": len(out), "start_s": start, "end_s": time.time()}

    async def progress(self):
        return dict(self.progress_)

    async def abort(self, rids):
        self.aborted.update(rids)
        return len(rids)

    async def rhyme_set_rewards(self, rewards):
        return {"updated": len(rewards)}


class FakePool:
    def __init__(self, ray, n, step_s=0.01):
        self.ray, self.step_s = ray, step_s
        self.cls = ray.remote(FakeEngine)
        self.num_engines = n
        self.actors = [self.cls.remote(f"e{i}", step_s) for i in range(n)]
        self.restarted = []

    def restart(self, i):
        self.restarted.append(i)
        self.actors[i] = self.cls.remote(f"e{i}-r", self.step_s)


def make_jobs(lengths_by_engine, max_new_tokens=200, predicted=10.0):
    out = []
    for e, lengths in enumerate(lengths_by_engine):
        out.append([Job(prompt_id=f"p{e}-{k}", sample=0, prompt_ids=[n, e * 100 + k, 0, 0],
                        predicted=predicted, max_new_tokens=max_new_tokens)
                    for k, n in enumerate(lengths)])
    return out


def check_complete(jobs):
    for j in jobs:
        expected = reference(j.prompt_ids, min(j.prompt_ids[0], j.max_new_tokens))
        assert j.response_ids == expected, j.key
        assert len(j.logprobs) == len(j.response_ids)
        assert j.finish_reason == ("stop" if j.prompt_ids[0] <= j.max_new_tokens else "length")


def test_overrunning_requests_migrate_losslessly(ray_cluster):
    pool = FakePool(ray_cluster, 2)
    # engine 0: four long requests (they overrun a prediction of 10); engine 1: short ones
    jobs = make_jobs([[120, 110, 100, 90], [5, 6]])
    config = DispatchConfig(sampling_params={"max_new_tokens": 200}, poll_interval_s=0.05)
    seen = []
    result = Dispatcher(pool, config, on_progress=lambda *a: seen.append(a)).run(jobs)
    assert result.stats["migrations"] >= 1
    # progress: (finished, total, tokens, elapsed) from (0, 6, 0, 0) up to all six finished
    assert seen[0] == (0, 6, 0, 0.0) and seen[-1][:3] == (6, 6, result.stats["response_tokens"])
    assert [s[0] for s in seen] == sorted(s[0] for s in seen) and seen[-1][3] > 0
    migrated = [j for j in result.jobs if j.migrations]
    assert migrated and all(j.engines[:2] == [0, 1] for j in migrated)  # first hop: busy -> idle
    check_complete(result.jobs)
    # the same workload without migration: same responses, longer makespan
    pool2 = FakePool(ray_cluster, 2)
    no_mig = Dispatcher(pool2, DispatchConfig(sampling_params={"max_new_tokens": 200},
                                              migrate=False)).run(make_jobs([[120, 110, 100, 90], [5, 6]]))
    assert [j.response_ids for j in no_mig.jobs] == [j.response_ids for j in result.jobs]
    assert no_mig.stats["bubble_ratio"] > result.stats["bubble_ratio"]


def test_a_base_seed_gives_each_sample_its_own_seed_on_every_engine():
    """Samples of a group must differ, so a ``sampling_seed`` in the sampling parameters is a
    base: each (prompt, sample) gets its own seed, and keeps it when a migration continues it
    on another engine (with seeds, the continuation draws the tokens it would have drawn)."""
    from types import SimpleNamespace

    from rl_driver.dispatch import job_params

    base = {"temperature": 1.0, "sampling_seed": 5}
    seeds = {(p, k): job_params(base, p, k)["sampling_seed"] for p in ("a", "b") for k in range(4)}
    assert len(set(seeds.values())) == 8 and 5 not in seeds.values()
    assert job_params(base, "a", 1, max_new_tokens=3) == {
        "temperature": 1.0, "sampling_seed": seeds["a", 1], "max_new_tokens": 3}
    assert job_params({"temperature": 1.0}, "a", 1) == {"temperature": 1.0}

    class Capture:
        def __init__(self):
            self.requests = []
            self.generate_one = SimpleNamespace(remote=self.requests.append)

    pool = SimpleNamespace(actors=[Capture(), Capture()], num_engines=2, restart=None)
    dispatcher = Dispatcher(pool, DispatchConfig(sampling_params=base))
    job = Job(prompt_id="a", sample=2, prompt_ids=[1, 2], predicted=5.0, max_new_tokens=8)
    dispatcher._submit(job, 0)
    job.response_ids = [7]
    dispatcher._submit(job, 1)  # the job continued on the other engine
    first, second = (a.requests[0]["sampling_params"] for a in pool.actors)
    assert first["sampling_seed"] == second["sampling_seed"] == seeds["a", 2]
    assert (first["max_new_tokens"], second["max_new_tokens"]) == (8, 7)


def test_budget_and_length_finish(ray_cluster):
    pool = FakePool(ray_cluster, 1)
    result = Dispatcher(pool, DispatchConfig(sampling_params={"max_new_tokens": 7})).run(
        make_jobs([[3, 50]], max_new_tokens=7))
    check_complete(result.jobs)
    assert [j.finish_reason for j in result.jobs] == ["stop", "length"]


def test_killed_engine_mid_rollout_loses_no_sample(ray_cluster):
    pool = FakePool(ray_cluster, 2, step_s=0.02)
    jobs = make_jobs([[60, 70, 80, 3], [60, 70, 80, 4]])
    victim = pool.actors[1]
    killer = threading.Timer(0.4, lambda: ray_cluster.kill(victim))
    killer.start()
    result = Dispatcher(pool, DispatchConfig(sampling_params={"max_new_tokens": 200},
                                             migrate=False)).run(jobs)
    killer.join()
    assert pool.restarted == [1] and result.stats["restarts"] == 1
    assert result.stats["reissued"] >= 3  # the three long requests were in flight
    assert len(result.jobs) == 8
    check_complete(result.jobs)


def test_framework_hook_rollout_groups(ray_cluster):
    from rl_driver.hooks import report_rewards, rollout_groups

    pool = FakePool(ray_cluster, 2)
    prompts = {"a": [5, 1, 0, 0], "b": [40, 2, 0, 0], "c": [7, 3, 0, 0]}
    out = rollout_groups(pool.actors, prompts, group_size=3,
                         sampling_params={"max_new_tokens": 64}, predicted={"b": 40.0})
    assert sorted((r["prompt_id"], r["sample"]) for r in out) == [
        (p, s) for p in "abc" for s in range(3)]
    for r in out:
        assert r["response_ids"] == reference(prompts[r["prompt_id"]], prompts[r["prompt_id"]][0])
    assert report_rewards(pool.actors, out, {(r["prompt_id"], r["sample"]): 1.0 for r in out}) == 9
