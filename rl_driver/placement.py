"""``Placement``: where a run's actors go on a Ray cluster.

One placement group holds a bundle per engine (``{"CPU": engine.num_cpus, "GPU":
engine.num_gpus}`` plus ``cluster.engine_resources``) and one for the trainer (``train.num_cpus``
/ ``train.num_gpus`` plus ``cluster.trainer_resources``), placed by ``cluster.strategy``. Each
actor asks for exactly its bundle, so Ray gives a GPU actor its devices (``CUDA_VISIBLE_DEVICES``)
and nothing here sets them. When nothing is reserved anywhere there is no group and the actors
ask for no resources (they share one machine's cores, the OS schedules them).

A restarted engine goes back into its bundle when Ray has (re)placed the bundle on a live node
within ``cluster.replace_wait_s``; otherwise (its node is gone and no live node fits the bundle,
say a bundle pinned by a custom resource) it starts outside the group with the bundle's CPUs and
GPUs, wherever Ray finds them.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional

from rl_driver.config import RunConfig

logger = logging.getLogger(__name__)

# Ray refuses a bundle with no resources: one that asks for nothing reserves this much CPU
EMPTY_BUNDLE = {"CPU": 0.001}


def bundle(cpus: float, gpus: float, custom: Dict[str, float]) -> Dict[str, float]:
    """A bundle's resources: CPU, GPU and custom, zeros left out."""
    out = {"CPU": float(cpus), "GPU": float(gpus), **{k: float(v) for k, v in custom.items()}}
    return {k: v for k, v in out.items() if v > 0}


def actor_options(resources: Dict[str, float]) -> Dict[str, Any]:
    """Ray actor options asking for exactly ``resources``."""
    return {"num_cpus": resources.get("CPU", 0.0), "num_gpus": resources.get("GPU", 0.0),
            "resources": {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}}


class Placement:
    """The run's placement group (or none); Ray actor options for each engine and the trainer."""

    def __init__(self, config: RunConfig, ready_timeout_s: float = 600.0):
        n = config.engine.num_engines
        self.bundles: List[Dict[str, float]] = [
            bundle(config.engine.num_cpus, config.engine.num_gpus,
                   config.cluster.engine_resources_of(i)) for i in range(n)]
        self.bundles.append(bundle(config.train.num_cpus, config.train.num_gpus,
                                   config.cluster.trainer_resources))
        self.strategy = config.cluster.strategy
        self.replace_wait_s = config.cluster.replace_wait_s
        self.group = None
        if any(self.bundles):
            self.bundles = [b or dict(EMPTY_BUNDLE) for b in self.bundles]
            self.group = self._create(ready_timeout_s)

    def _create(self, timeout_s: float):
        import ray
        from ray.util.placement_group import placement_group

        group = placement_group(self.bundles, strategy=self.strategy, name="")
        try:
            ray.get(group.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"the cluster cannot place {self.bundles} with strategy {self.strategy} "
                f"within {timeout_s:.0f}s (free: {ray.available_resources()})") from None
        return group

    @property
    def trainer_index(self) -> int:
        return len(self.bundles) - 1

    def _in_bundle(self, index: int) -> Dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return dict(actor_options(self.bundles[index]),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self.group, placement_group_bundle_index=index))

    def engine_options(self, i: int) -> Dict[str, Any]:
        return self._in_bundle(i) if self.group is not None else {"num_cpus": 0}

    def trainer_options(self) -> Dict[str, Any]:
        return self._in_bundle(self.trainer_index) if self.group is not None else {"num_cpus": 0}

    def replacement_options(self, i: int) -> Dict[str, Any]:
        """Options for a restarted engine ``i``: its bundle when the group is placed on live
        nodes (Ray re-places a lost node's bundles where they fit), else the bundle's CPUs and
        GPUs outside the group."""
        if self.group is None or self._group_placed(self.replace_wait_s):
            return self.engine_options(i)
        options = actor_options(self.bundles[i])
        options["resources"] = {}
        logger.warning("engine%d's bundle %s is not placed (its node is gone): restarting it "
                       "outside the placement group", i, self.bundles[i])
        return options

    def _group_placed(self, wait_s: float) -> bool:
        from ray.util import placement_group_table

        deadline = time.time() + wait_s
        while True:
            if placement_group_table(self.group).get("state") == "CREATED":
                return True
            if time.time() >= deadline:
                return False
            time.sleep(0.5)

    def remove(self) -> None:
        if self.group is not None:
            from ray.util import remove_placement_group

            try:
                remove_placement_group(self.group)
            except Exception:  # the cluster is going away
                pass


def where(actors: List[Any], names: List[str]) -> List[Dict[str, Any]]:
    """Each actor's ``node()`` (node id, IP, pid, GPUs), by name; ``{"name", "error"}`` for an
    actor that cannot answer."""
    import ray

    out = []
    for name, actor in zip(names, actors):
        try:
            out.append(dict(ray.get(actor.node.remote(), timeout=60), name=name))
        except Exception as exc:
            out.append({"name": name, "error": type(exc).__name__})
    return out


def log_placement(nodes: List[Dict[str, Any]], placement: Optional[Placement]) -> None:
    """One line per actor: its node, IP and resources (GPU ids as Ray assigned them)."""
    for k, info in enumerate(nodes):
        res = placement.bundles[k] if placement and placement.group is not None else "shared"
        logger.info("%s on node %s (%s, pid %s), resources %s, CUDA_VISIBLE_DEVICES=%s",
                    info["name"], str(info.get("node_id", "?"))[:12], info.get("ip"),
                    info.get("pid"), res, info.get("cuda_visible_devices"))


def node_info() -> Dict[str, Any]:
    """What ``node()`` of an actor answers: where this process runs (call inside an actor)."""
    import os

    import ray

    ctx = ray.get_runtime_context()
    return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
