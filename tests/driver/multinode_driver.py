"""The loop as a driver process of its own, joined to a test cluster (``test_multinode``): the
test process keeps no Ray of its own, and a node can be killed mid-epoch from inside the loop.

    python -m tests.driver.multinode_driver CONFIG OUT_JSON [--set-json JSON]
        [--kill-pid PID --kill-epoch E]

Writes ``{"metrics": [...], "killed": [pids]}`` to OUT_JSON."""

from __future__ import annotations

import argparse
import json
import logging
import sys


def main(argv=None) -> int:
    from rl_driver.cli import set_process_env

    set_process_env()
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("out")
    ap.add_argument("--set-json", default="{}", help="config overrides, {section.key: value}")
    ap.add_argument("--kill-pid", type=int, help="a node's `ray start` pid, killed with its tree")
    ap.add_argument("--kill-epoch", type=int, default=1)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from rl_driver.config import load_config
    from rl_driver.loop import run
    from tests.driver.cluster import kill_tree

    config = load_config(args.config, json.loads(args.set_json))
    killed: list = []

    def kill_node(epoch, pool):
        if args.kill_pid and epoch == args.kill_epoch and not killed:
            killed.extend(kill_tree(args.kill_pid))
            logging.getLogger(__name__).warning("killed node (pids %s) in epoch %d", killed, epoch)

    metrics = run(config, on_rollout_start=kill_node)
    with open(args.out, "w") as fh:
        json.dump({"metrics": metrics, "killed": killed}, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
