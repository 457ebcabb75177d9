"""One rollout over the engine pool: per-request dispatch, overrun migration, failure recovery.

Every response is a ``Job``. Jobs start on the engine their group was assigned to. While
generating, when an engine has gone idle and another still runs jobs that overran their
predicted length, those jobs are aborted on the busy engine (which returns the tokens and
logprobs generated so far) and continued on the idle one with ``prompt + prefix`` as input
and the remaining token budget: the concatenated response is a sample of the same policy
(lossless). If an actor dies, finished responses are already here; the pool restarts the
actor (weights + history snapshot) and its unfinished jobs are re-issued from the last
prefix the driver holds.

Run-ahead (``RunAhead``): an engine with no job left while others still run gets draft-only
requests for the next step's prompts (those planned on it first, then any other), each with a
seed no real sample gets. They are aborted the moment the step's last job finishes; their
outputs only feed the engine's history (as drafts) and are never returned.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from rl_driver.balance import utilisation
from rl_driver.tasks import sampling_seed

logger = logging.getLogger(__name__)


@dataclass
class Job:
    """One response in the making (mutable driver-side bookkeeping)."""

    prompt_id: str
    sample: int
    prompt_ids: List[int]
    predicted: float
    max_new_tokens: int
    engine: int = 0
    response_ids: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    finish_reason: str = ""
    attempts: int = 0
    migrations: int = 0
    reissues: int = 0
    spec_verify_ct: int = 0
    engines: List[int] = field(default_factory=list)
    migrate_to: Optional[int] = None
    final_generation: int = -1  # the engine actor generation that finished the job

    @property
    def key(self) -> str:
        return f"{self.prompt_id}/{self.sample}"

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.response_ids)


@dataclass(frozen=True)
class DispatchConfig:
    sampling_params: Dict[str, Any]
    migrate: bool = True
    overrun_factor: float = 1.5
    poll_interval_s: float = 0.25
    min_remaining_tokens: int = 8
    max_migrations: int = 2
    max_restarts: int = 3


@dataclass
class RolloutResult:
    jobs: List[Job]
    stats: Dict[str, Any]
    busy: Dict[int, List[Tuple[float, float]]]


def job_params(sampling_params: Dict[str, Any], prompt_id: str, sample: int, epoch: int = 0,
               **extra) -> Dict[str, Any]:
    """One request's sampling parameters. A ``sampling_seed`` among them is a base seed: each
    (prompt, sample, epoch) draws with its own seed derived from it (samples of a group must
    differ, and so must a prompt's visits: the loop passes the global step as ``epoch``),
    the same on every engine a migrated request continues
    on, so with seeds a migration does not change a token."""
    params = dict(sampling_params, **extra)
    if params.get("sampling_seed") is not None:
        params["sampling_seed"] = sampling_seed(params["sampling_seed"], epoch, prompt_id, sample)
    return params


def run_ahead_seed(base: int, step: int, prompt_id: str, sample: int) -> int:
    """A run-ahead request's seed: hashed from ``runahead/<step>``, where a real sample's seed
    hashes an integer epoch, so it is none of theirs."""
    return sampling_seed(base, f"runahead/{step}", prompt_id, sample)


@dataclass
class RunAhead:
    """Draft-only requests for the next step: ``preferred[e]``: next-step prompts planned on
    engine ``e``; ``prompt_ids``: their token ids (every candidate); ``samples`` requests per
    prompt; ``step``: the next step's global number; ``seed``: the base seed."""

    preferred: List[List[str]]
    prompt_ids: Dict[str, List[int]]
    samples: int
    step: int
    seed: int
    max_new_tokens: int
    claimed: Dict[str, int] = field(default_factory=dict)  # prompt -> engine that drafts it

    def take(self, engine: int) -> List[str]:
        """Unclaimed prompts for ``engine``: its own planned ones, else half (rounded up) of
        the others."""
        own = [p for p in self.preferred[engine] if p in self.prompt_ids and p not in self.claimed] \
            if engine < len(self.preferred) else []
        rest = [p for p in self.prompt_ids if p not in self.claimed]
        picked = own or rest[:(len(rest) + 1) // 2]
        for p in picked:
            self.claimed[p] = engine
        return picked


class Dispatcher:
    """Runs jobs on ``pool.actors``; ``restart(i)`` is called when actor ``i`` dies."""

    def __init__(self, pool, config: DispatchConfig, tag: str = "",
                 restart: Optional[Callable[[int], None]] = None,
                 after_submit: Optional[Callable[[], None]] = None,
                 on_progress: Optional[Callable[[int, int, int, float], None]] = None,
                 seed_epoch: int = 0):
        self.pool = pool
        self.seed_epoch = seed_epoch  # job_params' epoch: the loop's global step
        self.config = config
        self.tag = tag
        self.restart = restart or pool.restart
        self.after_submit = after_submit  # called once all jobs are in flight (tests, tracing)
        self.on_progress = on_progress  # (finished, total, tokens, elapsed_s) as jobs finish
        self._pending: Dict[Any, Tuple[Job, int]] = {}  # ref -> (job, actor generation)
        self.generation = [0] * pool.num_engines  # bumped when an engine is restarted
        self._busy: Dict[int, List[Tuple[float, float]]] = {}
        self._restarts = 0
        self._migrations = 0
        self._ahead: Dict[Any, Tuple[int, str]] = {}  # run-ahead ref -> (engine, rid)
        self.run_ahead_stats: Dict[str, Any] = {}

    def _submit(self, job: Job, engine: int) -> None:
        job.engine = engine
        job.attempts += 1
        job.engines.append(engine)
        params = job_params(self.config.sampling_params, job.prompt_id, job.sample,
                            self.seed_epoch, max_new_tokens=job.remaining)
        request = {"rid": f"{self.tag}{job.key}#{job.attempts}", "prompt_id": job.prompt_id,
                   "sample": job.sample, "input_ids": job.prompt_ids + job.response_ids,
                   "sampling_params": params}
        ref = self.pool.actors[engine].generate_one.remote(request)
        self._pending[ref] = (job, self.generation[engine])

    def _on_result(self, job: Job, res: Dict[str, Any], generation: int) -> bool:
        """Fold one segment into the job; True when the job is finished."""
        job.final_generation = generation
        self._busy.setdefault(job.engine, []).append((res["start_s"], res["end_s"]))
        job.response_ids += res["output_ids"]
        job.logprobs += res["logprobs"]
        job.spec_verify_ct += res["spec_verify_ct"]
        if res["finish_reason"] != "abort":
            job.finish_reason = "length" if res["finish_reason"] == "length" else "stop"
            return True
        if job.remaining <= 0:
            job.finish_reason = "length"
            return True
        target, job.migrate_to = job.migrate_to, None
        if target is not None:
            job.migrations += 1
            self._migrations += 1
        self._submit(job, job.engine if target is None else target)
        return False

    def _on_failure(self, job: Job, generation: int, exc: Exception) -> None:
        e = job.engine
        if generation == self.generation[e]:  # first news of this death: restart once
            self._restarts += 1
            if self._restarts > self.config.max_restarts:
                raise RuntimeError(f"engine{e} died and the restart budget "
                                   f"({self.config.max_restarts}) is spent") from exc
            logger.warning("engine%d died (%s); restarting it", e, type(exc).__name__)
            self.generation[e] += 1
            self.restart(e)
        job.reissues += 1
        job.migrate_to = None
        job.engines.append(-1)  # marks the lost attempt
        self._submit(job, e)

    def _maybe_migrate(self) -> None:
        n = self.pool.num_engines
        load = [0] * n
        for job, _ in self._pending.values():
            load[job.engine] += 1
        idle = [e for e in range(n) if load[e] == 0]
        if not idle or max(load) <= 1:
            return
        import ray

        busy = max(range(n), key=lambda e: load[e])
        try:
            progress = ray.get(self.pool.actors[busy].progress.remote(), timeout=10)
        except Exception:  # a dying actor: the failure path handles it
            return
        candidates = []
        for job, _ in self._pending.values():
            if job.engine != busy or job.migrate_to is not None:
                continue
            rid = f"{self.tag}{job.key}#{job.attempts}"
            done = len(job.response_ids) + progress.get(rid, 0)
            left = job.max_new_tokens - done
            if (rid in progress and job.migrations < self.config.max_migrations
                    and done > self.config.overrun_factor * job.predicted
                    and left >= self.config.min_remaining_tokens):
                candidates.append((done - job.predicted, rid, job))
        if not candidates:
            return
        candidates.sort(key=lambda c: -c[0])
        take = candidates[:max(1, math.ceil(load[busy] * len(idle) / (len(idle) + 1)))]
        for k, (_, _, job) in enumerate(take):
            job.migrate_to = idle[k % len(idle)]
        self.pool.actors[busy].abort.remote([rid for _, rid, _ in take])
        logger.info("migrating %d overrun requests from engine%d to %s", len(take), busy, idle)

    def _run_ahead(self, ahead: RunAhead) -> None:
        """Draft-only requests on each engine with no job left (while jobs remain)."""
        if not self._pending:
            return
        n = self.pool.num_engines
        load = [0] * n
        for job, _ in self._pending.values():
            load[job.engine] += 1
        for engine, _ in self._ahead.values():
            load[engine] += 1
        for e in (e for e in range(n) if load[e] == 0):
            for pid in ahead.take(e):
                for k in range(ahead.samples):
                    params = dict(self.config.sampling_params, max_new_tokens=ahead.max_new_tokens,
                                  sampling_seed=run_ahead_seed(ahead.seed, ahead.step, pid, k))
                    rid = f"{self.tag}runahead/{pid}/{k}"
                    ref = self.pool.actors[e].generate_one.remote(
                        {"rid": rid, "prompt_id": pid, "sample": k, "run_ahead": True,
                         "input_ids": list(ahead.prompt_ids[pid]), "sampling_params": params})
                    self._ahead[ref] = (e, rid)

    def _stop_run_ahead(self, last_finish: float, drain_s: float = 30.0) -> None:
        """Abort the run-ahead requests still running and collect what they made (their
        outputs are dropped here: only the engines' history keeps them)."""
        import ray

        stats = self.run_ahead_stats
        per_engine: Dict[int, List[str]] = {}
        for engine, rid in self._ahead.values():
            per_engine.setdefault(engine, []).append(rid)
        for e, rids in per_engine.items():
            self.pool.actors[e].abort.remote(rids)
        stats["run_ahead_abort_s"] = time.time() - last_finish if per_engine else 0.0
        stats["run_ahead_aborted"] = sum(len(r) for r in per_engine.values())
        t0 = time.time()
        refs = list(self._ahead)
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=drain_s) if refs else ([], [])
        for ref in refs:
            self._ahead.pop(ref)
            if ref not in done:
                continue
            try:
                stats["run_ahead_tokens"] += len(ray.get(ref)["output_ids"])
            except Exception:  # a dead engine: nothing to count
                pass
        stats["run_ahead_drain_s"] = time.time() - t0

    def _on_ahead(self, ref) -> None:
        import ray

        self._ahead.pop(ref)
        try:
            self.run_ahead_stats["run_ahead_tokens"] += len(ray.get(ref)["output_ids"])
        except Exception:  # a dead engine: its real jobs' failure path restarts it
            pass

    def run(self, assignment: List[List[Job]], run_ahead: Optional[RunAhead] = None) -> RolloutResult:
        import ray
        from ray.exceptions import RayActorError

        jobs = [j for eng in assignment for j in eng]
        start = time.time()
        for e, eng_jobs in enumerate(assignment):
            for job in eng_jobs:
                self._submit(job, e)
        if self.after_submit is not None:
            self.after_submit()
        finished = 0
        self.run_ahead_stats = {"run_ahead_requests": 0, "run_ahead_tokens": 0,
                                "run_ahead_prompts": 0, "run_ahead_abort_s": 0.0,
                                "run_ahead_aborted": 0, "run_ahead_drain_s": 0.0}
        if self.on_progress is not None:
            self.on_progress(0, len(jobs), 0, 0.0)
        last_finish = start
        while self._pending:
            if run_ahead is not None:
                self._run_ahead(run_ahead)
            waiting = list(self._pending) + list(self._ahead)
            done, _ = ray.wait(waiting, num_returns=len(waiting),
                               timeout=self.config.poll_interval_s)
            for ref in done:
                if ref in self._ahead:
                    self._on_ahead(ref)
                    continue
                last_finish = time.time()
                job, generation = self._pending.pop(ref)
                try:
                    res = ray.get(ref)
                except RayActorError as exc:
                    self._on_failure(job, generation, exc)
                    continue
                finished += self._on_result(job, res, generation)
            if done and self.on_progress is not None:
                self.on_progress(finished, len(jobs), sum(len(j.response_ids) for j in jobs),
                                 time.time() - start)
            if self.config.migrate and self._pending:
                self._maybe_migrate()
        end = time.time()
        if run_ahead is not None:
            self.run_ahead_stats["run_ahead_prompts"] = len(run_ahead.claimed)
            self.run_ahead_stats["run_ahead_requests"] = len(run_ahead.claimed) * run_ahead.samples
            self.run_ahead_stats["claimed"] = dict(run_ahead.claimed)  # prompt -> engine
            self._stop_run_ahead(last_finish)
        stats = utilisation(self._busy, self.pool.num_engines, start, end)
        tokens = sum(len(j.response_ids) for j in jobs)
        verify = sum(j.spec_verify_ct for j in jobs)
        stats.update({
            "response_tokens": tokens, "tokens_per_s": tokens / stats["makespan_s"],
            "tau": tokens / verify if verify else 1.0, "migrations": self._migrations,
            "restarts": self._restarts, "reissued": sum(j.reissues for j in jobs),
            "start_s": start,
        })
        return RolloutResult(jobs=jobs, stats=stats, busy=self._busy)
