"""``HistoryStore``: the driver's per-prompt RHYME history, kept outside the engines.

With ``rollout.history: per_step`` the engines hold only the current and the next step's
prompts; every other prompt's history lives here. A prompt's entry is the dict
``DraftStore.export_prompt`` returns (``rhyme_sglang.core.transfer``: ``format``,
``prompt_id``, ``prompt_tail``, ``epoch``, ``records``), as ``Engine.rhyme_export_histories``
hands it over, and goes back to an engine unchanged (``rhyme_import_history``).

Entries live in ``num_shards`` pickle files ``dir/shard-XXX.pkl``; a prompt's shard is a
stable hash of its id (blake2b, the same in every process). ``put`` rewrites each shard it
touches by writing a temporary file and renaming it over the old one, so a crash leaves either
the old or the new shard, never a torn one. A store opened on an existing folder loads every
shard (a resumed run continues with the saved history). ``bytes_written`` / ``bytes_read`` /
``write_s`` / ``read_s`` count the shard traffic.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

FORMAT = 1


def shard_of(prompt_id: str, num_shards: int) -> int:
    """The shard that holds ``prompt_id`` (stable across processes and runs)."""
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


class HistoryStore:
    """Per-prompt histories in ``num_shards`` atomic shard files under ``directory``."""

    def __init__(self, directory, num_shards: int = 16):
        if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
            raise ValueError(f"num_shards must be an int >= 1, got {num_shards!r}")
        self.dir = Path(directory)
        self.num_shards = num_shards
        self.bytes_written = self.bytes_read = 0
        self.write_s = self.read_s = 0.0
        self._shards: List[Dict[str, Dict[str, Any]]] = [{} for _ in range(num_shards)]
        self.dir.mkdir(parents=True, exist_ok=True)
        for k in range(num_shards):
            self._load(k)

    def path(self, shard: int) -> Path:
        return self.dir / f"shard-{shard:03d}.pkl"

    def _load(self, shard: int) -> None:
        path = self.path(shard)
        if not path.exists():
            return
        t0 = time.perf_counter()
        data = path.read_bytes()
        raw = pickle.loads(data)
        if not isinstance(raw, dict) or raw.get("format") != FORMAT or raw.get("num_shards") != self.num_shards:
            raise ValueError(f"{path}: not a history shard of format {FORMAT} with "
                             f"{self.num_shards} shards (rollout.history_shards changed?)")
        self._shards[shard] = dict(raw["prompts"])
        self.bytes_read += len(data)
        self.read_s += time.perf_counter() - t0

    def _write(self, shard: int) -> int:
        path = self.path(shard)
        data = pickle.dumps({"format": FORMAT, "num_shards": self.num_shards,
                             "prompts": self._shards[shard]}, protocol=5)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        return len(data)

    def put(self, states: Iterable[Dict[str, Any]]) -> int:
        """Store exported histories (each replaces its prompt's entry) and rewrite the shards
        they fall in; returns the bytes written. Every state is checked before any is stored."""
        states = list(states)
        pids = [check_state(s) for s in states]
        t0 = time.perf_counter()
        touched = set()
        for pid, state in zip(pids, states):
            k = shard_of(pid, self.num_shards)
            self._shards[k][pid] = state
            touched.add(k)
        written = sum(self._write(k) for k in sorted(touched))
        self.bytes_written += written
        self.write_s += time.perf_counter() - t0
        return written

    def get(self, prompt_ids: Iterable[str]) -> List[Dict[str, Any]]:
        """The stored histories of ``prompt_ids``, in that order; prompts without one are left
        out."""
        out = []
        for pid in prompt_ids:
            state = self._shards[shard_of(pid, self.num_shards)].get(pid)
            if state is not None:
                out.append(state)
        return out

    def predicted_length(self, prompt_id: str) -> Optional[float]:
        """Mean length of the prompt's stored real responses, or None."""
        state = self._shards[shard_of(prompt_id, self.num_shards)].get(prompt_id)
        return mean_response_length(state) if state is not None else None

    def __len__(self) -> int:
        return sum(len(s) for s in self._shards)

    def __contains__(self, prompt_id: str) -> bool:
        return prompt_id in self._shards[shard_of(prompt_id, self.num_shards)]
