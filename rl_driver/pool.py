"""``EnginePool``: the driver's set of ``RolloutActor``s, with restart-from-snapshot on failure,
and :func:`forward_full_responses`, which gives a prompt's home engine the responses that
migration or a restart kept out of its history."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Dict, List, Optional

logger = logging.getLogger(__name__)


def responses_to_forward(jobs, rewards: Dict[str, float], generation: List[int]) -> Dict:
    """``{(home engine, prompt_id): importable history}`` of the full responses a prompt's home
    engine (where its group was assigned, and where the next epoch sends it) lacks: responses
    made of several segments (migrated, or re-issued after a restart: the aborted first part
    never joined a history, and the finishing engine kept only the last part) and responses
    finished by an engine restarted since. ``jobs``: ``dispatch.Job``s of one rollout."""
    from rhyme_sglang.core.transfer import response_state

    out: Dict[tuple, Dict[str, Any]] = {}
    for job in jobs:
        if len(job.engines) == 1 and job.final_generation == generation[job.engine]:
            continue  # one segment, and its engine still holds it
        one = response_state(job.prompt_id, job.prompt_ids, job.response_ids, job.sample,
                             rewards.get(job.key))
        held = out.setdefault((job.engines[0], job.prompt_id), one)
        if held is not one:
            held["records"] += one["records"]
    return out


def forward_full_responses(actors: List[Any], jobs, rewards: Dict[str, float],
                           generation: List[int]) -> int:
    """Import :func:`responses_to_forward` into the home engines (``replace``: a partial
    record of the same sample is swapped for the full one); returns how many were added."""
    import ray

    refs = [actors[home].rhyme_import_history.remote(state, replace=True)
            for (home, _), state in responses_to_forward(jobs, rewards, generation).items()]
    added = 0
    for ref in refs:
        try:
            added += int(ray.get(ref))
        except Exception as exc:  # a dead engine: its restart reloads the last snapshot
            logger.warning("forwarding responses failed: %s", exc)
    return added


class EnginePool:
    """Starts ``num_engines`` actors in parallel; ``restart(i)`` replaces a dead one and
    restores its RHYME history from the last snapshot (``snapshot_all`` writes them)."""

    def __init__(self, engine_kwargs: Dict[str, Any], num_engines: int, rhyme: bool,
                 snapshot_dir: Optional[str] = None, num_cpus_per_engine: float = 0.0):
        self.engine_kwargs = dict(engine_kwargs)
        self.num_engines = num_engines
        self.rhyme = rhyme
        self.snapshot_dir = Path(snapshot_dir) if snapshot_dir else None
        self.num_cpus = num_cpus_per_engine
        self.restarts = 0
        self.weight_version = 0
        self.actors: List[Any] = [self._spawn(i) for i in range(num_engines)]
        self.wait_ready()

    def _spawn(self, i: int):
        from rl_driver.rollout import make_rollout_actor

        return make_rollout_actor(self.engine_kwargs, rhyme=self.rhyme, name=f"engine{i}",
                                  num_cpus=self.num_cpus)

    def wait_ready(self, indices: Optional[List[int]] = None) -> None:
        import ray

        indices = list(range(self.num_engines)) if indices is None else indices
        ray.get([self.actors[i].ready.remote() for i in indices])

    def snapshot_path(self, i: int) -> Optional[str]:
        return str(self.snapshot_dir / f"engine{i}.rhyme") if self.snapshot_dir else None

    def snapshot_all(self) -> int:
        """``rhyme_save`` every engine's history (no-op without RHYME); returns how many saved."""
        import ray

        if not (self.rhyme and self.snapshot_dir):
            return 0
        self.snapshot_dir.mkdir(parents=True, exist_ok=True)
        return sum(ray.get([a.rhyme_save.remote(self.snapshot_path(i))
                            for i, a in enumerate(self.actors)]))

    def restart(self, i: int, weights_loader=None) -> None:
        """Replace engine ``i``: kill it if still alive, start a fresh one, reload the current
        weights (``weights_loader(actor)``) and its history snapshot."""
        import ray

        logger.warning("restarting engine%d", i)
        try:
            ray.kill(self.actors[i])
        except Exception:  # already gone
            pass
        self.restarts += 1
        self.actors[i] = self._spawn(i)
        self.wait_ready([i])
        if weights_loader is not None:
            weights_loader(self.actors[i])
        path = self.snapshot_path(i)
        if self.rhyme and path and os.path.exists(path):
            ray.get(self.actors[i].rhyme_load.remote(path))
            logger.info("engine%d history restored from %s", i, path)

    def call_all(self, method: str, *args, **kwargs) -> List[Any]:
        import ray

        return ray.get([getattr(a, method).remote(*args, **kwargs) for a in self.actors])

    def shutdown(self) -> None:
        import ray

        for a in self.actors:
            try:
                ray.get(a.shutdown.remote(), timeout=60)
            except Exception:
                pass
            try:
                ray.kill(a)
            except Exception:
                pass
