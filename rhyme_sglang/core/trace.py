"""Reading and writing rollout traces (JSON Lines, optionally gzip) with validation."""

from __future__ import annotations

import gzip
import json
import math
import os
from dataclasses import asdict, dataclass
from typing import Iterable, Iterator, List

FIELDS = ("prompt_id", "epoch", "sample", "prompt_token_ids", "response_token_ids", "reward",
          "finish_reason")
FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class TraceRecord:
    """One finished response of a multi-epoch rollout (see notes/trace-format.md)."""

    prompt_id: str
    epoch: int
    sample: int
    prompt_token_ids: List[int]
    response_token_ids: List[int]
    reward: float
    finish_reason: str

    def __post_init__(self) -> None:
        if not isinstance(self.prompt_id, str) or not self.prompt_id:
            raise ValueError(f"prompt_id must be a non-empty str, got {self.prompt_id!r}")
        for name in ("epoch", "sample"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        for name in ("prompt_token_ids", "response_token_ids"):
            v = getattr(self, name)
            if not isinstance(v, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
                raise ValueError(f"{name} must be a list of non-negative ints")
        if isinstance(self.reward, bool) or not isinstance(self.reward, (int, float)) \
                or not math.isfinite(self.reward):
            raise ValueError(f"reward must be a finite number, got {self.reward!r}")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")


def _open(path: str, mode: str, gz: bool):
    return gzip.open(path, mode + "t", encoding="utf-8") if gz else open(path, mode, encoding="utf-8")


def parse_line(line: str, where: str = "line") -> TraceRecord:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object")
    missing = [f for f in FIELDS if f not in obj]
    extra = [f for f in obj if f not in FIELDS]
    if missing or extra:
        raise ValueError(f"{where}: missing fields {missing}, unexpected fields {extra}")
    try:
        return TraceRecord(**obj)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def iter_trace(path: str) -> Iterator[TraceRecord]:
    """Records of a trace file in file order; ValueError names the first bad line."""
    with _open(path, "r", path.endswith(".gz")) as fh:
        for i, line in enumerate(fh, 1):
            if line.strip():
                yield parse_line(line, f"{path}:{i}")


def read_trace(path: str) -> List[TraceRecord]:
    """All records; also rejects duplicate (prompt_id, epoch, sample) keys."""
    out = list(iter_trace(path))
    seen = set()
    for r in out:
        key = (r.prompt_id, r.epoch, r.sample)
        if key in seen:
            raise ValueError(f"{path}: duplicate record for prompt {r.prompt_id!r} epoch {r.epoch} sample {r.sample}")
        seen.add(key)
    return out


def write_trace(path: str, records: Iterable[TraceRecord]) -> int:
    """Write records atomically (temp file + rename); returns how many were written."""
    tmp = f"{path}.tmp.{os.getpid()}"
    n = 0
    try:
        with _open(tmp, "w", path.endswith(".gz")) as fh:
            for rec in records:
                if not isinstance(rec, TraceRecord):
                    rec = TraceRecord(**rec)
                fh.write(json.dumps(asdict(rec), separators=(",", ":")) + "\n")
                n += 1
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return n
