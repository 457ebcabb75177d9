"""Produce a real multi-epoch rollout trace with the project's own RL loop.

Runs ``rl_driver.loop.run`` (rollouts on rhyme-sglang engines, GRPO updates on the trainer,
weight sync each epoch) and writes ``OUT.jsonl.gz`` in the trace format of
docs/trace-format.md plus the ``OUT.meta.json`` sidecar (model, tokenizer, sampling
settings, per-epoch stats).

``--task NAME`` (a preset of ``rl_driver.task_presets``) makes the trace a warm-started
policy's: the run's prompts are that preset's (``task.preset``) and its policy is the preset's
SFT warm start (``warm_start.enabled``, ``warm_start.task`` = NAME; cached, or built once,
about 8 minutes on 2 cores). Explicit ``--set`` values of those keys win.

    python scripts/make_traces.py --config configs/demo.yaml --epochs 6 \
        --out out/traces_smollm2_chain_sum.jsonl.gz --set rollout.max_new_tokens=256
    python scripts/make_traces.py --config configs/demo.yaml --epochs 6 --task running_sum \
        --out out/traces_smollm2_running_sum.jsonl.gz --set rollout.max_new_tokens=1024
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path


def run_overrides(args) -> dict:
    """The run config's overrides: ``--set`` values, then a trace run's (``loop.trace`` on,
    ``loop.report`` off, ``--epochs``, a default ``name`` from ``--out``); ``--task`` sets
    ``task.preset`` and turns on the warm start of that task unless ``--set`` sets them."""
    overrides = dict(args.set)
    overrides.setdefault("name", "traces-" + Path(args.out).name.split(".")[0])
    overrides["loop.trace"] = True
    overrides["loop.report"] = False
    if args.epochs:
        overrides["loop.epochs"] = args.epochs
    if args.task:
        for key, value in (("task.preset", args.task), ("warm_start.enabled", True),
                           ("warm_start.task", args.task)):
            overrides.setdefault(key, value)
    return overrides


def main(argv=None) -> int:
    from rl_driver.cli import _parse_override, set_process_env
    from rl_driver.task_presets import PRESETS

    set_process_env()

    parser = argparse.ArgumentParser(prog="make_traces.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--out", required=True, help="output trace path (.jsonl or .jsonl.gz)")
    parser.add_argument("--task", metavar="NAME", choices=list(PRESETS), default=None,
                        help="a preset of rl_driver.task_presets: its prompts, on its warm-started "
                             f"policy ({', '.join(PRESETS)})")
    parser.add_argument("--set", action="append", default=[], type=_parse_override,
                        metavar="SECTION.KEY=VALUE")
    args = parser.parse_args(argv)
    if not args.out.endswith((".jsonl", ".jsonl.gz")):
        parser.error(f"--out must end with .jsonl or .jsonl.gz, got {args.out!r}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    from rhyme_sglang.core import read_trace
    from rl_driver.config import load_config
    from rl_driver.loop import run

    config = load_config(args.config, run_overrides(args))
    t0 = time.time()
    run(config)
    src = config.run_dir / "trace.jsonl.gz"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    records = read_trace(str(src))  # validates the whole file
    if args.out.endswith(".gz"):
        shutil.copyfile(src, out)
    else:
        import gzip

        with gzip.open(src, "rb") as fin, open(out, "wb") as fout:
            shutil.copyfileobj(fin, fout)
    meta = json.loads((config.run_dir / "trace.meta.json").read_text())
    meta.update(tokenizer=config.model, sampling=meta["config"]["rollout"],
                wall_time_s=time.time() - t0)
    name = out.name[: -len(".jsonl.gz")] if out.name.endswith(".gz") else out.name[: -len(".jsonl")]
    (out.parent / f"{name}.meta.json").write_text(json.dumps(meta, indent=2, default=str))
    epochs = sorted({r.epoch for r in records})
    print(f"wrote {len(records)} responses over epochs {epochs} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
