"""Steps at dataset scale on the tiny model with 2 RHYME engines under Ray: 6 prompts, 3 a
step (2 steps an epoch), 2 epochs, histories kept by the driver between visits
(``rollout.history: per_step``) and run-ahead drafts on idle engines. One epoch runs, then
the run resumes for the second: per-step metrics and visits, engines holding at most the
current and the next step's prompts, measured transfers, each (prompt, sample) answered once
per visit with no run-ahead output in the trace or the training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.sglang, pytest.mark.slow]

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
P, B, G = 6, 3, 2


def settings(out, epochs):
    return {"loop.output_dir": str(out), "loop.epochs": epochs, "name": "steps",
            "task.num_prompts": P, "rollout.group_size": G, "rollout.prompts_per_step": B,
            "rollout.history": "per_step", "rollout.history_shards": 4,
            "rollout.run_ahead": True, "rollout.run_ahead_samples": 2,
            "rollout.poll_interval_s": 0.05, "rollout.max_new_tokens": 32,
            # the tiny model's 32-token answers leave aborted run-ahead drafts shorter than the
            # engines' default minimum record (32 tokens)
            "engine.extra": {"rhyme_run_ahead_min_tokens": 4}}


def hold_engine1(threads):
    """``on_rollout_start``: engine1 pauses for 3 s once the step's requests are in flight, so
    engine0 runs out of jobs while engine1 still has some (run-ahead then runs, whatever
    the tiny model's lengths); the pause keeps requests in place (lossless)."""
    import threading
    import time

    import ray

    def hold(pool):
        ray.get(pool.actors[1].pause_generation.remote())
        time.sleep(3.0)
        ray.get(pool.actors[1].resume_generation.remote())

    def start(epoch, pool):
        threads.append(threading.Thread(target=hold, args=(pool,)))
        threads[-1].start()

    return start


@pytest.fixture(scope="module")
def steps_run(ray_cluster, tmp_path_factory):
    from rl_driver.config import load_config
    from rl_driver.loop import run

    out = tmp_path_factory.mktemp("runs")
    threads: list = []
    first = run(load_config(str(CONFIG), settings(out, 1)), on_rollout_start=hold_engine1(threads))
    config = load_config(str(CONFIG), settings(out, 2))
    second = run(config, resume=True, on_rollout_start=hold_engine1(threads))
    for t in threads:
        t.join()
    lines = [json.loads(x) for x in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    return config, first, second, lines


def test_steps_epochs_and_visits(steps_run):
    from rl_driver.steps import StepSampler

    config, first, second, lines = steps_run
    assert [m["step"] for m in first] == [0, 1] and [m["step"] for m in second] == [2, 3]
    assert [m["step"] for m in lines] == [0, 1, 2, 3]
    assert [m["epoch"] for m in lines] == [0, 0, 1, 1]
    assert [m["step_in_epoch"] for m in lines] == [0, 1, 0, 1]
    assert [m["visit"] for m in lines] == ["first", "first", "revisit", "revisit"]
    assert [m["train"]["version"] for m in lines] == [1, 2, 3, 4]  # one update a step
    sampler = StepSampler([f"target-0-{i}" for i in range(P)], B, 0)
    for m in lines[2:]:
        assert m["updates_since_last_visit"] == sampler.visit(m["step"]).summary()[
            "updates_since_last_visit"]
        assert 1 <= m["updates_since_last_visit_min"] <= m["updates_since_last_visit_max"] <= 3
    # over the epoch every prompt comes back after 2 updates on average (one epoch of steps)
    assert (lines[2]["updates_since_last_visit"] + lines[3]["updates_since_last_visit"]) / 2 == 2
    epochs = [json.loads(x) for x in (config.run_dir / "epochs.jsonl").read_text().splitlines()]
    assert [e["epoch"] for e in epochs] == [0, 1] and [e["steps"] for e in epochs] == [2, 2]
    assert [e["prompts"] for e in epochs] == [P, P]
    assert epochs[1]["response_tokens"] == lines[2]["response_tokens"] + lines[3]["response_tokens"]
    state = json.loads((config.run_dir / "state.json").read_text())
    assert state["next_step"] == 4 and state["next_epoch"] == 2


def test_engines_hold_current_and_next_step_only(steps_run):
    *_, lines = steps_run
    for m in lines:
        assert all(n is not None and n <= 2 * B for n in m["history_num_prompts"]), m["step"]
        assert all(n <= 2 * B for n in m["history_num_prompts_after_drop"])
    assert lines[-1]["history_num_prompts"] == [0, 0]  # the last step kept nothing in engines


def test_transfers_are_measured(steps_run):
    config, *_, lines = steps_run
    for m in lines:
        assert m["history_export_bytes"] > 0 and m["history_exported_prompts"] >= B
        assert m["history_export_s"] > 0 and m["history_transfer_critical_s"] >= 0
        assert m["history_store_write_bytes"] > 0
        assert m["history_drop_busy"] == 0
    # the resumed process imports its first step's prompts up front, from the files the
    # first process wrote, then the next step's (revisits: stored histories)
    assert lines[2]["history_import_bytes"] > 0 and lines[2]["history_import_s"] > 0
    assert lines[1]["history_import_bytes"] == 0  # the first process's last step: no next one
    assert len(list((config.run_dir / "history").glob("shard-*/*.pkl"))) >= B  # a file a prompt


def test_each_sample_once_per_visit_and_no_run_ahead_output(steps_run):
    from rhyme_sglang.core import read_trace

    config, *_, lines = steps_run
    records = read_trace(str(config.run_dir / "trace.jsonl.gz"))
    from rl_driver.steps import StepSampler

    sampler = StepSampler([f"target-0-{i}" for i in range(P)], B, 0)
    for s in range(4):
        rows = [r for r in records if r.epoch == s]  # the trace's epoch is the global step
        assert sorted((r.prompt_id, r.sample) for r in rows) == sorted(
            (p, k) for p in sampler.step(s).prompt_ids for k in range(G))
    for m in lines:  # trained on exactly the step's responses
        assert m["train"]["train_tokens"] == m["response_tokens"] > 0
        assert m["mean_response_len"] == m["response_tokens"] / (B * G)


def test_run_ahead_ran_and_reached_the_engines(steps_run):
    *_, lines = steps_run
    assert all("run_ahead_requests" in m for m in lines)
    ran = [m for m in lines if m["run_ahead_requests"] > 0]
    assert [m["step"] for m in ran] == [0, 2], [m["run_ahead_requests"] for m in lines]
    for m in ran:
        assert m["run_ahead_abort_s"] >= 0 and m["run_ahead_tokens"] > 0
        assert 0 <= m["run_ahead_aborted"] <= m["run_ahead_requests"]
        assert sum(m["run_ahead_records"]) > 0  # the next step's engines hold the drafts
    assert lines[1]["run_ahead_requests"] == lines[3]["run_ahead_requests"] == 0  # no next step


def test_dropped_prompts_leave_their_residue_in_the_engines(steps_run):
    """After each step the driver drops the prompts the next step does not sample; their
    responses stay in the engines' cross-prompt trie (the residue), within its bound."""
    *_, lines = steps_run
    assert all(len(m["history_residue_tokens"]) == len(m["history_num_prompts"]) for m in lines)
    assert any(sum(m["history_residue_tokens"]) > 0 for m in lines[:-1])
    assert all(0 <= t <= 1 << 18 for m in lines for t in m["history_residue_tokens"])


def test_run_ahead_is_aborted_at_the_last_real_finish(ray_cluster):
    """The dispatcher over test_dispatch's fake engines: engine1 runs out of jobs while
    engine0 still decodes a long one, so engine1 drafts the next step's prompt (its own
    planned one first) until that job finishes; then they are aborted at once, and the
    step's responses are exactly those of the real jobs."""
    from rl_driver.dispatch import DispatchConfig, Dispatcher, RunAhead, run_ahead_seed
    from tests.driver.test_dispatch import FakeEngine, check_complete, make_jobs

    class RecordingEngine(FakeEngine):
        async def generate_one(self, request):
            self.__dict__.setdefault("seen", []).append(request)
            return await FakeEngine.generate_one(self, request)

        async def requests(self):
            return self.__dict__.get("seen", [])

    class Pool:
        num_engines = 2

        def __init__(self):
            cls = ray_cluster.remote(RecordingEngine)
            self.actors = [cls.remote(f"e{i}", 0.01) for i in range(2)]

        def restart(self, i):
            raise AssertionError(f"engine{i} died")

    pool = Pool()
    jobs = make_jobs([[60], [5, 6]])
    ahead = RunAhead(preferred=[["n1"], ["n0"]], prompt_ids={"n0": [200, 7, 0, 0], "n1": [200, 8, 0, 0]},
                     samples=2, step=1, seed=0, max_new_tokens=200)
    dispatcher = Dispatcher(pool, DispatchConfig(sampling_params={"max_new_tokens": 200},
                                                 poll_interval_s=0.02, migrate=False))
    result = dispatcher.run(jobs, ahead)
    stats = dispatcher.run_ahead_stats
    check_complete(result.jobs)  # the real responses, whole and unchanged
    assert sorted(j.key for j in result.jobs) == ["p0-0/0", "p1-0/0", "p1-1/0"]
    assert stats["claimed"] == {"n0": 1}  # engine0 never idled before the step ended
    assert stats["run_ahead_requests"] == stats["run_ahead_aborted"] == 2
    assert 0 < stats["run_ahead_tokens"] < 2 * 200
    assert stats["run_ahead_abort_s"] < 0.5 and stats["run_ahead_drain_s"] < 5
    sent = [r for r in ray_cluster.get(pool.actors[1].requests.remote()) if r.get("run_ahead")]
    assert [(r["prompt_id"], r["sample"]) for r in sent] == [("n0", 0), ("n0", 1)]
    assert [r["sampling_params"]["sampling_seed"] for r in sent] == [
        run_ahead_seed(0, 1, "n0", k) for k in range(2)]
    assert all(r["rid"].startswith("runahead/") for r in sent)
