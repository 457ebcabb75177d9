"""``EnginePool``: the driver's set of ``RolloutActor``s, with restart-from-snapshot on failure,
and :func:`forward_full_responses`, which gives a prompt's home engine the responses that
migration or a restart kept out of its history.

Snapshots travel over Ray: each engine saves its history on its own node and returns the bytes,
the driver keeps them in ``snapshot_dir`` and sends them back to a restarted engine, wherever
Ray placed it. No folder is shared between nodes."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional

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


class Forwarded(NamedTuple):
    added: int  # responses the home engines added
    bytes: int  # the histories' size as sent (pickled)


def forward_full_responses(actors: List[Any], jobs, rewards: Dict[str, float],
                           generation: List[int]) -> Forwarded:
    """Import :func:`responses_to_forward` into the home engines (``replace``: a partial
    record of the same sample is swapped for the full one)."""
    import pickle

    import ray

    states = responses_to_forward(jobs, rewards, generation)
    refs = [actors[home].rhyme_import_history.remote(state, replace=True)
            for (home, _), state in states.items()]
    added = 0
    for ref in refs:
        try:
            added += int(ray.get(ref))
        except Exception as exc:  # a dead engine: its restart reloads the last snapshot
            logger.warning("forwarding responses failed: %s", exc)
    return Forwarded(added, sum(len(pickle.dumps(s, protocol=5)) for s in states.values()))


class EnginePool:
    """Starts ``num_engines`` actors in parallel (in their ``placement`` bundles, when given:
    :class:`rl_driver.placement.Placement`); ``restart(i)`` replaces a dead one and restores
    its RHYME history from the last snapshot (``snapshot_all`` takes them)."""

    PLACE_TRIES = 3  # placements a restarted engine gets before its restart fails

    def __init__(self, engine_kwargs: Dict[str, Any], num_engines: int, rhyme: bool,
                 snapshot_dir: Optional[str] = None, num_cpus_per_engine: float = 0.0,
                 placement=None):
        self.engine_kwargs = dict(engine_kwargs)
        self.num_engines = num_engines
        self.rhyme = rhyme
        self.snapshot_dir = Path(snapshot_dir) if snapshot_dir else None
        self.num_cpus = num_cpus_per_engine
        self.placement = placement
        self.restarts = 0
        self.restarted: List[int] = []  # engine indices, in restart order
        self.snapshot_bytes = 0  # of the last snapshot_all, engines -> driver
        self.restored_bytes = 0  # snapshots sent to restarted engines, driver -> engines
        self.weight_version = 0
        self.actors: List[Any] = [self._spawn(i) for i in range(num_engines)]
        self.wait_ready()

    def _spawn(self, i: int, options: Optional[Dict[str, Any]] = None):
        from rl_driver.rollout import make_rollout_actor

        if options is None and self.placement is not None:
            options = self.placement.engine_options(i)
        return make_rollout_actor(self.engine_kwargs, rhyme=self.rhyme, name=f"engine{i}",
                                  num_cpus=self.num_cpus, options=options)

    def wait_ready(self, indices: Optional[List[int]] = None) -> None:
        import ray

        indices = list(range(self.num_engines)) if indices is None else indices
        ray.get([self.actors[i].ready.remote() for i in indices])

    def snapshot_path(self, i: int) -> Optional[str]:
        return str(self.snapshot_dir / f"engine{i}.rhyme") if self.snapshot_dir else None

    def snapshot_all(self) -> int:
        """Every engine's history snapshot, pulled to ``snapshot_dir`` (no-op without RHYME);
        returns how many were taken (their size: ``snapshot_bytes``)."""
        import ray

        self.snapshot_bytes = 0
        if not (self.rhyme and self.snapshot_dir):
            return 0
        self.snapshot_dir.mkdir(parents=True, exist_ok=True)
        snapshots = ray.get([a.rhyme_snapshot.remote() for a in self.actors])
        for i, data in enumerate(snapshots):
            path = Path(self.snapshot_path(i))
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
            self.snapshot_bytes += len(data)
        return len(snapshots)

    def restore(self, i: int) -> int:
        """Send engine ``i`` its last snapshot (if any); returns the bytes sent."""
        import ray

        path = self.snapshot_path(i)
        if not (self.rhyme and path and os.path.exists(path)):
            return 0
        data = Path(path).read_bytes()
        ray.get(self.actors[i].rhyme_restore.remote(data))
        logger.info("engine%d history restored from %s (%d bytes)", i, path, len(data))
        return len(data)

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
        self.restarted.append(i)
        for attempt in range(1, self.PLACE_TRIES + 1):
            options = self.placement.replacement_options(i) if self.placement is not None else None
            self.actors[i] = self._spawn(i, options)
            try:
                self.wait_ready([i])
                break
            except ray.exceptions.RayActorError as exc:
                # placed where the lost node's bundle still looked alive: Ray learns of a
                # node's death a few seconds after its actors stop answering
                if attempt == self.PLACE_TRIES:
                    raise
                logger.warning("engine%d died while starting (%s); placing it again", i,
                               type(exc).__name__)
        if weights_loader is not None:
            weights_loader(self.actors[i])
        self.restored_bytes += self.restore(i)

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
