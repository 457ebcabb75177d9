"""Snapshots of a DraftStore's history in one versioned, checksummed, atomically written file.

Layout: MAGIC (8 bytes) | version u32 | payload length u64 | crc32 u32 | payload, where payload is
zlib-compressed JSON; token arrays are base64 little-endian int32. Active requests are not saved.
Loading rebuilds the tries from the records; integer weights make the rebuilt tries, and so the
drafts, identical to the saved store's.
"""

from __future__ import annotations

import base64
import json
import os
import struct
import sys
import zlib
from array import array
from dataclasses import asdict

from .config import StoreConfig, WindowConfig
from .history import PromptHistory, ResponseRecord

MAGIC = b"RHYMEDS\x00"
VERSION = 1
_HEADER = struct.Struct("<8sIQI")


def _encode(tokens: array) -> str:
    arr = array("i", tokens)
    if sys.byteorder != "little":
        arr.byteswap()
    return base64.b64encode(arr.tobytes()).decode("ascii")


def _decode(text: str) -> array:
    arr = array("i")
    arr.frombytes(base64.b64decode(text.encode("ascii"), validate=True))
    if sys.byteorder != "little":
        arr.byteswap()
    return arr


def save_store(store, path: str) -> None:
    """Write `store` to `path` atomically (temp file in the same directory + os.replace)."""
    store._flush()
    state = {
        "config": asdict(store.config),
        "epoch": store.epoch,
        "epoch_origin": store.epoch_origin,
        "prompts": [{"key": ph.key, "tail": list(ph.prompt_tail)} for ph in store._prompts.values()],
        "records": [{"key": r.key, "epoch": r.epoch, "sample": r.sample, "seq": _encode(r.seq),
                     "len": r.response_len, "reward": r.reward, "factor": r.factor,
                     "weight": r.weight, "rid": r.request_id, "global": r.in_global}
                    for r in store.records()],
        "dirty_open": sorted([list(g) for g in store._dirty_open]),
        "lengths": store.lengths.to_state(),
    }
    payload = zlib.compress(json.dumps(state, separators=(",", ":")).encode("utf-8"), 6)
    header = _HEADER.pack(MAGIC, VERSION, len(payload), zlib.crc32(payload))
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as fh:
            fh.write(header)
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_payload(path: str) -> dict:
    """The decoded snapshot state; ValueError for foreign, truncated or corrupt files."""
    with open(path, "rb") as fh:
        data = fh.read()
    if len(data) < _HEADER.size:
        raise ValueError(f"{path}: too short to be a draft-store snapshot")
    magic, version, length, crc = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ValueError(f"{path}: not a draft-store snapshot (no snapshot header)")
    if version != VERSION:
        raise ValueError(f"{path}: snapshot version {version} is not supported (expected {VERSION})")
    payload = data[_HEADER.size:]
    if len(payload) != length or zlib.crc32(payload) != crc:
        raise ValueError(f"{path}: snapshot is truncated or corrupt (checksum mismatch)")
    try:
        return json.loads(zlib.decompress(payload).decode("utf-8"))
    except (zlib.error, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: snapshot payload cannot be decoded ({exc})") from None


def load_store(path: str, backend: str = "auto"):
    """A new DraftStore rebuilt from the snapshot at `path`."""
    from .store import DraftStore
    state = read_payload(path)
    try:
        cfg = dict(state["config"])
        cfg["window"] = WindowConfig(**cfg["window"])
        store = DraftStore(StoreConfig(**cfg), backend=backend)
        store.epoch, store.epoch_origin = int(state["epoch"]), int(state["epoch_origin"])
        for p in state["prompts"]:
            store._prompts[p["key"]] = PromptHistory(p["key"], [int(t) for t in p["tail"]],
                                                     store._new_trie())
        for r in state["records"]:
            rec = ResponseRecord(r["key"], int(r["epoch"]), int(r["sample"]), _decode(r["seq"]),
                                 int(r["len"]), r["reward"], float(r["factor"]), int(r["weight"]),
                                 r["rid"], bool(r["global"]))
            ph = store._prompts[rec.key]
            ph.group(rec.epoch).append(rec)
            store._apply(rec, 1, rec.weight)
            store._num_records += 1
            store._num_tokens += len(rec.seq)
            if rec.request_id is not None:
                store._finished[rec.request_id] = rec
            if not rec.in_global:
                store._pending_global.append(rec)
        store._recount_trie_bytes()
        store._dirty_open = {(k, int(e)) for k, e in state["dirty_open"]}
        store.lengths.load_state(state["lengths"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: snapshot content is invalid ({type(exc).__name__}: {exc})") from None
    return store
