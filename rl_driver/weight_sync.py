"""Trainer -> engines weight sync: tensors (bucketed), a process group broadcast, or disk.

Every route runs inside the engines' ``begin_weight_update``/``end_weight_update`` bracket,
stamps the engines with the trainer's weight version and flushes their prefix caches.

- ``tensor``: the trainer's parameters (cast to the engine dtype) are cut into buckets of
  ``bucket_mb``; the trainer puts each bucket in Ray's object store once, as numpy arrays
  (:func:`to_bucket`), so every engine reads it without a copy, and the engines load it with
  ``update_weights_from_tensor`` (:func:`from_bucket`). The driver handles only the refs.
- ``distributed``: trainer rank 0 and engines ranks 1..N join a ``gloo`` (CPU) or ``nccl``
  (GPU) group once (``init_weights_update_group``); each sync broadcasts every parameter and
  the engines load them with ``update_weights_from_distributed``.
- ``disk``: ``save_pretrained`` to a folder, then ``update_weights_from_disk``. On a cluster
  the folder must be one every node mounts: :meth:`WeightSync.check_disk_dir` verifies at start
  that every engine sees a file the trainer wrote there.

The ``distributed`` group's master address is the trainer node's IP and a free port there, asked
of the trainer when the group forms (``master_address: auto``), or a configured host.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from datetime import timedelta
from typing import Any, List, Optional, Tuple

logger = logging.getLogger(__name__)

GROUP_NAME = "rhyme_sync"


def new_process_group(backend: str, master_address: str, master_port: int, world_size: int,
                      rank: int, group_name: str, timeout_s: float = 300.0):
    """A process group that leaves the default group alone (the layout sglang's
    ``init_weights_update_group`` uses on the engine side: a TCP rendezvous, a store
    prefixed with the group name, and a group registered under that name)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(c10d.rendezvous(f"tcp://{master_address}:{master_port}",
                                                   rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = dist.PrefixStore(group_name, store)
    group, _ = c10d._new_process_group_helper(world_size, rank, [], dist.Backend(backend), store,
                                              group_name=group_name, backend_options=None,
                                              timeout=timeout)
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` ("" = every interface) of the calling process's node."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def to_bucket(named_tensors) -> List[Tuple[str, Any, str]]:
    """``[(name, array, dtype)]`` for Ray's object store: numpy arrays are stored and read
    without a copy (a pickled torch tensor is copied on both sides). bf16, which numpy lacks,
    travels as its int16 bits."""
    import torch

    out = []
    for name, t in named_tensors:
        t = t.detach().cpu().contiguous()
        bits = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
        out.append((name, bits.numpy(), str(t.dtype).replace("torch.", "")))
    return out


def from_bucket(bucket) -> List[Tuple[str, Any]]:
    """The ``[(name, tensor)]`` of a :func:`to_bucket` bucket, viewing the (read-only)
    arrays in place: the engine copies them into its own memory when it loads them."""
    import warnings

    import torch

    out = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        for name, array, dtype in bucket:
            t = torch.from_numpy(array)
            out.append((name, t.view(torch.bfloat16) if dtype == "bfloat16" else t))
    return out


def default_backend() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


class WeightSync:
    """Pushes the trainer's weights to the pool's engines by ``method``."""

    def __init__(self, trainer, pool, method: str = "tensor", bucket_mb: float = 64.0,
                 engine_dtype: Optional[str] = None, backend: str = "auto",
                 master_address: str = "auto", disk_dir: Optional[str] = None):
        if method not in ("tensor", "distributed", "disk"):
            raise ValueError(f"weight sync method must be tensor, distributed or disk, got {method!r}")
        if method == "disk" and not disk_dir:
            raise ValueError("weight sync by disk needs disk_dir")
        self.trainer = trainer
        self.pool = pool
        self.method = method
        self.bucket_mb = bucket_mb
        self.engine_dtype = engine_dtype
        self.backend = default_backend() if backend == "auto" else backend
        self.master_address = master_address
        self.disk_dir = disk_dir
        self._group_actors: Optional[List[Any]] = None
        self._group_name = GROUP_NAME
        self._groups_formed = 0

    def check_disk_dir(self) -> None:
        """``disk``: every engine must see a file the trainer writes in ``disk_dir`` (a folder
        every node mounts); raises ``RuntimeError`` naming the engines that do not."""
        import ray

        if self.method != "disk":
            return
        marker = os.path.join(self.disk_dir, f".shared-check-{os.getpid()}-{time.time_ns()}")
        ray.get(self.trainer.write_marker.remote(marker))
        seen = ray.get([a.path_exists.remote(marker) for a in self.pool.actors])
        missing = [f"engine{i}" for i, ok in enumerate(seen) if not ok]
        if missing:
            raise RuntimeError(f"sync.method disk: {', '.join(missing)} cannot see "
                               f"{self.disk_dir!r}, written by the trainer: set sync.disk_dir "
                               "to a folder every node mounts, or use sync.method tensor")
        logger.info("sync.disk_dir %s is seen by the trainer and every engine", self.disk_dir)

    def sync(self, version: int, actors: Optional[List[Any]] = None) -> float:
        """Push weights to ``actors`` (default: all engines); returns seconds taken."""
        import ray

        actors = list(self.pool.actors if actors is None else actors)
        t0 = time.time()
        method = self.method
        if method == "distributed" and actors != list(self.pool.actors):
            method = "tensor"  # a restarted engine is outside the group: catch it up by tensors
        ray.get([a.begin_weight_update.remote() for a in actors])
        try:
            getattr(self, f"_by_{method}")(actors, version)
        finally:
            ray.get([a.end_weight_update.remote(version) for a in actors])
        ray.get([a.reset_prefix_cache.remote() for a in actors])
        seconds = time.time() - t0
        logger.info("weights v%d -> %d engine(s) by %s in %.2fs", version, len(actors), method, seconds)
        return seconds

    def _by_tensor(self, actors, version: int) -> None:
        import ray

        refs = ray.get(self.trainer.put_weight_buckets.remote(self.bucket_mb, self.engine_dtype))
        for ref in refs:  # one bucket at a time: an engine holds at most one extra bucket
            ray.get([a.update_weights_from_bucket.remote(ref) for a in actors])

    def _by_disk(self, actors, version: int) -> None:
        import ray

        path = os.path.join(self.disk_dir, f"weights_v{version}")
        ray.get(self.trainer.save_pretrained.remote(path, self.engine_dtype))
        ray.get([a.update_weights_from_disk.remote(path, version) for a in actors])

    def _ensure_group(self, actors) -> None:
        import ray

        if self._group_actors == actors:
            return
        # a new name each time the membership changes (after an engine restart): the
        # surviving engines still hold the old group under the old name
        self._groups_formed += 1
        self._group_name = f"{GROUP_NAME}_{self._groups_formed}"
        host, port = ray.get(self.trainer.rendezvous.remote())
        if self.master_address != "auto":
            host = self.master_address
        world = 1 + len(actors)
        refs = [a.init_process_group.remote(host, port, 1 + i, world, self._group_name,
                                            self.backend)
                for i, a in enumerate(actors)]
        refs.append(self.trainer.init_process_group.remote(host, port, world, self._group_name,
                                                           self.backend))
        ray.get(refs)
        self._group_actors = list(actors)

    def _by_distributed(self, actors, version: int) -> None:
        import ray

        self._ensure_group(actors)
        meta = ray.get(self.trainer.weight_meta.remote(self.engine_dtype))
        names, dtypes, shapes = [m[0] for m in meta], [m[1] for m in meta], [m[2] for m in meta]
        refs = [a.update_weights_from_distributed.remote(names, dtypes, shapes, self._group_name)
                for a in actors]
        refs.append(self.trainer.broadcast_weights.remote(self.engine_dtype))
        ray.get(refs)
