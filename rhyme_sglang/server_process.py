"""Run ``python -m rhyme_sglang.launch_server`` (and ``sglang_router``) as subprocesses, and
tiny JSON HTTP helpers.

Used by the tests and benchmarks; handy for scripts that need a throwaway local server or a
router in front of several. Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from rhyme_sglang.settings import prepare_cpu_env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body, raw: bytes | None = None, timeout: float = 60.0, headers=None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, _decode(err.read())


def _decode(payload: bytes):
    try:
        return json.loads(payload or b"null")
    except json.JSONDecodeError:
        return payload.decode(errors="replace")


def get(url: str, timeout: float = 30.0):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, _decode(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, _decode(err.read())


class ServerProcess:
    """A ``python -m rhyme_sglang.launch_server`` subprocess on a free loopback port."""

    module = "rhyme_sglang.launch_server"

    # a free port can be taken between _free_port() and the server's bind (by another process
    # or one of the server's own internal sockets): seen as uvicorn's "[Errno 98] ... address
    # already in use" while the scheduler lives on, so the server never turns healthy
    PORT_TAKEN = "address already in use"
    PORT_RETRIES = 2

    def __init__(self, args: list[str], log_path: str):
        self._args = list(args)
        self._log = open(log_path, "w")
        self._launch()

    def _launch(self) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log_start = self._log.tell()
        env = prepare_cpu_env(dict(os.environ), override=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", self.module, *self.base_args(), *self._args],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )

    def _port_taken(self) -> bool:
        """This launch's log reports that its port was taken before it could bind."""
        try:
            with open(self._log.name, errors="replace") as fh:
                fh.seek(self._log_start)
                return self.PORT_TAKEN in fh.read().lower()
        except OSError:
            return False

    def _kill(self) -> None:
        import signal

        with contextlib.suppress(ProcessLookupError):  # the group is gone already
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)

    def base_args(self) -> list[str]:
        return ["--port", str(self.port), "--log-level", "warning"]

    def ready(self) -> bool:
        return get(self.url + "/health", timeout=2)[0] == 200

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Poll ``/health`` until it answers 200; a launch whose port was taken is restarted on
        another port (at most ``PORT_RETRIES`` times, within the same ``timeout``)."""
        deadline, retries = time.monotonic() + timeout, self.PORT_RETRIES
        while time.monotonic() < deadline:
            exited = self.proc.poll() is not None  # before reading the log: then it is whole
            if retries and self._port_taken():
                retries -= 1
                self._kill()
                self._log.flush()
                self._log.seek(0, os.SEEK_END)
                self._launch()
                continue
            if exited:
                raise RuntimeError(f"{self.module} exited early; see {self._log.name}")
            try:
                if self.ready():
                    return
            except OSError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"{self.module} did not become ready")

    def stop(self) -> None:
        """Terminate the process group (killed after 30 s); a second call does nothing."""
        if self._log.closed:
            return
        self._kill()
        self._log.close()


class RouterProcess(ServerProcess):
    """``python -m sglang_router.launch_router`` in front of ``worker_urls`` (loopback only).

    ``args``: router flags, e.g. ``["--policy", "manual"]``. Ready once it lists every worker
    as healthy."""

    module = "sglang_router.launch_router"

    def __init__(self, worker_urls: list[str], args: list[str], log_path: str):
        self.worker_urls = list(worker_urls)
        super().__init__(args, log_path)

    def base_args(self) -> list[str]:
        return ["--host", "127.0.0.1", "--port", str(self.port), "--worker-urls",
                *self.worker_urls, "--prometheus-host", "127.0.0.1", "--prometheus-port",
                str(_free_port()), "--log-level", "warn"]

    def ready(self) -> bool:
        status, body = get(self.url + "/workers", timeout=2)
        return status == 200 and isinstance(body, dict) and body.get("total") == len(self.worker_urls)
