"""The driver's per-prompt history store (rl_driver/history_store.py): round trip, a file per
prompt written atomically, a bounded cache, the first format converted, bad input, unknown
ids."""

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


def _files(root):
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.pkl"))


def test_round_trip_across_shards(tmp_path):
    store = HistoryStore(tmp_path, num_shards=4)
    states = [state(f"p{i}", [i + 1, i + 3]) for i in range(12)]
    written = store.put(states)
    assert written == store.bytes_written > 0 and store.write_s > 0
    assert len({shard_of(s["prompt_id"], 4) for s in states}) > 1
    assert _files(tmp_path) == sorted(store.path(s["prompt_id"]).relative_to(tmp_path).as_posix()
                                      for s in states)  # one file per prompt, in its shard
    assert all(store.path(f"p{i}").parent.name == f"shard-{shard_of(f'p{i}', 4):03d}"
               for i in range(12))
    again = HistoryStore(tmp_path, num_shards=4)  # a resumed run reads them back
    assert again.get([f"p{i}" for i in range(12)]) == states
    assert again.bytes_read == written and len(again) == 12 and "p3" in again
    before = store.path("p5").read_bytes()
    store.put([state("p3", [9])])  # a put replaces the prompt's entry, and writes its file only
    assert HistoryStore(tmp_path, num_shards=4).get(["p3"]) == [state("p3", [9])]
    assert store.path("p5").read_bytes() == before


def test_the_cache_is_bounded_and_reads_back(tmp_path):
    store = HistoryStore(tmp_path, cache_prompts=3)
    store.put([state(f"p{i}", [i + 1]) for i in range(10)])
    assert list(store._cache) == ["p7", "p8", "p9"]
    read = store.bytes_read
    assert store.get(["p0"]) == [state("p0", [1])] and store.bytes_read > read
    assert list(store._cache) == ["p8", "p9", "p0"] and store.predicted_length("p1") == 2.0
    with pytest.raises(ValueError, match="cache_prompts"):
        HistoryStore(tmp_path, cache_prompts=0)


def test_a_store_of_the_first_format_is_converted(tmp_path):
    shards = {}
    for i in range(6):
        shards.setdefault(shard_of(f"p{i}", 2), {})[f"p{i}"] = state(f"p{i}", [i + 2])
    for k, prompts in shards.items():  # as the first format wrote them
        (tmp_path / f"shard-{k:03d}.pkl").write_bytes(pickle.dumps(
            {"format": 1, "num_shards": 2, "prompts": prompts}))
    store = HistoryStore(tmp_path, num_shards=2)
    assert store.get([f"p{i}" for i in range(6)]) == [state(f"p{i}", [i + 2]) for i in range(6)]
    assert not list(tmp_path.glob("shard-*.pkl")) and len(store) == 6
    assert HistoryStore(tmp_path, num_shards=2).get(["p4"]) == [state("p4", [6])]


def test_get_unknown_ids_and_predicted_length(tmp_path):
    store = HistoryStore(tmp_path)
    store.put([state("a", [2, 4], run_ahead=[50])])
    assert store.get(["nope", "a", "other"]) == [state("a", [2, 4], run_ahead=[50])]
    assert store.get(["nope"]) == []
    assert store.predicted_length("a") == 3.0  # run-ahead drafts left out
    assert store.predicted_length("nope") is None
    assert mean_response_length(state("b", [], run_ahead=[5])) is None


def test_crash_mid_write_keeps_the_old_history(tmp_path, monkeypatch):
    store = HistoryStore(tmp_path, num_shards=1)
    store.put([state("a", [3])])

    def crash(*args, **kwargs):
        raise OSError("disk gone mid-write")

    import rl_driver.history_store as hs

    monkeypatch.setattr(hs.os, "replace", crash)  # the temporary file is written, never renamed
    with pytest.raises(OSError):
        store.put([state("a", [7]), state("b", [1])])
    monkeypatch.undo()
    assert store.path("a").with_name(store.path("a").name + ".tmp").exists()
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
    store = HistoryStore(tmp_path, num_shards=2)
    store.path("a").write_bytes(pickle.dumps({"format": 9}))
    with pytest.raises(ValueError, match="format"):
        HistoryStore(tmp_path, num_shards=2).get(["a"])
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "shard-000.pkl").write_bytes(pickle.dumps({"format": 9}))
    with pytest.raises(ValueError, match="format 1"):
        HistoryStore(tmp_path / "old", num_shards=1)
