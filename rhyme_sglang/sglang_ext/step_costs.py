"""Measured decode-step costs kept across engine starts, per machine and model shape.

The cost model (:class:`rhyme_sglang.core.cost_model.SpecCostModel`) learns the seconds of a
decode step per (batch bucket, verify width) online. A fresh engine knows none of them and
pays for exploratory verify steps wherever drafts do not pay; a server started per benchmark,
a side-by-side or a restarted engine does not live long enough to amortise that. Rules:

* A RHYME engine with the cost model on keeps its table in ``step_costs.json`` under the cache
  root (:func:`rhyme_sglang.settings.cache_root`; ``RHYME_STEP_COSTS`` names another file).
  The next engine with the same machine, model shape, dtype, threads (torch and kernel),
  device and, on CPU, native kernel revisions (``native_step.revisions()``) starts from it
  (:meth:`SpecCostModel.seed`) and keeps measuring: every step moves its
  cell (an EMA), so a stale table corrects itself. What it saves is the exploration.
* Each cell is saved with its forward rows per request (a per-request verify runs fewer nodes
  than its width; a table without them prices a verify row at a fraction of its cost).
* A cell's seconds are saved context-free, with the fitted cost of a context token and of a
  draft row's context token (``"context"``; :mod:`rhyme_sglang.core.context_fit`), so a table
  saved by a long-context rollout does not over-price a short chat's verifies. Entries of
  earlier formats are not read.
* The acceptance calibration belongs to a workload's history, not the machine: not saved.
* ``--rhyme-cost-cache 0`` (``rhyme_cost_cache=False``) turns it off; the benchmarks that
  measure the cost model itself (``bench_cpu_engine``) start without it.
* Writes are atomic (a temporary file replaced), at most every ``SAVE_EVERY_S`` seconds while
  decoding and when the engine shuts down; a file that cannot be read or written only costs
  the warm start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Dict, Optional, Tuple

from rhyme_sglang.settings import ENV_NAMES, cache_root, settings

logger = logging.getLogger(__name__)

PATH_ENV = ENV_NAMES["step_costs"]
SAVE_EVERY_S = 30.0
FORMAT = 3  # 3: context-free seconds and context costs; 2: rows per request (not read)
Table = Dict[Tuple[int, int], float]  # (batch bucket, width) -> seconds of a whole step


def cache_path() -> Path:
    """``RHYME_STEP_COSTS`` when set, else ``step_costs.json`` in the cache root."""
    explicit = settings().step_costs
    return Path(explicit).expanduser() if explicit else cache_root() / "step_costs.json"


def table_key(model_shape: dict, dtype: str, threads, device: str, kernels: str = "") -> str:
    """This machine (CPU model, flags, torch), the model's shape, dtype, threads (torch's, or
    ``"torch/kernel"``), device, and on CPU the native kernels' revisions (a kernel change
    starts a new entry instead of seeding from costs it changed)."""
    from rhyme_sglang.machine import machine_key

    fields = {"machine": machine_key(), "model": model_shape, "dtype": str(dtype),
              "threads": str(threads), "device": device, "format": FORMAT}
    if kernels:
        fields["kernels"] = kernels
    text = json.dumps(fields, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def model_shape(hf_config) -> dict:
    """The fields of an HF config that set a forward's cost (not its weights' values)."""
    names = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "vocab_size", "head_dim")
    values = {n: getattr(hf_config, n, None) for n in names}
    return {n: v for n, v in values.items() if isinstance(v, (int, str))}


def _read_all(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _cells(entry, field: str) -> Table:
    out: Table = {}
    if not isinstance(entry, dict):
        return out
    values = entry.get(field)
    for cell, value in (values.items() if isinstance(values, dict) else ()):
        try:
            bucket, width = (int(x) for x in cell.split(":"))
            value = float(value)
        except (ValueError, AttributeError, TypeError):
            continue
        if bucket >= 1 and width >= 0 and value > 0:
            out[(bucket, width)] = value
    return out


def load(key: str, path: Optional[Path] = None) -> Table:
    """The saved table under ``key`` (empty when absent or unreadable)."""
    return _cells(_read_all(path or cache_path()).get(key), "seconds")


def load_rows(key: str, path: Optional[Path] = None) -> Table:
    """The saved cells' forward rows per request under ``key`` (empty when absent)."""
    return _cells(_read_all(path or cache_path()).get(key), "rows")


def _context(entry) -> Optional[Tuple[float, float]]:
    """The saved ``(c_keys, c_rows)`` of an entry; None when absent or malformed."""
    value = entry.get("context") if isinstance(entry, dict) else None
    try:
        c_keys, c_rows = (float(x) for x in value)
    except (TypeError, ValueError):
        return None
    ok = all(math.isfinite(c) and c >= 0.0 for c in (c_keys, c_rows))
    return (c_keys, c_rows) if ok else None


def load_context(key: str, path: Optional[Path] = None) -> Optional[Tuple[float, float]]:
    """The saved context costs under ``key`` (None when absent)."""
    return _context(_read_all(path or cache_path()).get(key))


def save(key: str, table: Table, about: Optional[dict] = None, path: Optional[Path] = None,
         rows: Optional[Table] = None, context: Optional[Tuple[float, float]] = None) -> bool:
    """Write ``table`` (and each cell's ``rows`` per request, and the ``context`` costs its
    seconds are free of) under ``key``, other keys kept; False when the file could not be
    written."""
    path = path or cache_path()
    data = _read_all(path)
    data[key] = {"seconds": {f"{b}:{w}": s for (b, w), s in sorted(table.items())},
                 "rows": {f"{b}:{w}": r for (b, w), r in sorted((rows or {}).items())},
                 "context": list(context or (0.0, 0.0)),
                 "saved": time.time(), **(about or {})}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
        return True
    except OSError as exc:
        logger.debug("could not save step costs to %s: %s", path, exc)
        return False


class StepCostCache:
    """One engine's link to the file: ``seed`` the cost model at start, ``maybe_save`` while
    decoding (rate-limited), ``flush`` at shutdown."""

    def __init__(self, key: str, about: Optional[dict] = None, every_s: float = SAVE_EVERY_S):
        self.key, self.about, self.every_s = key, about or {}, every_s
        self.seeded = 0
        self._last_save = time.monotonic()
        self._dirty = False

    @classmethod
    def for_engine(cls, server_args, model_runner) -> "StepCostCache":
        """The entry of an engine (sglang's server args and model runner): this machine, the
        model's shape, dtype, threads and device."""
        import torch

        shape = model_shape(model_runner.model_config.hf_config)
        device = str(getattr(server_args, "device", None) or "cpu")
        if device.startswith("cuda") and torch.cuda.is_available():
            device = torch.cuda.get_device_name()
        from rhyme_sglang.machine import kernel_threads

        # a verify's cost depends on both: its GEMMs run on the kernels' threads (costs saved
        # with 1 kernel thread price a 2-thread engine's verifies too high)
        threads = f"{torch.get_num_threads()}/{kernel_threads()}"
        kernels = ""
        if device == "cpu":
            from rhyme_sglang.cpu_backend.native_step import revisions

            kernels = revisions()
        return cls(table_key(shape, server_args.dtype, threads, device, kernels),
                   about={"model": shape, "dtype": str(server_args.dtype), "threads": threads,
                          "device": device, "kernels": kernels})

    def seed(self, cost_model) -> int:
        entry = _read_all(cache_path()).get(self.key)  # one read for both fields
        self.seeded = cost_model.seed(_cells(entry, "seconds"), _cells(entry, "rows"),
                                      _context(entry))
        if self.seeded:
            logger.info("rhyme: cost model starts from %d saved step costs (%s)", self.seeded,
                        cache_path())
        return self.seeded

    def observed(self, cost_model) -> None:
        self._dirty = True
        if time.monotonic() - self._last_save >= self.every_s:
            self.flush(cost_model)

    def flush(self, cost_model) -> None:
        if self._dirty:
            # merge: cells this engine never measured keep their saved values
            entry = _read_all(cache_path()).get(self.key)
            table = {**_cells(entry, "seconds"), **cost_model.table()}
            rows = {**_cells(entry, "rows"), **cost_model.rows_table()}
            save(self.key, table, self.about, rows=rows,
                 context=cost_model.context_coefficients())
            self._dirty = False
        self._last_save = time.monotonic()
