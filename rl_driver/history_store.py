"""``HistoryStore``: the driver's per-prompt RHYME history, kept outside the engines.

With ``rollout.history: per_step`` the engines hold only the current and the next step's
prompts; every other prompt's history lives here. A prompt's entry is the dict
``DraftStore.export_prompt`` returns (``rhyme_sglang.core.transfer``: ``format``,
``prompt_id``, ``prompt_tail``, ``epoch``, ``records``), as ``Engine.rhyme_export_histories``
hands it over, and goes back to an engine unchanged (``rhyme_import_history``).

Each prompt has a file of its own, ``dir/shard-XXX/<hash>.pkl``: the folder is a stable hash
of its id over ``num_shards`` (blake2b, the same in every process), the name a longer one. So
a step reads and writes its own prompts' files only, whatever the dataset's size, and the
driver holds at most ``cache_prompts`` histories in memory (least recently used out). ``put``
writes each file to a temporary name, syncs it and renames it over the old one: a crash leaves
every prompt's old or new history, never a torn one. ``dir/meta.json`` holds the format and
``num_shards``; a store of the first format (one pickle per shard, every prompt of the shard
in it) is converted when opened. ``bytes_written`` / ``bytes_read`` / ``write_s`` / ``read_s``
count the file traffic.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

FORMAT = 2


def _digest(prompt_id: str) -> bytes:
    return hashlib.blake2b(prompt_id.encode(), digest_size=16).digest()


def shard_of(prompt_id: str, num_shards: int) -> int:
    """The shard (folder) that holds ``prompt_id`` (stable across processes and runs)."""
    digest = hashlib.blake2b(prompt_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % num_shards


def check_state(state: Any) -> str:
    """The prompt id of an exported history; ValueError naming what is wrong."""
    if not isinstance(state, dict):
        raise ValueError(f"a history must be a dict (DraftStore.export_prompt), got {type(state).__name__}")
    pid = state.get("prompt_id")
    if not isinstance(pid, str) or not pid:
        raise ValueError(f"a history's prompt_id must be a non-empty string, got {pid!r}")
    if not isinstance(state.get("records"), list):
        raise ValueError(f"history of {pid!r}: records must be a list, got {state.get('records')!r}")
    return pid


def mean_response_length(state: Dict[str, Any]) -> Optional[float]:
    """Mean response length of a history's real records (``run_ahead`` drafts left out), or
    None without any."""
    lengths = [len(r.get("response") or []) for r in state.get("records", [])
               if not r.get("run_ahead")]
    return sum(lengths) / len(lengths) if lengths else None


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class HistoryStore:
    """Per-prompt histories in one atomic file each under ``directory`` (module docstring)."""

    def __init__(self, directory, num_shards: int = 16, cache_prompts: int = 4096):
        for name, value in (("num_shards", num_shards), ("cache_prompts", cache_prompts)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.dir = Path(directory)
        self.num_shards = num_shards
        self.cache_prompts = cache_prompts
        self.bytes_written = self.bytes_read = 0
        self.write_s = self.read_s = 0.0
        self._cache: "OrderedDict[str, Dict[str, Any]]" = OrderedDict()
        self.dir.mkdir(parents=True, exist_ok=True)
        self._open_meta()

    # ----------------------------------------------------------------- layout
    def path(self, prompt_id: str) -> Path:
        """The file of ``prompt_id``'s history."""
        return (self.dir / f"shard-{shard_of(prompt_id, self.num_shards):03d}"
                / f"{_digest(prompt_id).hex()}.pkl")

    def _open_meta(self) -> None:
        meta = self.dir / "meta.json"
        if meta.exists():
            try:
                raw = json.loads(meta.read_text())
                ok = raw.get("format") == FORMAT and raw.get("num_shards") == self.num_shards
            except (ValueError, AttributeError):
                ok = False
            if not ok:
                raise ValueError(f"{meta}: not a history store of format {FORMAT} with "
                                 f"{self.num_shards} shards (rollout.history_shards changed?)")
            return
        old = sorted(self.dir.glob("shard-*.pkl"))
        states = [s for path in old for s in self._read_v1(path)]
        if states:
            self.put(states)
        _write_atomic(meta, json.dumps({"format": FORMAT, "num_shards": self.num_shards}).encode())
        for path in old:  # converted: the first format's shards go once meta.json exists
            path.unlink()

    def _read_v1(self, path: Path) -> List[Dict[str, Any]]:
        """The histories of a shard file of the first format (every prompt of the shard)."""
        raw = pickle.loads(path.read_bytes())
        if not isinstance(raw, dict) or raw.get("format") != 1 or raw.get("num_shards") != self.num_shards:
            raise ValueError(f"{path}: not a history shard of format 1 with {self.num_shards} "
                             f"shards (rollout.history_shards changed?)")
        return list(raw["prompts"].values())

    # ----------------------------------------------------------------- access
    def put(self, states: Iterable[Dict[str, Any]]) -> int:
        """Store exported histories (each replaces its prompt's entry) and write their files;
        returns the bytes written. Every state is checked before any is stored."""
        states = list(states)
        pids = [check_state(s) for s in states]
        t0 = time.perf_counter()
        written = 0
        for pid, state in zip(pids, states):
            path = self.path(pid)
            path.parent.mkdir(exist_ok=True)
            data = pickle.dumps({"format": FORMAT, "prompt_id": pid, "state": state}, protocol=5)
            _write_atomic(path, data)
            written += len(data)
            self._remember(pid, state)
        self.bytes_written += written
        self.write_s += time.perf_counter() - t0
        return written

    def get(self, prompt_ids: Iterable[str]) -> List[Dict[str, Any]]:
        """The stored histories of ``prompt_ids``, in that order; prompts without one are left
        out."""
        out = []
        for pid in prompt_ids:
            state = self._load(pid)
            if state is not None:
                out.append(state)
        return out

    def predicted_length(self, prompt_id: str) -> Optional[float]:
        """Mean length of the prompt's stored real responses, or None."""
        state = self._load(prompt_id)
        return mean_response_length(state) if state is not None else None

    def __len__(self) -> int:
        """Prompts stored (counts the files)."""
        return sum(1 for d in self.dir.glob("shard-*") if d.is_dir() for _ in d.glob("*.pkl"))

    def __contains__(self, prompt_id: str) -> bool:
        return prompt_id in self._cache or self.path(prompt_id).exists()

    # ----------------------------------------------------------------- internals
    def _remember(self, pid: str, state: Dict[str, Any]) -> None:
        self._cache[pid] = state
        self._cache.move_to_end(pid)
        while len(self._cache) > self.cache_prompts:
            self._cache.popitem(last=False)

    def _load(self, pid: str) -> Optional[Dict[str, Any]]:
        state = self._cache.get(pid)
        if state is not None:
            self._cache.move_to_end(pid)
            return state
        path = self.path(pid)
        if not path.exists():
            return None
        t0 = time.perf_counter()
        data = path.read_bytes()
        raw = pickle.loads(data)
        if not isinstance(raw, dict) or raw.get("format") != FORMAT or raw.get("prompt_id") != pid:
            raise ValueError(f"{path}: not the history of {pid!r} in format {FORMAT}")
        self.bytes_read += len(data)
        self.read_s += time.perf_counter() - t0
        self._remember(pid, raw["state"])
        return raw["state"]
