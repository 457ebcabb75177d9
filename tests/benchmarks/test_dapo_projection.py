"""DAPO-shaped history projection (benchmarks.dapo_projection) and bench_store's bytes per token."""

import json

import pytest

from benchmarks import bench_store as bs
from benchmarks import dapo_projection as dp
from rhyme_sglang.core.native import native_available

GIB = 2 ** 30
MEAS = {"serialized_bytes_per_token": 3.0, "serialize_bytes_per_s": 3e8,
        "import_tokens_per_s": 2e6, "export_tokens_per_s": 5e7}


def test_history_tokens_count_visits_in_the_window():
    s = dp.Shape(prompts=100, batch=10, samples=4, length=1000, epochs_seen=5)
    assert s.history_tokens(1) == 4000
    assert s.history_tokens(None) == 20000
    assert s.history_tokens(9) == 20000  # no more visits than were made
    with pytest.raises(ValueError):
        dp.Shape(batch=0)


def test_in_engine_memory_by_hand():
    s = dp.Shape(prompts=1000, batch=100, samples=2, length=500, epochs_seen=2)
    got = dp.in_engine(s, None, 4, 100.0)
    total = 1000 * (2 * 500 * 2) * 100.0  # prompts x history tokens x bytes per token
    copies = 4 * (1 - 0.75 ** 2)  # 1.75 engines served a prompt twice placed at random
    assert got["copies_random"] == pytest.approx(1.75)
    assert got["per_engine_gib_affinity"] == pytest.approx(total / 4 / GIB)
    assert got["per_engine_gib_random"] == pytest.approx(total * copies / 4 / GIB)


def test_per_step_transfer_by_hand():
    s = dp.Shape(prompts=1000, batch=100, samples=2, length=500, epochs_seen=3)
    got = dp.per_step(s, 1, 4, 100.0, MEAS, link_bytes_per_s=1e9, step_time_s=10.0)
    imp, exp = 100 * 1000, 100 * 1000  # window 1: history = one visit = the new responses
    moved = (imp + exp) * 3.0
    assert got["bytes_per_step"] == pytest.approx(moved)
    assert got["serialize_s"] == pytest.approx(moved / 3e8)
    assert got["link_s"] == pytest.approx(moved / 1e9)
    assert got["store_s"] == pytest.approx((imp / 2e6 + exp / 5e7) / 4)
    crit = moved / 3e8 + moved / 1e9 + (imp / 2e6 + exp / 5e7) / 4
    assert got["critical_s"] == pytest.approx(crit)
    assert got["share_of_step"] == pytest.approx(crit / 10.0)
    assert got["per_engine_gib"] == pytest.approx(25 * (2 * 1000 + 1000) * 100.0 / GIB)


def test_project_gives_one_row_per_combination():
    rows = dp.project(MEAS, 200.0, [4096, 8192], [8, 64], [1, None], [10, 1.25], 600.0)
    assert len(rows) == 16
    r = rows[0]
    assert (r["length"], r["engines"], r["window"], r["link_gbps"]) == (4096, 8, 1, 10)
    assert r["per_step"]["link_s"] == pytest.approx(rows[1]["per_step"]["link_s"] / 8)  # 10 vs 1.25


def test_measure_reports_the_store_footprint_and_moves_every_response():
    rollouts = bs.make_rollouts(32, 200, 8, 0.01, seed=3)
    backend = "native" if native_available() else "python"
    got = dp.measure(rollouts, backend, repeats=1)
    direct = bs.store_footprint(bs.filled_store(rollouts, backend), 32 * 200)
    assert got["bytes_per_token"] == pytest.approx(direct["bytes_per_token"])
    assert got["responses"] == 32 and got["prompts"] == 4
    assert got["serialized_bytes_per_token"] > 1.0  # at least a byte per pickled token id
    assert got["import_tokens_per_s"] > 0 and got["serialize_bytes_per_s"] > 0


def test_cli_prints_the_table_and_writes_assumptions(tmp_path, capsys):
    out_path = tmp_path / "dapo.json"
    assert dp.main(["--engines", "8", "--link-gbps", "10", "--json", str(out_path)]) == 0
    out = json.loads(out_path.read_text())
    assert out["assumptions"]["step_time_s"] == 600.0
    assert out["assumptions"]["shape"]["prompts"] == 17000
    assert len(out["rows"]) == 4  # 2 lengths x 1 engine count x 2 windows x 1 link
    assert out["assumptions"]["bytes_per_token"] == out["measured"]["bytes_per_token"]
    assert "share" in capsys.readouterr().out


def test_bench_store_reports_bytes_per_token_per_backend(tmp_path):
    out_path = tmp_path / "store.json"
    assert bs.main(["--responses", "64", "--length", "100", "--python-responses", "16",
                    "--queries", "8", "--inflight", "0", "--json", str(out_path)]) == 0
    out = json.loads(out_path.read_text())
    backends = {r["backend"] for r in out["results"]}
    assert set(out["bytes_per_token"]) == backends and "python" in backends
    for r in out["results"]:
        assert {"insert_tokens_per_s", "speculate_us_p50", "estimate_memory_mb"} <= set(r)
        assert r["bytes_per_token"] == out["bytes_per_token"][r["backend"]]
        assert 4.0 < r["bytes_per_token"] < 1e5  # at least the token itself, int32
        assert r["history_bytes_per_token"] <= r["bytes_per_token"]
