"""RHYME servers on a Ray cluster behind one sglang-router, for frameworks that bring their own
loop: one ``rhyme_sglang.launch_server`` per placement bundle (each on the node Ray placed its
bundle), the router in front of them on this node (``--worker-urls``).

    python -m rl_driver.serve --address auto --num-servers 4 --num-gpus 1 --strategy SPREAD \\
        --router-port 30000 -- --model-path Qwen/Qwen2.5-7B-Instruct \\
        --speculative-algorithm RHYME --speculative-num-draft-tokens 17

Everything after ``--`` goes to every server. Clients send each request of a prompt group with
the header ``x-smg-routing-key: <group id>`` (the router's ``manual`` policy, the default here)
so a group lands on the engine holding its history; ``docs/ray-cluster.md`` says how to keep a
hot group from pinning one engine. Ctrl-C stops the router and every server.
"""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional

logger = logging.getLogger(__name__)


class ServerHost:
    """A Ray actor owning one ``rhyme_sglang.launch_server`` subprocess on its node."""

    def __init__(self, server_args: List[str], log_path: str):
        import os

        import ray

        from rl_driver.weight_sync import free_port

        self.ip = ray.util.get_node_ip_address()
        self.port = free_port("")
        from rhyme_sglang.settings import prepare_cpu_env

        # a GPU server's devices come from Ray (CUDA_VISIBLE_DEVICES)
        env = prepare_cpu_env(dict(os.environ), cpu_engine=not ray.get_gpu_ids())
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rhyme_sglang.launch_server", "--host", "0.0.0.0",
             "--port", str(self.port), *server_args],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            preexec_fn=_die_with_parent)

    def url(self, timeout_s: float = 900.0) -> str:
        """The server's URL once ``/health`` answers (raises if it exits first)."""
        from rhyme_sglang.server_process import get

        url = f"http://{self.ip}:{self.port}"
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server on {self.ip} exited with {self.proc.returncode}; "
                                   f"see {self._log.name} on that node")
            try:
                if get(f"http://127.0.0.1:{self.port}/health", timeout=2)[0] == 200:
                    return url
            except OSError:
                pass
            time.sleep(1)
        raise TimeoutError(f"the server on {self.ip} was not healthy in {timeout_s:.0f}s")

    def stop(self) -> None:
        import os
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def _die_with_parent() -> None:
    """In the server's process: SIGTERM when its actor's process dies (Linux), so a killed
    actor leaves no server behind."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def start_servers(server_args: List[str], bundles: List[Dict[str, float]], strategy: str,
                  log_dir: str = "/tmp") -> tuple:
    """A placement group of ``bundles`` and one :class:`ServerHost` in each; returns
    ``(group, hosts, urls)``."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from rl_driver.placement import actor_options

    group = placement_group(bundles, strategy=strategy)
    ray.get(group.ready())
    hosts = [ray.remote(ServerHost).options(
        **actor_options(b), scheduling_strategy=PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=i)).remote(server_args,
                                                           f"{log_dir}/rhyme-server-{i}.log")
        for i, b in enumerate(bundles)]
    urls = ray.get([h.url.remote() for h in hosts])
    for i, url in enumerate(urls):
        logger.info("server %d at %s, resources %s", i, url, bundles[i])
    return group, hosts, urls


def router_command(urls: List[str], port: int, policy: str, extra: List[str]) -> List[str]:
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", "0.0.0.0",
            "--port", str(port), "--worker-urls", *urls, "--policy", policy, *extra]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m rl_driver.serve", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n")[0],
        epilog="server arguments: everything after `--` (rhyme_sglang.launch_server's flags)")
    ap.add_argument("--address", default="", help="Ray cluster (auto, ray://HEAD:10001, "
                    "HEAD:6379); default RAY_ADDRESS, else a local instance")
    ap.add_argument("--num-servers", type=int, default=2)
    ap.add_argument("--num-cpus", type=float, default=1.0, help="CPUs per server bundle")
    ap.add_argument("--num-gpus", type=float, default=0.0, help="GPUs per server bundle")
    ap.add_argument("--strategy", default="PACK",
                    choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"])
    ap.add_argument("--router-port", type=int, default=30000)
    ap.add_argument("--policy", default="manual", help="sglang-router policy (manual: "
                    "x-smg-routing-key pins a prompt group to one server)")
    ap.add_argument("--router-arg", action="append", default=[],
                    help="an extra sglang-router flag (repeatable)")
    ap.add_argument("--log-dir", default="/tmp", help="each node's server log folder")
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    import ray

    from rl_driver.placement import bundle

    argv = list(sys.argv[1:] if argv is None else argv)
    server_args = argv[argv.index("--") + 1:] if "--" in argv else []
    args = build_parser().parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ray.init(address=args.address or None, log_to_driver=False)
    bundles = [bundle(args.num_cpus, args.num_gpus, {}) or {"CPU": 0.001}
               for _ in range(args.num_servers)]
    group, hosts, urls = start_servers(server_args, bundles, args.strategy, args.log_dir)
    router = subprocess.Popen(router_command(urls, args.router_port, args.policy, args.router_arg))
    logger.info("router on port %d in front of %s (policy %s); Ctrl-C stops everything",
                args.router_port, urls, args.policy)
    stop = threading.Event()  # SIGINT / SIGTERM (a background job starts with SIGINT ignored)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        while router.poll() is None and not stop.wait(1.0):
            pass
    finally:
        if router.poll() is None:
            router.terminate()
            router.wait(timeout=30)
        ray.get([h.stop.remote() for h in hosts])
        ray.util.remove_placement_group(group)
        logger.info("router and servers stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
