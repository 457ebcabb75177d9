"""Snapshots round-trip exactly; corrupt or foreign files are rejected, leaving the store alone."""

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import BACKENDS, tokens
from rhyme_sglang.core import DraftStore, StoreConfig


def _drafts(s, contexts):
    out = []
    for i, ctx in enumerate(contexts):
        s.start_request(f"q{i}", [7, 8, i % 2], f"p{i % 2}")
        s.add_tokens(f"q{i}", ctx)
        out.append(s.speculate(f"q{i}", 6))
        s.finish_request(f"q{i}", add_to_history=False)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=15, deadline=None)
@given(resp=st.lists(st.tuples(st.integers(0, 1), tokens, st.floats(-1, 1)), min_size=1, max_size=12),
       contexts=st.lists(st.lists(st.integers(0, 5), max_size=6), min_size=1, max_size=4))
def test_snapshot_round_trip_gives_same_drafts(tmp_path_factory, backend, resp, contexts):
    path = str(tmp_path_factory.mktemp("snap") / "store.rds")
    s = DraftStore(StoreConfig(max_depth=8, max_pattern=4, epoch_decay=0.7), backend=backend)
    for i, (p, seq, r) in enumerate(resp):
        s.add_response(f"p{p}", [7, 8, p], seq, i // 4, r)
        if i % 4 == 3:
            s.advance_epoch()
    s.save(path)
    t = DraftStore(backend=backend)
    t.load(path)
    assert t.check_integrity() and t.epoch == s.epoch and t.config == s.config
    assert [(r.key, r.epoch, r.sample, list(r.seq), r.weight) for r in t.records()] == \
        [(r.key, r.epoch, r.sample, list(r.seq), r.weight) for r in s.records()]
    assert _drafts(t, contexts) == _drafts(s, contexts)


def test_corrupt_and_foreign_files_are_rejected(tmp_path):
    s = DraftStore(backend="python")
    s.add_response("p", [1, 2], [3, 4, 5], 0)
    good = str(tmp_path / "good.rds")
    s.save(good)
    live = DraftStore(backend="python")
    live.add_response("mine", [9], [9, 9], 0)
    data = open(good, "rb").read()
    cases = {"foreign": b"PK\x03\x04 definitely a zip file" * 3, "short": data[:10],
             "truncated": data[:-3], "flipped": data[:-1] + bytes([data[-1] ^ 0xFF]),
             "version": data[:8] + b"\x63\x00\x00\x00" + data[12:]}
    for name, blob in cases.items():
        bad = tmp_path / f"{name}.rds"
        bad.write_bytes(blob)
        with pytest.raises(ValueError):
            live.load(str(bad))
        assert [r.key for r in live.records()] == ["mine"] and live.check_integrity()
    assert not [f for f in os.listdir(tmp_path) if ".tmp." in f]


def test_load_refuses_with_active_requests(tmp_path):
    s = DraftStore(backend="python")
    s.save(str(tmp_path / "s.rds"))
    s.start_request("r", [1])
    with pytest.raises(ValueError, match="active requests"):
        s.load(str(tmp_path / "s.rds"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_snapshot_of_format_version_1_still_loads(backend):
    """snapshots/store_v1.rds was written by the code before the store owned its state
    (`to_state`) and the trie's update was split: loading it gives the store that the same
    responses build today, record for record and draft for draft."""
    def build():
        s = DraftStore(StoreConfig(max_depth=8, max_pattern=4, epoch_decay=0.7), backend=backend)
        for epoch in range(3):
            for i in range(6):
                s.add_response(f"p{i % 2}", [7, 8, i % 2],
                               [(3 * i + epoch + k) % 5 for k in range(12)], epoch,
                               reward=float(i % 3) - 1.0)
            if epoch < 2:
                s.advance_epoch()
        return s

    fresh = build()
    loaded = DraftStore(backend=backend)
    loaded.load(os.path.join(os.path.dirname(__file__), "snapshots", "store_v1.rds"))
    assert loaded.check_integrity() and loaded.config == fresh.config
    assert loaded.to_state() == fresh.to_state()
    contexts = [[1, 2], [4, 0, 1], [3]]
    assert _drafts(loaded, contexts) == _drafts(fresh, contexts)


def test_state_round_trips_without_a_file():
    s = DraftStore(StoreConfig(max_depth=6, max_pattern=4), backend="python")
    s.add_response("p", [1, 2], [3, 4, 5, 3, 4], 0, reward=1.0)
    s.add_response("p", [1, 2], [3, 4, 6], 0, reward=0.0)
    t = DraftStore.from_state(s.to_state(), backend="python")
    assert t.to_state() == s.to_state() and t.check_integrity()
    bad = dict(s.to_state(), records=[dict(r, key="nobody") for r in s.to_state()["records"]])
    with pytest.raises(ValueError, match="unknown prompts"):
        DraftStore.from_state(bad, backend="python")
