"""A Ray cluster of several nodes on one machine, for the multi-node tests: each node is a
``ray start --block`` process (its own raylet, object store, temp dir and ports) on 127.0.0.1.
Every process a node starts descends from its ``ray start``; nodes are stopped by pid, never by
``ray stop`` (which would stop every Ray on the machine)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Dict, List, Optional

RAY = str(Path(sys.executable).with_name("ray"))


def free_ports(n: int) -> List[int]:
    """``n`` distinct ports free on 127.0.0.1 now (all held open until chosen)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def tree(pid: int) -> list:
    """``psutil.Process`` of ``pid`` and of every process descending from it."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def kill(procs) -> None:
    """SIGKILL each ``psutil.Process`` still running (psutil checks the pid was not reused)."""
    import psutil

    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def kill_tree(pid: int) -> List[int]:
    """SIGKILL ``pid`` and its descendants (all listed first, so none is orphaned unseen)."""
    procs = tree(pid)
    kill(procs)
    return [p.pid for p in procs]


class LoopbackCluster:
    """``add_node`` starts a node (the first is the head); ``kill_node`` kills one node's
    processes; ``stop`` ends them all. ``procs`` holds every process seen in a node's tree."""

    def __init__(self, env: Optional[Dict[str, str]] = None):
        self.root = Path(tempfile.mkdtemp(prefix="rmn", dir="/tmp"))  # short: socket paths
        self.env = dict(os.environ if env is None else env)
        self.nodes: Dict[str, subprocess.Popen] = {}
        self.procs: Dict[int, object] = {}  # pid -> psutil.Process of every process seen
        self.address: Optional[str] = None

    def add_node(self, name: str, resources: Dict[str, float], num_cpus: int = 1) -> None:
        ports = free_ports(6 + 16)
        args = [RAY, "start", "--block", "--node-ip-address", "127.0.0.1",
                "--num-cpus", str(num_cpus), "--resources", json.dumps(resources),
                "--temp-dir", str(self.root / name), "--object-store-memory", str(100 * 2 ** 20),
                "--node-manager-port", str(ports[0]), "--object-manager-port", str(ports[1]),
                "--dashboard-agent-listen-port", str(ports[2]),
                "--dashboard-agent-grpc-port", str(ports[3]),
                "--metrics-export-port", str(ports[4]),
                "--runtime-env-agent-port", str(ports[5]),
                "--worker-port-list", ",".join(map(str, ports[6:])),
                "--disable-usage-stats"]
        if self.address is None:
            gcs, client = free_ports(2)
            args += ["--head", "--port", str(gcs), "--ray-client-server-port", str(client),
                     "--include-dashboard", "false"]
            self.address = f"127.0.0.1:{gcs}"
        else:
            args += ["--address", self.address]
        log = open(self.root / f"{name}.log", "wb")
        self.nodes[name] = subprocess.Popen(args, env=self.env, stdout=log,
                                            stderr=subprocess.STDOUT)
        self.remember()

    def remember(self) -> None:
        for proc in self.nodes.values():
            self.procs.update((p.pid, p) for p in tree(proc.pid))

    def wait_nodes(self, count: int, timeout_s: float = 120.0) -> None:
        """Until ``count`` raylets run (one per started node)."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            raylets = sum(any(_name(p) == "raylet" for p in tree(proc.pid)[1:])
                          for proc in self.nodes.values())
            if raylets >= count:
                self.remember()
                return
            time.sleep(1)
        raise TimeoutError(f"{count} raylets did not start in {timeout_s}s: see {self.root}")

    def kill_node(self, name: str) -> List[int]:
        self.remember()
        return kill_tree(self.nodes[name].pid)

    def stop(self) -> List[int]:
        """Stop every node (SIGTERM to each ``ray start``, then SIGKILL to whatever of their
        trees remains); returns the pids still alive afterwards (none, normally: then the
        nodes' temp dirs are removed)."""
        self.remember()
        for proc in reversed(list(self.nodes.values())):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.time() + 30
        for proc in self.nodes.values():
            try:
                proc.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
        kill(self.procs.values())
        for proc in self.nodes.values():
            if proc.poll() is None:
                proc.wait(timeout=10)
        time.sleep(1)
        left = [p.pid for p in self.procs.values() if _alive(p)]
        if not left:
            shutil.rmtree(self.root, ignore_errors=True)
        return left


def _name(proc) -> str:
    import psutil

    try:
        return proc.name()
    except psutil.NoSuchProcess:
        return ""


def _alive(proc) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
