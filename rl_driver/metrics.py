"""Run bookkeeping on disk: loop state (for ``--resume``), metrics JSONL (one line per step;
with steps smaller than the dataset also ``epochs.jsonl``, one line per finished epoch), and
the rollout trace."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List

from rhyme_sglang.core import TraceRecord, read_trace, write_trace
from rl_driver.balance import imbalance, predicted_makespan


@dataclass
class RunState:
    """What a resumed run needs besides the trainer checkpoint and the history snapshots."""

    next_epoch: int = 0  # the epoch of next_step
    weight_version: int = 0
    affinity: Dict[str, int] = field(default_factory=dict)  # prompt_id -> engine last visit
    next_step: int = 0  # the global step to run next (= next_epoch with one step per epoch)
    prompts_per_step: int = 0  # the run's rollout.prompts_per_step (a resume must keep it)
    first_epoch_of_process: int = 0  # the first step this process runs

    @classmethod
    def load(cls, run_dir: Path) -> "RunState":
        path = Path(run_dir) / "state.json"
        if not path.exists():
            raise ValueError(f"cannot resume: {path} does not exist (no finished epoch)")
        raw = json.loads(path.read_text())
        state = cls(next_epoch=int(raw["next_epoch"]), weight_version=int(raw["weight_version"]),
                    affinity={k: int(v) for k, v in raw["affinity"].items()},
                    next_step=int(raw.get("next_step", raw["next_epoch"])),
                    prompts_per_step=int(raw.get("prompts_per_step", 0)))
        state.first_epoch_of_process = state.next_step
        return state

    def save(self, run_dir: Path) -> None:
        path = Path(run_dir) / "state.json"
        tmp = path.with_suffix(".json.tmp")
        data = asdict(self)
        data.pop("first_epoch_of_process")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)


def open_run_dir(run_dir: Path, config: Dict[str, Any], resume: bool) -> RunState:
    """Create ``run_dir`` and write ``config.json``; a fresh run drops the last run's metrics,
    state and driver history store (``history/``), a resumed one loads its state and must
    keep its ``rollout.prompts_per_step`` (its steps are numbered by it)."""
    import shutil

    from rl_driver.config import ConfigError

    run_dir.mkdir(parents=True, exist_ok=True)
    per_step = int(config.get("rollout", {}).get("prompts_per_step", 0))
    state = RunState.load(run_dir) if resume else RunState(prompts_per_step=per_step)
    if state.prompts_per_step != per_step:
        raise ConfigError(f"config key 'rollout.prompts_per_step': the resumed run has "
                          f"{state.prompts_per_step}, got {per_step!r}")
    if not resume:
        for stale in ("metrics.jsonl", "epochs.jsonl", "state.json"):
            (run_dir / stale).unlink(missing_ok=True)
        shutil.rmtree(run_dir / "history", ignore_errors=True)
    (run_dir / "config.json").write_text(json.dumps(config, indent=2))
    return state


def append_metrics(path: Path, metrics: Dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(metrics) + "\n")


def read_metrics(path: Path) -> List[Dict[str, Any]]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class TraceLog:
    """All finished responses of the run, rewritten atomically after every epoch."""

    def __init__(self, path: Path, keep: bool = False, before_epoch: int = 1 << 30):
        self.path = Path(path)
        self.records: List[TraceRecord] = []
        if keep and self.path.exists():
            self.records = [r for r in read_trace(str(self.path)) if r.epoch < before_epoch]

    def add_epoch(self, epoch: int, jobs, rewards: Dict[str, float]) -> None:
        self.records = [r for r in self.records if r.epoch != epoch]
        for j in jobs:
            self.records.append(TraceRecord(
                prompt_id=j.prompt_id, epoch=epoch, sample=j.sample,
                prompt_token_ids=list(j.prompt_ids), response_token_ids=list(j.response_ids),
                reward=float(rewards[j.key]), finish_reason=j.finish_reason or "stop"))
        write_trace(str(self.path), self.records)

    @property
    def meta_path(self) -> Path:
        name = self.path.name
        for suffix in (".jsonl.gz", ".jsonl"):
            if name.endswith(suffix):
                name = name[: -len(suffix)]
        return self.path.with_name(name + ".meta.json")

    def write_meta(self, **meta: Any) -> Path:
        metrics = read_metrics(self.path.parent / "metrics.jsonl")
        meta["metrics"] = [{k: v for k, v in m.items() if k != "timeline"} for m in metrics]
        meta["num_records"] = len(self.records)
        self.meta_path.write_text(json.dumps(meta, indent=2, default=str))
        return self.meta_path


def summarize_breakdown(breakdown: Dict[str, Any]) -> Dict[str, Any]:
    """An engine's time breakdown (``Engine.rhyme_breakdown``) without its step timeline, plus
    the running-batch size over time as ``[t, batch_size]`` points (for the report's plot)."""
    out = {k: v for k, v in breakdown.items() if k != "timeline"}
    out["batch_over_time"] = [[round(t, 3), bs] for t, _, bs, _, _ in breakdown.get("timeline", [])]
    return out


def epoch_metrics(epoch: int, *, balance: str, plan, rollout, rewards: Dict[str, float], fed,
                  train: Dict[str, Any], sync_s: float, sync_method: str,
                  rhyme_stats: List[Dict[str, Any]], startup_s: float, snapshot_bytes: int,
                  engine_nodes: List[Any]) -> Dict[str, Any]:
    """One line of ``metrics.jsonl``: the epoch's reward, rollout, balance, history, train,
    sync and placement figures. ``plan``: ``phases.Plan``; ``rollout``: ``phases.Rollout``;
    ``fed``: ``phases.Fed``; ``train``: ``Trainer.train_step``'s result; ``rhyme_stats``: per
    engine; ``snapshot_bytes``: the histories pulled to the driver at the epoch's end;
    ``engine_nodes``: each engine's Ray node id at the epoch's end."""
    stats, start = rollout.result.stats, rollout.result.stats["start_s"]
    return {
        "epoch": epoch,
        "mean_reward": sum(rewards.values()) / len(rewards),
        "rollout_makespan_s": stats["makespan_s"],
        "tokens_per_s": stats["tokens_per_s"],
        "response_tokens": stats["response_tokens"],
        "mean_response_len": stats["response_tokens"] / len(rollout.jobs),
        "tau": stats["tau"],
        "bubble_ratio": stats["bubble_ratio"],
        "engine_busy_s": stats["engine_busy_s"],
        "migrations": stats["migrations"],
        "restarts": stats["restarts"],
        "reissued": stats["reissued"],
        "balance": balance,
        "predicted_makespan": predicted_makespan(plan.assignment, plan.load),
        "predicted_makespan_round_robin": predicted_makespan(plan.round_robin, plan.load),
        "predicted_imbalance": imbalance(plan.assignment, plan.load),
        "predicted_imbalance_round_robin": imbalance(plan.round_robin, plan.load),
        "train_time_s": train["train_time_s"],
        "sync_time_s": sync_s,
        "sync_method": sync_method,
        "rewards_sent": fed.rewards_sent, "responses_forwarded": fed.responses_forwarded,
        "history_epoch": [s.get("epoch") for s in rhyme_stats],
        "history_responses": [s.get("num_responses") for s in rhyme_stats],
        "history_memory_bytes": [s.get("memory_bytes") for s in rhyme_stats],
        # per engine: ok, calibration_at_bound or verify_starved (core/health.py)
        "speculation_health": [s.get("speculation_health", {}).get("status")
                               for s in rhyme_stats],
        "train": {k: v for k, v in train.items() if k != "train_time_s"},
        "breakdown": [summarize_breakdown(b) for b in rollout.breakdown],
        "timeline": {str(e): [[s - start, t - start] for s, t in iv]
                     for e, iv in rollout.result.busy.items()},
        "startup_s": startup_s,
        # which engines were restarted (re-placed on a live node) and the history bytes moved
        # between driver and engines: snapshots pulled, forwarded responses, restored snapshots
        "restarted_engines": list(rollout.restarted),
        "engine_nodes": list(engine_nodes),
        "snapshot_bytes": snapshot_bytes,
        "history_forwarded_bytes": fed.forwarded_bytes,
        "history_restored_bytes": rollout.restored_bytes,
    }


# summed over an epoch's steps in epochs.jsonl (a step line's keys, where present)
EPOCH_SUMS = ("rollout_makespan_s", "response_tokens", "train_time_s", "sync_time_s",
              "migrations", "restarts", "reissued", "history_import_s", "history_export_s",
              "history_import_bytes", "history_export_bytes", "history_transfer_critical_s",
              "run_ahead_requests", "run_ahead_tokens", "run_ahead_abort_s")


def epoch_aggregate(steps: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One line of ``epochs.jsonl`` from an epoch's step lines: ``epoch``, ``steps``,
    ``prompts``, ``mean_reward`` (over every response of the epoch), ``tokens_per_s``
    (tokens / rollout seconds) and the sums of :data:`EPOCH_SUMS`."""
    responses = [m["num_prompts"] * m["group_size"] for m in steps]
    out: Dict[str, Any] = {
        "epoch": steps[0]["epoch"], "steps": len(steps),
        "first_step": steps[0]["step"], "last_step": steps[-1]["step"],
        "prompts": sum(m["num_prompts"] for m in steps),
        "mean_reward": sum(m["mean_reward"] * n for m, n in zip(steps, responses)) / sum(responses),
    }
    for key in EPOCH_SUMS:
        if all(key in m for m in steps):
            out[key] = sum(m[key] for m in steps)
    if out.get("rollout_makespan_s"):
        out["tokens_per_s"] = out["response_tokens"] / out["rollout_makespan_s"]
    return out
