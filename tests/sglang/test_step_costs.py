"""Saved step costs: the cost model's table survives an engine restart (file round trip)."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

from rhyme_sglang.core.cost_model import PLAIN, SpecCostModel
from rhyme_sglang.sglang_ext import step_costs


@pytest.fixture()
def cost_file(tmp_path, monkeypatch):
    path = tmp_path / "costs" / "step_costs.json"
    monkeypatch.setenv(step_costs.PATH_ENV, str(path))
    return path


def _measured() -> SpecCostModel:
    model = SpecCostModel(widths=(1, 2, 4, 8, 16))
    for bs, width, seconds in [(1, PLAIN, 0.07), (1, 4, 0.09), (3, PLAIN, 0.12), (3, 8, 0.4),
                               (8, PLAIN, 0.2)]:
        model.observe_step(bs, width, seconds)
    return model


def test_table_and_seed_round_trip():
    model = _measured()
    fresh = SpecCostModel(widths=(1, 2, 4, 8, 16))
    fresh.seed(model.table())
    assert fresh.table() == pytest.approx(model.table())
    for bs in (1, 2, 4, 8):  # a cell is saved at its bucket's size (3 requests -> bucket 4)
        for w in fresh.candidates:
            assert fresh.step_time(bs, w) == model.step_time(bs, w)
    expected = {1: 0.3, 2: 0.6, 4: 0.9, 8: 1.0, 16: 1.0}
    assert fresh.decide(4, expected=expected).width == PLAIN  # its own baseline first
    fresh.observe_step(4, PLAIN, model.step_time(4, PLAIN))
    model.observe_step(4, PLAIN, model.step_time(4, PLAIN))
    assert fresh.decide(4, expected=expected).width == model.decide(4, expected=expected).width


def test_ragged_cells_keep_their_rows_through_the_file(cost_file):
    """A per-request verify cell measured at 3 rows per request must not come back as a
    full-width (9 rows) cell: rows would then look three times cheaper than they cost."""
    model = SpecCostModel(widths=(8,))
    model.observe_step(4, PLAIN, 0.2)
    model.observe_step(4, 8, 0.5, rows=12)  # 4 requests, 12 rows: 3 per request
    assert model.rows_table() == {(4, PLAIN): 1.0, (4, 8): 3.0}
    cache = step_costs.StepCostCache("k")
    cache.observed(model)
    cache.flush(model)
    assert step_costs.load_rows("k") == {(4, PLAIN): 1.0, (4, 8): 3.0}
    warm = SpecCostModel(widths=(8,))
    assert step_costs.StepCostCache("k").seed(warm) == 2
    assert warm.rows_table() == model.rows_table()
    for extra in (4, 8, 20):
        assert warm.step_time_rows(4, extra) == pytest.approx(model.step_time_rows(4, extra))
    full = SpecCostModel(widths=(8,))
    full.seed(step_costs.load("k"))  # without the rows: the old, wrong reading
    assert full.step_time_rows(4, 8) < 0.7 * model.step_time_rows(4, 8)


def test_context_costs_go_through_the_file(cost_file):
    """Cells are saved context-free with the fitted context costs: a table written by a
    long-context rollout prices a short chat's steps at the chat's contexts (stop 42: cells
    saved at ~1000-token contexts read 47-92 ms at batch 1 against a 25 ms plain step)."""
    model = SpecCostModel(widths=(4,))
    rng = np.random.default_rng(0)
    for i in range(300):  # contexts grow from 100 to 1600 tokens
        ctx = [100 + 5 * i, 140 + 5 * i]
        w = (0, 4)[i % 3 == 0]
        sec = 0.03 + 7e-6 * sum(ctx) + 2.4e-6 * w * sum(ctx) + 0.004 * w
        model.observe_step(2, w, sec * (1 + 0.02 * rng.standard_normal()), contexts=ctx)
    c_keys, c_rows = model.context_coefficients()
    assert c_keys > 3e-6 and c_rows > 1e-6
    cache = step_costs.StepCostCache("k")
    cache.observed(model)
    cache.flush(model)
    assert step_costs.load_context("k") == pytest.approx((c_keys, c_rows))
    warm = SpecCostModel(widths=(4,))
    assert step_costs.StepCostCache("k").seed(warm) == 2
    assert warm.context_coefficients() == pytest.approx((c_keys, c_rows))
    for keys in (200, 3000):  # the same estimate at a short and a long context
        for w in (PLAIN, 4):
            assert warm.step_time(2, w, keys) == pytest.approx(model.step_time(2, w, keys))
    short = 0.03 + 7e-6 * 200 + (2.4e-6 * 4 * 200 + 0.016)
    assert warm.step_time(2, 4, 200) == pytest.approx(short, rel=0.25)
    # a malformed context is ignored (the cells still seed)
    data = json.loads(cost_file.read_text())
    data["k"]["context"] = [-1, "x"]
    cost_file.write_text(json.dumps(data))
    assert step_costs.load_context("k") is None
    assert step_costs.StepCostCache("k").seed(SpecCostModel(widths=(4,))) == 2


def test_file_round_trip_keeps_other_keys(cost_file):
    model = _measured()
    assert step_costs.save("a", model.table(), {"dtype": "float32"})
    assert step_costs.save("b", {(1, 0): 0.5})
    assert step_costs.load("a") == pytest.approx(model.table())
    assert step_costs.load("b") == {(1, 0): 0.5}
    assert step_costs.load("missing") == {}
    data = json.loads(cost_file.read_text())
    assert data["a"]["dtype"] == "float32" and "1:0" in data["a"]["seconds"]


def test_unreadable_or_bad_entries_cost_only_the_warm_start(cost_file):
    cost_file.parent.mkdir(parents=True)
    cost_file.write_text("not json")
    assert step_costs.load("a") == {}
    cost_file.write_text(json.dumps({"a": {"seconds": {"1:0": 0.1, "x:1": 2, "2:4": -1,
                                                       "4:2": "slow", "8:-1": 0.3}}}))
    assert step_costs.load("a") == {(1, 0): 0.1}
    assert step_costs.save("a", {(1, 0): 0.2})  # a corrupt file is replaced, not fatal
    assert step_costs.load("a") == {(1, 0): 0.2}


def test_unwritable_location_is_not_an_error(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv(step_costs.PATH_ENV, str(blocker / "sub" / "step_costs.json"))
    assert step_costs.save("a", {(1, 0): 0.1}) is False
    assert step_costs.load("a") == {}


def test_cache_seeds_a_new_engine_and_saves_rate_limited(cost_file):
    first = step_costs.StepCostCache("k", every_s=3600)
    model = SpecCostModel()
    assert first.seed(model) == 0
    model.observe_step(2, PLAIN, 0.1)
    first.observed(model)
    assert not cost_file.exists()  # rate-limited: nothing written within every_s
    first.flush(model)
    second, warm = step_costs.StepCostCache("k"), SpecCostModel()
    assert second.seed(warm) == 1 and warm.step_time(2, PLAIN) == pytest.approx(0.1)
    # a warm model measures its own plain baseline first, as a cold one does (a seed is a
    # prior), then keeps the seeded cells instead of exploring them anew
    assert warm.decide(2, expected={1: 1.5}).width == PLAIN
    warm.observe_step(2, PLAIN, 0.1)
    warm.observe_step(2, 1, 0.11)
    assert warm.decide(2, expected={1: 1.5}).width == 1
    # a later engine's measurements replace the saved cell (one step moves it at most x2);
    # cells it never ran are kept
    warm.observe_step(2, PLAIN, 0.3)
    second.observed(warm)
    second.flush(warm)
    saved = step_costs.load("k")
    assert saved[(2, PLAIN)] == pytest.approx(0.8 * 0.1 + 0.2 * 0.2) and (2, 1) in saved
    narrow = SpecCostModel(widths=(4,))
    assert step_costs.StepCostCache("k").seed(narrow) == 1  # width 1 is not among its widths


def test_key_depends_on_what_sets_the_cost():
    shape = step_costs.model_shape(types.SimpleNamespace(
        model_type="llama", hidden_size=576, num_hidden_layers=30, vocab_size=49152,
        rope_scaling={"type": "x"}))
    assert shape == {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30,
                     "vocab_size": 49152}
    key = step_costs.table_key(shape, "float32", 1, "cpu")
    assert key == step_costs.table_key(dict(shape), "float32", 1, "cpu")
    assert len({key, step_costs.table_key(shape, "bfloat16", 1, "cpu"),
                step_costs.table_key(shape, "float32", 2, "cpu"),
                step_costs.table_key({**shape, "num_hidden_layers": 2}, "float32", 1, "cpu"),
                step_costs.table_key(shape, "float32", 1, "cpu", "gemm-r7-attention-r2-avx512"),
                step_costs.table_key(shape, "float32", 1, "cpu", "gemm-r8-attention-r2-avx512")}) == 6
    # entries saved before cells kept their rows / were context-free are not read
    step_costs.FORMAT, saved = 1, step_costs.FORMAT
    try:
        assert step_costs.table_key(shape, "float32", 1, "cpu") != key
    finally:
        step_costs.FORMAT = saved


def test_the_flag_turns_it_off():
    from rhyme_sglang.sglang_ext.config import RhymeConfig

    assert RhymeConfig().cost_cache is True
    config, rest = RhymeConfig.pop_from_argv(["--rhyme-cost-cache", "0", "--port", "1"])
    assert config.cost_cache is False and rest == ["--port", "1"]
    assert RhymeConfig.from_env(RhymeConfig(cost_cache=False).to_env({})).cost_cache is False


def test_an_engines_entry_from_its_server_args_and_model_runner():
    hf = types.SimpleNamespace(model_type="qwen2", hidden_size=128, num_hidden_layers=2)
    runner = types.SimpleNamespace(model_config=types.SimpleNamespace(hf_config=hf))
    args = types.SimpleNamespace(device="cpu", dtype="float32")
    cache = step_costs.StepCostCache.for_engine(args, runner)
    assert cache.about["model"] == {"model_type": "qwen2", "hidden_size": 128,
                                    "num_hidden_layers": 2}
    assert cache.about["device"] == "cpu" and cache.about["dtype"] == "float32"
    from rhyme_sglang.cpu_backend.native_step import revisions

    assert cache.about["kernels"] == revisions()  # a kernel change, another entry
    assert cache.key == step_costs.table_key(cache.about["model"], "float32",
                                             cache.about["threads"], "cpu", revisions())
    from rhyme_sglang import machine

    machine.set_kernel_threads(machine.kernel_threads() + 1)  # other kernel threads, other entry
    try:
        assert step_costs.StepCostCache.for_engine(args, runner).key != cache.key
    finally:
        machine.set_kernel_threads(None)
