"""``rhyme-rl``: the command line (``train --config configs/NAME.yaml [--resume]``, ``report``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, Dict, List, Optional


def _parse_override(text: str) -> tuple:
    import yaml

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--set expects section.key=value, got {text!r}")
    return key, yaml.safe_load(value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rhyme-rl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run the GRPO loop")
    train.add_argument("--config", required=True, help="YAML config (see configs/)")
    train.add_argument("--resume", action="store_true", help="continue runs/<name> where it stopped")
    train.add_argument("--num-engines", type=int, help="override engine.num_engines")
    train.add_argument("--epochs", type=int, help="override loop.epochs")
    train.add_argument("--set", action="append", default=[], type=_parse_override,
                       metavar="SECTION.KEY=VALUE", help="override any config key (repeatable)")
    train.add_argument("--no-progress", action="store_true", help="no progress bars")
    report = sub.add_parser("report", help="(re)write runs/<name>/report.md from its metrics")
    report.add_argument("run_dir")
    return parser


def overrides_from(args) -> Dict[str, Any]:
    out: Dict[str, Any] = dict(args.set)
    if args.num_engines is not None:
        out["engine.num_engines"] = args.num_engines
    if args.epochs is not None:
        out["loop.epochs"] = args.epochs
    return out


class PhaseBars:
    """The CLI's progress sink: a tqdm bar per phase of an epoch (rollout requests with tok/s,
    train micro-batches, the weight sync)."""

    FORMAT = "{desc}: {n_fmt}/{total_fmt} {unit} |{bar:20}| [{elapsed}{postfix}]"

    def __init__(self, nested: bool):
        self.nested = nested  # under an epoch bar: bars on line 2, removed when done
        self._bar = None
        self._phase = ""

    def _show(self, phase: str, done: int, total: int, unit: str, postfix: str = "") -> None:
        from tqdm import tqdm

        if self._bar is None or self._phase != phase or self._bar.total != total:
            self.close()
            self._bar = tqdm(total=total, desc=f"  {phase}", unit=unit, leave=not self.nested,
                             position=1 if self.nested else None, mininterval=0.5,
                             bar_format=self.FORMAT)
            self._phase = phase
        self._bar.n = done
        if postfix:
            self._bar.set_postfix_str(postfix, refresh=False)
        self._bar.refresh()
        if done >= total:
            self.close()

    def rollout(self, done: int, total: int, tokens: int, elapsed_s: float) -> None:
        self._show("rollout", done, total, "req", f"{tokens / max(elapsed_s, 1e-9):.0f} tok/s")

    def train(self, done: int, total: int) -> None:
        self._show("train", done, total, "micro-batch")

    def sync(self, seconds) -> None:
        if seconds is None:
            self._show("sync", 0, 1, "step")
        else:
            self._show("sync", 1, 1, "step", f"{seconds:.1f}s")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def startup_line(config) -> str:
    """What a resolved config runs with, and why (printed at start by the CLIs)."""
    from rhyme_sglang.machine import describe_machine

    return f"{config.name}: {config.machine_summary()} ({describe_machine()})"


def train(config, resume: bool = False, progress: bool = True, echo=None,
          phases: bool = True) -> List[Dict[str, Any]]:
    """Run the loop with a tqdm bar over epochs (``progress``) and bars inside each epoch
    (``phases``); ``echo(metrics, first)`` prints a line per epoch. Prints the chosen dtype
    and threads first."""
    from tqdm import tqdm

    from rl_driver.loop import run
    from rl_driver.report import write_report

    config = config.resolved()
    print(startup_line(config), flush=True)
    bar = tqdm(total=config.loop.epochs, desc=config.name, unit="epoch", disable=not progress)
    sink = PhaseBars(nested=progress) if phases else None
    first: Dict[str, Any] = {}

    def on_epoch(metrics):
        first.setdefault("m", metrics)
        bar.update(1)
        bar.set_postfix(reward=f"{metrics['mean_reward']:.3f}", tau=f"{metrics['tau']:.2f}")
        if echo is not None:
            echo(metrics, first["m"])

    try:
        results = run(config, resume=resume, on_epoch=on_epoch, progress=sink)
    finally:
        if sink is not None:
            sink.close()
        bar.close()
    if config.loop.report:
        write_report(config.run_dir, title=f"rhyme-rl run '{config.name}'")
    return results


def main(argv: Optional[List[str]] = None) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from rl_driver.config import ConfigError, load_config

    if args.command == "report":
        from rl_driver.report import write_report

        print(write_report(args.run_dir))
        return 0
    try:
        config = load_config(args.config, overrides_from(args))
    except ConfigError as exc:
        print(f"rhyme-rl: bad config: {exc}", file=sys.stderr)
        return 2
    train(config, resume=args.resume, progress=not args.no_progress, phases=not args.no_progress)
    print(f"run written to {config.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
