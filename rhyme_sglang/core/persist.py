"""Snapshot files: a draft store's state (``DraftStore.to_state``) as one versioned, checksummed,
atomically written file, and back.

Layout: MAGIC (8 bytes) | version u32 | payload length u64 | crc32 u32 | payload, where payload is
zlib-compressed JSON of the state; the records' token arrays (``records[i]["seq"]``) are stored
as base64 of little-endian int32. Loading rebuilds the tries from the records; integer weights
make the rebuilt tries, and so the drafts, identical to the saved store's.
"""

from __future__ import annotations

import base64
import json
import os
import struct
import sys
import zlib
from array import array

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


def write_snapshot(path: str, state: dict) -> None:
    """Write `state` to `path` atomically (temp file in the same directory + os.replace)."""
    records = [dict(r, seq=_encode(r["seq"])) for r in state["records"]]
    payload = zlib.compress(json.dumps(dict(state, records=records),
                                       separators=(",", ":")).encode("utf-8"), 6)
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


def read_snapshot(path: str) -> dict:
    """The state saved at `path`; ValueError for foreign, truncated or corrupt files."""
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
        state = json.loads(zlib.decompress(payload).decode("utf-8"))
        state["records"] = [dict(r, seq=_decode(r["seq"])) for r in state["records"]]
    except (zlib.error, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError,
            ValueError) as exc:
        raise ValueError(f"{path}: snapshot payload cannot be decoded ({exc})") from None
    return state
