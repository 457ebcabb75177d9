"""``rhyme-rl``: the command line (``train``, ``warm-start``, ``config``, ``report``);
``rhyme-rl --help``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, Dict, List, Optional


def set_process_env(joining: bool = False) -> None:
    """A run's environment defaults, set before anything imports torch, sglang or Ray: one
    OpenMP thread a process, SGLang's CPU engine, no tokenizer threads, and for a new local
    Ray instance Ray's token authentication on (``RAY_AUTH_MODE=token``, what Ray picks for a
    new local cluster, chosen here so that Ray does not warn it picked it; Ray reads the
    variable when imported). ``joining`` an existing cluster (``--address``, ``RAY_ADDRESS``)
    leaves ``RAY_AUTH_MODE`` to the cluster's own setting."""
    from rhyme_sglang.settings import prepare_cpu_env

    prepare_cpu_env()
    if not (joining or os.environ.get("RAY_ADDRESS")):
        os.environ.setdefault("RAY_AUTH_MODE", "token")


def _parse_override(text: str) -> tuple:
    import yaml

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--set expects section.key=value, got {text!r}")
    return key, yaml.safe_load(value)


CONFIG_REFERENCE = """config reference:
  configs/demo.yaml        an annotated example (the make demo run)
  rhyme-rl config          every section and key with its default (or a config's values)
  rl_driver/config.py      each key's meaning and allowed values (a dataclass per section);
                           an unknown key or a bad value fails naming the key and the choices"""


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="rhyme-rl", formatter_class=raw,
        description="GRPO training whose rollouts run on RHYME engines under Ray, and its reports.",
        epilog="examples:\n  rhyme-rl train --config configs/demo.yaml\n"
        "  rhyme-rl train --config configs/demo.yaml --epochs 2 --set train.lr=1e-5\n"
        "  rhyme-rl config --config configs/demo.yaml\n  rhyme-rl report runs/demo\n\n"
        "rhyme-rl COMMAND --help shows a command's options.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = sub.add_parser(
        "train", help="run the GRPO loop", formatter_class=raw,
        description="Run the GRPO loop: generate -> score -> rewards to history -> train ->\n"
        "sync weights, once per step (rollout.prompts_per_step prompts; 0 = all, one step per\n"
        "epoch); writes runs/<name>/ (metrics, trace, report).",
        epilog="examples:\n  rhyme-rl train --config configs/demo.yaml\n"
        "  rhyme-rl train --config configs/demo.yaml --num-engines 1 --set rollout.group_size=8\n"
        "  rhyme-rl train --config configs/demo.yaml --resume\n"
        "  rhyme-rl train --config configs/demo.yaml --address auto\n"
        "  ray job submit --working-dir . -- python -m rl_driver.cli train --config "
        "configs/demo.yaml\n\n" + CONFIG_REFERENCE)
    train.add_argument("--config", required=True, metavar="FILE", help="YAML run config")
    train.add_argument("--resume", action="store_true", help="continue runs/<name> where it stopped")
    train.add_argument("--num-engines", type=int, metavar="N", help="override engine.num_engines")
    train.add_argument("--epochs", type=int, metavar="E", help="override loop.epochs")
    train.add_argument("--address", metavar="ADDR",
                       help="join this Ray cluster: auto, ray://HEAD:10001 or HEAD:6379 "
                       "(cluster.address; default RAY_ADDRESS, else a local instance; "
                       "docs/ray-cluster.md)")
    _add_set(train)
    train.add_argument("--no-progress", action="store_true",
                       help="no progress bars (or progress lines, off a terminal)")
    warm = sub.add_parser(
        "warm-start", help="build (or reuse) the SFT warm start a run starts from",
        formatter_class=raw,
        description="Build the warm-started policy of a config's warm_start section (an SFT\n"
        "on the task's worked solutions, rl_driver/warm_start.py), or find it in the models\n"
        "cache; prints its folder. Runs whether or not warm_start.enabled is set.",
        epilog="examples:\n  rhyme-rl warm-start --config configs/demo.yaml\n"
        "  rhyme-rl warm-start --task long_addition --set warm_start.examples=300\n"
        "  rhyme-rl warm-start --config configs/demo.yaml --force --export\n\n" + CONFIG_REFERENCE)
    warm.add_argument("--config", metavar="FILE", help="YAML run config (default: none)")
    warm.add_argument("--task", metavar="NAME", help="override warm_start.task")
    warm.add_argument("--force", action="store_true",
                      help="train even if the folder is cached or an adapter is shipped")
    warm.add_argument("--export", action="store_true",
                      help="copy the adapter to rl_driver/adapters/ (set-up merges it there)")
    warm.add_argument("--no-eval", action="store_true", help="skip the held-out evaluation")
    _add_set(warm)
    config = sub.add_parser(
        "config", help="print a run config with every key, defaults filled in",
        formatter_class=raw, description="Print a run config as YAML with every section and "
        "key: the defaults,\nor FILE's values over them.",
        epilog="examples:\n  rhyme-rl config\n  rhyme-rl config --config configs/demo.yaml "
        "--set loop.epochs=2\n\n" + CONFIG_REFERENCE)
    config.add_argument("--config", metavar="FILE", help="YAML run config (default: none)")
    _add_set(config)
    report = sub.add_parser(
        "report", help="(re)write runs/<name>/report.md from its metrics", formatter_class=raw,
        description="(Re)write RUN_DIR/report.md and its plots from RUN_DIR/metrics.jsonl.",
        epilog="example:\n  rhyme-rl report runs/demo\n")
    report.add_argument("run_dir", metavar="RUN_DIR")
    return parser


def _add_set(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", action="append", default=[], type=_parse_override,
                        metavar="SECTION.KEY=VALUE", help="override a config key (repeatable)")


def overrides_from(args) -> Dict[str, Any]:
    out: Dict[str, Any] = dict(args.set)
    if getattr(args, "num_engines", None) is not None:
        out["engine.num_engines"] = args.num_engines
    if getattr(args, "epochs", None) is not None:
        out["loop.epochs"] = args.epochs
    if getattr(args, "address", None) is not None:
        out["cluster.address"] = args.address
    if getattr(args, "task", None) is not None:
        out["warm_start.task"] = args.task
    return out


def startup_line(config) -> str:
    """What a resolved config runs with, and why (printed at start by the CLIs), wrapped at
    100 columns."""
    import textwrap

    from rhyme_sglang.dtypes import describe_machine

    return textwrap.fill(f"{config.name}: {config.machine_summary()} ({describe_machine()})",
                         width=100, subsequent_indent="  ")


def train(config, resume: bool = False, progress: bool = True, echo=None,
          phases: bool = True) -> List[Dict[str, Any]]:
    """Run the loop with a bar over epochs, or steps with ``rollout.prompts_per_step``
    (``progress``), and bars inside each step (``phases``): tqdm bars on a terminal, plain
    lines on stderr anywhere else (a line per step with ``progress``;
    :mod:`rl_driver.progress_view`). ``echo(metrics, first)`` prints a line per step. Prints
    the chosen dtype and threads first."""
    from tqdm import tqdm

    from rl_driver.loop import run
    from rl_driver.progress_view import progress_sink
    from rl_driver.report import run_title, write_report

    config = config.resolved()
    print(startup_line(config), flush=True)
    tty = sys.stderr.isatty()
    per_step, prompts = config.rollout.prompts_per_step, config.task.num_prompts
    steps = -(-prompts // per_step) if 0 < per_step < prompts else 1  # steps per epoch
    bar = tqdm(total=config.loop.epochs * steps, desc=config.name,
               unit="step" if steps > 1 else "epoch", disable=not (progress and tty))
    sink = progress_sink(nested=progress) if phases else None
    first: Dict[str, Any] = {}

    def on_epoch(metrics):
        first.setdefault("m", metrics)
        bar.update(1)
        bar.set_postfix(reward=f"{metrics['mean_reward']:.3f}", tau=f"{metrics['tau']:.2f}")
        if progress and not tty:
            where = f" step {metrics['step']}" if "step" in metrics else ""
            print(f"{config.name}: epoch {metrics['epoch']}{where} done, reward "
                  f"{metrics['mean_reward']:.3f}, tau {metrics['tau']:.2f}", file=sys.stderr,
                  flush=True)
        if echo is not None:
            echo(metrics, first["m"])

    try:
        results = run(config, resume=resume, on_epoch=on_epoch, progress=sink)
    finally:
        if sink is not None:
            sink.close()
        bar.close()
    if config.loop.report:
        write_report(config.run_dir, title=run_title(config.name))
    return results


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    set_process_env(joining=any(a == "--address" or a.startswith("--address=") for a in argv))
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from rl_driver.config import ConfigError, config_from_dict, load_config

    if args.command == "report":
        from rl_driver.report import write_report

        print(write_report(args.run_dir))
        return 0
    try:
        config = (load_config(args.config, overrides_from(args)) if args.config
                  else config_from_dict({}, overrides_from(args)))
    except ConfigError as exc:
        print(f"rhyme-rl: bad config: {exc}", file=sys.stderr)
        return 2
    if args.command == "config":
        import dataclasses

        import yaml

        print(yaml.safe_dump(_plain(dataclasses.asdict(config)), sort_keys=False), end="")
        return 0
    if args.command == "warm-start":
        return warm_start(config, force=args.force, export=args.export, evaluate=not args.no_eval)
    train(config, resume=args.resume, progress=not args.no_progress, phases=not args.no_progress)
    print(f"run written to {config.run_dir}")
    return 0


def warm_start(config, force: bool = False, export: bool = False, evaluate: bool = True) -> int:
    from rhyme_sglang.models import resolve_model_path
    from rl_driver import warm_start as ws

    base = resolve_model_path(config.model)
    folder = ws.ensure(base, config.warm_start, evaluate_after=evaluate, force_train=force)
    if export:
        print(f"adapter exported to {ws.export_adapter(folder, config.warm_start, base)}")
    print(folder)
    return 0


def _plain(value):
    """``value`` with tuples as lists (YAML's safe form)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


if __name__ == "__main__":
    sys.exit(main())
