"""Weight sync trainer -> engine: after each route, the engine's greedy output equals the
trainer model's transformers greedy output (tiny model, fp32)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.sglang, pytest.mark.slow]

PROMPTS = [[1, 5, 6, 7, 8], [3, 4, 5], [10, 11, 12, 13, 14, 15]]
GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}


@pytest.fixture(scope="module")
def stack(ray_cluster, tiny_model_path):
    from rl_driver.config import TrainConfig
    from rl_driver.pool import EnginePool
    from tests.driver.helpers import ProbeTrainer

    pool = EnginePool({"model_path": tiny_model_path, "dtype": "float32", "log_level": "warning",
                       "max_total_tokens": 4096}, 1, rhyme=False)
    # fp32 like the engine (autocast "auto" would follow this machine: bf16 where it is native)
    trainer = ray_cluster.remote(ProbeTrainer).remote(
        tiny_model_path, TrainConfig(num_threads=1, autocast_bf16=False), 0)
    ray_cluster.get(trainer.ready.remote())
    yield ray_cluster, pool, trainer
    pool.shutdown()
    ray_cluster.kill(trainer)


def _engine_greedy(ray, actor):
    return [o["output_ids"] for o in ray.get(actor.generate.remote(PROMPTS, GREEDY))]


@pytest.mark.parametrize("method", ["tensor", "distributed", "disk"])
def test_sync_makes_engine_match_trainer(stack, method, tmp_path):
    from rl_driver.weight_sync import WeightSync

    ray, pool, trainer = stack
    before = _engine_greedy(ray, pool.actors[0])
    ray.get(trainer.perturb.remote(0.05, seed=len(method)))
    expected = ray.get(trainer.greedy.remote(PROMPTS, 16))
    assert expected != before  # the perturbation changes greedy output: the sync is observable
    sync = WeightSync(trainer, pool, method=method, bucket_mb=0.05, engine_dtype="float32",
                      disk_dir=str(tmp_path))
    version = ray.get(trainer.ready.remote())
    sync.sync(version)
    assert _engine_greedy(ray, pool.actors[0]) == expected
    assert ray.get(pool.actors[0].ready.remote())["weight_version"] == version


def test_grpo_step_then_sync(stack):
    """A real GRPO step moves the weights; the tensor sync carries the update exactly."""
    from rl_driver.weight_sync import WeightSync

    ray, pool, trainer = stack
    outs = ray.get(pool.actors[0].generate.remote(
        PROMPTS[:2] * 2, {"temperature": 1.0, "max_new_tokens": 8}))
    samples = [{"prompt_ids": p, "response_ids": o["output_ids"], "logprobs": o["logprobs"],
                "advantage": a} for p, o, a in zip(PROMPTS[:2] * 2, outs, [1.0, -1.0, -1.0, 1.0])]
    metrics = ray.get(trainer.train_step.remote(samples))
    assert metrics["optimizer_steps"] == 1 and metrics["grad_norm"] > 0
    assert metrics["logprob_abs_diff"] < 1e-3  # fp32 engine and trainer agree on logprobs
    WeightSync(trainer, pool, method="tensor", engine_dtype="float32").sync(metrics["version"])
    assert _engine_greedy(ray, pool.actors[0]) == ray.get(trainer.greedy.remote(PROMPTS, 16))


def test_tensor_sync_buckets_round_trip_without_copies():
    """The tensor route's buckets: numpy arrays in the object store, bf16 as its bits, read
    back as the same tensors (views of the stored arrays, no copy)."""
    import torch

    from rl_driver.weight_sync import from_bucket, to_bucket

    named = [("a", torch.randn(3, 4)), ("b", torch.randn(5).to(torch.bfloat16)),
             ("c", torch.arange(6, dtype=torch.int64).view(2, 3).t())]  # non-contiguous
    bucket = to_bucket(named)
    assert [d for _, _, d in bucket] == ["float32", "bfloat16", "int64"]
    back = from_bucket(bucket)
    for (name, want), (got_name, got) in zip(named, back):
        assert got_name == name and got.dtype == want.dtype and torch.equal(got, want)
    assert back[0][1].data_ptr() == bucket[0][1].ctypes.data  # a view, not a copy
