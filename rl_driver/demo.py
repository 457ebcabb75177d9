"""``python -m rl_driver.demo`` (``make demo``): a real GRPO run on CPU with RHYME on.

SmolLM2-135M-Instruct on reasoning-gym ``chain_sum`` (``configs/demo.yaml``); prints each
epoch's mean reward and the rollout speedup vs epoch 0 (response tokens per second of
rollout makespan), and writes ``runs/demo/report.md`` with plots.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"


def _echo(metrics, first) -> None:
    speedup = metrics["tokens_per_s"] / first["tokens_per_s"] if first["tokens_per_s"] else 0.0
    time_ratio = first["rollout_makespan_s"] / metrics["rollout_makespan_s"]
    print(f"epoch {metrics['epoch']}: mean reward {metrics['mean_reward']:.3f} | rollout "
          f"{metrics['rollout_makespan_s']:.1f}s, {metrics['tokens_per_s']:.0f} tok/s, tau "
          f"{metrics['tau']:.2f} | speedup vs epoch 0: {speedup:.2f}x tok/s "
          f"({time_ratio:.2f}x wall) | train {metrics['train_time_s']:.0f}s, sync "
          f"{metrics['sync_time_s']:.1f}s", flush=True)


def main(argv=None) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = argparse.ArgumentParser(prog="python -m rl_driver.demo")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--epochs", type=int)
    args = parser.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from rl_driver.cli import train
    from rl_driver.config import load_config

    config = load_config(args.config, {"loop.epochs": args.epochs} if args.epochs else None)
    t0 = time.time()
    print(f"demo: {config.model}, {config.task.dataset}, {config.task.num_prompts} prompts x "
          f"{config.rollout.group_size} samples, {config.loop.epochs} epochs, "
          f"{config.engine.num_engines} engine(s), RHYME {'on' if config.engine.rhyme else 'off'}",
          flush=True)
    train(config, progress=False, echo=_echo)
    print(f"demo finished in {time.time() - t0:.0f}s; report: {config.run_dir / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
