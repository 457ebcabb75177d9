"""``Stack``: a run's Ray actors (the trainer, the engine pool), where they are placed, and the
weight sync between them: started together, restored together on resume, shut down together."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from rl_driver.config import RunConfig
from rl_driver.metrics import RunState

logger = logging.getLogger(__name__)


@dataclass
class Stack:
    trainer: Any  # a Ray actor handle of rl_driver.trainer.Trainer
    pool: Any  # rl_driver.pool.EnginePool
    sync: Any  # rl_driver.weight_sync.WeightSync
    run_dir: Path
    placement: Any = None  # rl_driver.placement.Placement
    startup_s: float = 0.0

    @property
    def checkpoint_path(self) -> str:
        return str(self.run_dir / "ckpt" / "trainer.pt")

    def restart(self, i: int, weight_version: int) -> None:
        """Replace engine ``i`` with a fresh one holding weights ``weight_version`` and its
        last history snapshot."""
        self.pool.restart(i, weights_loader=lambda actor: self.sync.sync(weight_version, [actor]))

    def resume(self, state: RunState) -> None:
        """The trainer's checkpoint, its weights on the engines, each engine's snapshot."""
        import ray

        ray.get(self.trainer.load_checkpoint.remote(self.checkpoint_path))
        self.sync.sync(state.weight_version)
        for i in range(self.pool.num_engines):
            self.pool.restore(i)

    def start_checkpoint(self, enabled: bool):
        """The trainer writes its checkpoint (returns the ref to wait on, or None)."""
        return self.trainer.save_checkpoint.remote(self.checkpoint_path) if enabled else None

    def engine_nodes(self) -> list:
        """Each engine's node id (where it runs now)."""
        from rl_driver.placement import where

        names = [f"engine{i}" for i in range(self.pool.num_engines)]
        return [n.get("node_id") for n in where(self.pool.actors, names)]

    def shutdown(self) -> None:
        import ray

        self.pool.shutdown()
        try:
            ray.kill(self.trainer)
        except Exception:  # already gone
            pass
        if self.placement is not None:
            self.placement.remove()


def start_stack(config: RunConfig, model_path: str, state: RunState, resume: bool) -> Stack:
    """Place and start the trainer and the engines (in parallel), the weight sync, and on
    ``resume`` restore the run's last finished epoch."""
    import ray

    from rl_driver.placement import Placement, log_placement, where
    from rl_driver.pool import EnginePool
    from rl_driver.trainer import Trainer
    from rl_driver.weight_sync import WeightSync

    t_start = time.time()
    run_dir = config.run_dir
    # without reservations the actors ask for no CPU: Ray must not refuse --num-engines N >
    # cores (the OS shares the CPUs)
    placement = Placement(config)
    trainer = ray.remote(Trainer).options(max_concurrency=2, **placement.trainer_options()).remote(
        model_path, config.train, config.seed)
    pool = EnginePool(config.engine.server_args(model_path), config.engine.num_engines,
                      rhyme=config.engine.rhyme, snapshot_dir=str(run_dir / "snapshots"),
                      placement=placement)
    ray.get(trainer.ready.remote())
    names = [f"engine{i}" for i in range(pool.num_engines)] + ["trainer"]
    log_placement(where(pool.actors + [trainer], names), placement)
    sync = WeightSync(trainer, pool, method=config.sync.method, bucket_mb=config.sync.bucket_mb,
                      engine_dtype=config.engine.dtype, backend=config.sync.backend,
                      master_address=config.sync.master_address,
                      disk_dir=config.sync.disk_dir or str(run_dir / "weights"))
    sync.check_disk_dir()
    stack = Stack(trainer, pool, sync, run_dir, placement)
    if resume and state.next_step > 0:
        stack.resume(state)
        logger.info("resumed %s at epoch %d, step %d (weights v%d)", config.name,
                    state.next_epoch, state.next_step, state.weight_version)
    stack.startup_s = time.time() - t_start
    return stack


def wait(ref: Optional[Any]) -> None:
    if ref is not None:
        import ray

        ray.get(ref)
