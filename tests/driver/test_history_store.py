"""The driver's per-prompt history store (rl_driver/history_store.py): shard round trip,
atomic shard writes, bad input, unknown ids."""

from __future__ import annotations

import pickle

import pytest

from rl_driver.history_store import HistoryStore, mean_response_length, shard_of


def state(pid, lengths, run_ahead=()):
    records = [{"epoch": 0, "sample": k, "response": list(range(n)), "reward": 1.0, "rid": None}
               for k, n in enumerate(lengths)]
    records += [{"epoch": 0, "sample": k, "response": [1] * n, "reward": None, "rid": None,
                 "run_ahead": True} for k, n in enumerate(run_ahead)]
    return {"format": 1, "prompt_id": pid, "prompt_tail": [1, 2], "epoch": 0, "records": records}


def test_round_trip_across_shards(tmp_path):
    store = HistoryStore(tmp_path, num_shards=4)
    states = [state(f"p{i}", [i + 1, i + 3]) for i in range(12)]
    written = store.put(states)
    assert written == store.bytes_written > 0 and store.write_s > 0
    assert len({shard_of(s["prompt_id"], 4) for s in states}) > 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"shard-{k:03d}.pkl" for k in {shard_of(s["prompt_id"], 4) for s in states})
    again = HistoryStore(tmp_path, num_shards=4)  # a resumed run loads the shards back
    assert again.get([f"p{i}" for i in range(12)]) == states
    assert again.bytes_read == written and len(again) == 12 and "p3" in again
    store.put([state("p3", [9])])  # a put replaces the prompt's entry
    assert HistoryStore(tmp_path, num_shards=4).get(["p3"]) == [state("p3", [9])]


def test_get_unknown_ids_and_predicted_length(tmp_path):
    store = HistoryStore(tmp_path)
    store.put([state("a", [2, 4], run_ahead=[50])])
    assert store.get(["nope", "a", "other"]) == [state("a", [2, 4], run_ahead=[50])]
    assert store.get(["nope"]) == []
    assert store.predicted_length("a") == 3.0  # run-ahead drafts left out
    assert store.predicted_length("nope") is None
    assert mean_response_length(state("b", [], run_ahead=[5])) is None


def test_crash_mid_write_keeps_the_old_shard(tmp_path, monkeypatch):
    store = HistoryStore(tmp_path, num_shards=1)
    store.put([state("a", [3])])

    def crash(*args, **kwargs):
        raise OSError("disk gone mid-write")

    import rl_driver.history_store as hs

    monkeypatch.setattr(hs.os, "replace", crash)  # the temporary file is written, never renamed
    with pytest.raises(OSError):
        store.put([state("a", [7]), state("b", [1])])
    monkeypatch.undo()
    assert (tmp_path / "shard-000.pkl.tmp").exists()
    assert HistoryStore(tmp_path, num_shards=1).get(["a", "b"]) == [state("a", [3])]


@pytest.mark.parametrize("bad, needle", [
    ("text", "str"), ({"prompt_id": "", "records": []}, "''"),
    ({"prompt_id": "x", "records": None}, "None"), ({"records": []}, "None")])
def test_bad_input(tmp_path, bad, needle):
    store = HistoryStore(tmp_path)
    with pytest.raises(ValueError, match=needle):
        store.put([state("ok", [1]), bad])
    assert store.get(["ok"]) == []  # nothing stored when any state is bad


def test_bad_shards(tmp_path):
    with pytest.raises(ValueError, match="0"):
        HistoryStore(tmp_path, num_shards=0)
    HistoryStore(tmp_path, num_shards=2).put([state("a", [1])])
    with pytest.raises(ValueError, match="history_shards"):
        HistoryStore(tmp_path, num_shards=3)
    (tmp_path / "shard-000.pkl").write_bytes(pickle.dumps({"format": 9}))
    with pytest.raises(ValueError, match="format"):
        HistoryStore(tmp_path, num_shards=2)
