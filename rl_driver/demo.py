"""``python -m rl_driver.demo`` (``make demo``): a real GRPO run on CPU with RHYME on.

SmolLM2-135M-Instruct on reasoning-gym ``chain_sum`` written as running sums
(``configs/demo.yaml``: a short one-shot prompt, a longer worked answer, so rollouts are
decode-dominated); prints each epoch's mean reward, rollout time, tokens/s and tau (response
lengths change as the policy learns, so epochs are not compared with each other as speedups),
then times one rollout of the final policy's prompts with vanilla SGLang and with RHYME on
the same engine settings (:mod:`rl_driver.side_by_side`) and prints that ratio. Writes
``runs/demo/report.md`` with plots, including where rollout time went; the side-by-side goes
to ``runs/demo/side_by_side.json`` and into the report's own section.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"


def _echo(metrics, first) -> None:
    parts = {}
    for b in metrics.get("breakdown", []):
        for kind, v in b["decode"].items():
            parts[kind] = parts.get(kind, 0) + v["steps"]
    steps = ", ".join(f"{k} {v}" for k, v in sorted(parts.items()))
    print(f"epoch {metrics['epoch']}: mean reward {metrics['mean_reward']:.3f} | rollout "
          f"{metrics['rollout_makespan_s']:.1f}s, {metrics['mean_response_len']:.0f} tokens per "
          f"response, {metrics['tokens_per_s']:.0f} tok/s, tau {metrics['tau']:.2f} "
          f"(decode steps: {steps}) | train {metrics['train_time_s']:.0f}s, sync "
          f"{metrics['sync_time_s']:.1f}s", flush=True)


def _side_by_side(config) -> None:
    from rl_driver.side_by_side import compare

    config = config.resolved()
    how = "both engines at once" if config.engine.num_engines >= 2 else "one after the other"
    print(f"final policy, one rollout of every prompt x group, vanilla vs RHYME on the same "
          f"engine settings ({how}):", flush=True)
    r = compare(config)
    _save_side_by_side(config, r)
    v, h = r["vanilla"], r["rhyme"]
    print(f"  vanilla SGLang {v['makespan_s']:.1f}s, {v['tokens_per_s']:.0f} tok/s | RHYME "
          f"{h['makespan_s']:.1f}s, {h['tokens_per_s']:.0f} tok/s, tau {h['tau']:.2f} | "
          f"RHYME vs vanilla: x{r['speedup_tokens_per_s']:.2f} tok/s "
          f"(x{r['speedup_makespan']:.2f} makespan; same tokens for "
          f"{100 * r['same_tokens']:.0f}% of requests: seeded draws)", flush=True)
    for name, label in (("vanilla", "vanilla"), ("rhyme", "RHYME")):
        print(f"    {label}: {_steps_text(r[name].get('breakdown'))}", flush=True)


def _save_side_by_side(config, result) -> None:
    """``result`` to ``run_dir/side_by_side.json``, then the report rewritten with it (when the
    run writes a report)."""
    from rl_driver.report import run_title, save_side_by_side, write_report

    save_side_by_side(config.run_dir, result)
    if config.loop.report:
        write_report(config.run_dir, title=run_title(config.name))


def _steps_text(breakdown) -> str:
    """A side-by-side engine's prefill and other seconds, then a line per decode step kind:
    count, seconds, and a step's mean batch, forward rows (tree nodes verified) and tokens
    emitted (the figures of :func:`rl_driver.report.decode_kinds`)."""
    from rl_driver.report import decode_kinds, other_seconds

    if not breakdown:
        return "no breakdown"
    lines = [f"prefill {breakdown['prefill']['seconds']:.1f}s, other "
             f"{other_seconds(breakdown):.1f}s, decode:"]
    for f in decode_kinds(breakdown):
        lines.append(f"      {f['kind']} {f['steps']} steps {f['seconds']:.1f}s "
                     f"({f['step_s']:.3f} s, batch {f['batch']:.1f}, {f['rows']:.1f} rows in, "
                     f"{f['tokens']:.1f} tokens out a step)")
    return "\n".join(lines)


def _stop_ray() -> None:
    """End the loop's local Ray instance before the side-by-side: SGLang's ``Engine.shutdown``
    kills every child process of this one, Ray's GCS and raylet included, and the Ray client
    left behind would then end this process when it cannot reach the GCS."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


def main(argv=None) -> int:
    from rl_driver.cli import set_process_env

    set_process_env()
    parser = argparse.ArgumentParser(
        prog="python -m rl_driver.demo", description="make demo: a GRPO run on CPU with RHYME "
        "(rhyme-rl train), then one rollout of the final policy, vanilla SGLang vs RHYME.")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), metavar="FILE",
                        help="YAML run config (default: configs/demo.yaml)")
    parser.add_argument("--epochs", type=int, metavar="E", help="override loop.epochs")
    args = parser.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from rl_driver.cli import train
    from rl_driver.config import load_config

    config = load_config(args.config, {"loop.epochs": args.epochs} if args.epochs else None)
    t0 = time.time()
    print(f"demo: {config.model}{' (warm-started)' if config.warm_start.enabled else ''}, {config.task.preset or config.task.dataset}, {config.task.num_prompts} prompts x "
          f"{config.rollout.group_size} samples, {config.loop.epochs} epochs, "
          f"{config.engine.num_engines} engine(s), RHYME {'on' if config.engine.rhyme else 'off'}",
          flush=True)
    train(config, progress=False, echo=_echo)
    _stop_ray()
    if config.loop.save_final and config.engine.rhyme:
        _side_by_side(config)
    print(f"demo finished in {time.time() - t0:.0f}s; report: {config.run_dir / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
