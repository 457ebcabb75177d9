"""The RHYME control channel between the main process and the scheduler-process worker.

sglang's RPC channel returns only success flags, so the worker serves its own small
request/reply socket (ZeroMQ REP over IPC) on a background thread; commands run under the
worker's lock. Messages are JSON: ``{"cmd": NAME, "args": {...}}`` -> ``{"ok": true,
"result": ...}`` or ``{"ok": false, "error": MESSAGE}``. A bad command never kills the
worker: every exception becomes an error reply.
"""

from __future__ import annotations

import json
import logging
import threading

import zmq

logger = logging.getLogger(__name__)


class ControlServer(threading.Thread):
    def __init__(self, addr: str, worker):
        super().__init__(name="rhyme-control", daemon=True)
        self.addr = addr
        self.worker = worker
        self._ctx = zmq.Context.instance()

    def run(self) -> None:
        sock = self._ctx.socket(zmq.REP)
        sock.bind(self.addr)
        logger.info("rhyme: control socket at %s", self.addr)
        while True:
            raw = sock.recv()
            sock.send(self._handle(raw))

    def _handle(self, raw: bytes) -> bytes:
        try:
            msg = json.loads(raw)
            if not isinstance(msg, dict) or not isinstance(msg.get("cmd"), str):
                raise ValueError("control message must be an object with a 'cmd' string")
            args = msg.get("args") or {}
            if not isinstance(args, dict):
                raise ValueError("'args' must be an object")
            reply = {"ok": True, "result": self.worker.command(msg["cmd"], args)}
        except (ValueError, TypeError, KeyError, OSError) as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        except Exception as exc:  # never let a command kill the scheduler
            logger.exception("rhyme control command failed")
            reply = {"ok": False, "error": f"internal error: {type(exc).__name__}: {exc}"}
        return json.dumps(reply).encode()


class ControlError(ValueError):
    """The worker refused a command (bad input); the message says why."""


class ControlClient:
    """Thread-safe client; one request at a time, with a timeout."""

    def __init__(self, addr: str, timeout_s: float = 60.0):
        self.addr = addr
        self.timeout_ms = int(timeout_s * 1000)
        self._lock = threading.Lock()
        self._sock = None

    def _socket(self):
        if self._sock is None:
            sock = zmq.Context.instance().socket(zmq.REQ)
            sock.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
            sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.addr)
            self._sock = sock
        return self._sock

    def call(self, cmd: str, **args):
        with self._lock:
            sock = self._socket()
            try:
                sock.send(json.dumps({"cmd": cmd, "args": args}).encode())
                reply = json.loads(sock.recv())
            except zmq.Again as exc:
                sock.close()
                self._sock = None  # a REQ socket is unusable after a timeout
                raise TimeoutError(f"rhyme control command {cmd!r} timed out") from exc
        if not reply.get("ok"):
            raise ControlError(reply.get("error", "unknown error"))
        return reply["result"]

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
