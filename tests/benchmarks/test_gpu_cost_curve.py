"""The step-cost table script: the decoder's cache/mask math, the CPU run, the roofline model."""

import json

import pytest

from benchmarks import gpu_cost_curve as g

torch = pytest.importorskip("torch")


def test_verify_step_logits_match_plain_decode_for_the_first_new_token():
    # Query 0 of a verify step sees exactly what a plain decode step of the same token sees:
    # checks the causal mask against the cache and the GQA head stacking.
    shape = g.model_shape("tiny")
    dec = g.Decoder(shape, "cpu", torch.float32, max_batch=2, context=8, max_new=4, seed=1)
    ids = torch.randint(0, shape["vocab"], (2, 4))
    wide = dec.forward(ids)
    plain = dec.forward(ids[:, :1])
    assert wide.shape == (2, 4, shape["vocab"])
    torch.testing.assert_close(wide[:, 0], plain[:, 0], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(wide[:, 1], plain[:, 0])


def test_tiny_cpu_run_writes_a_complete_table(tmp_path, capsys):
    out = tmp_path / "cost.json"
    assert g.main(["--device", "cpu", "--tiny", "--iters", "1", "--json", str(out)]) == 0
    table = json.loads(out.read_text())
    assert table["format"] == g.FORMAT and table["kind"] == "measurement"
    assert {(p["context"], p["batch_size"], p["width"]) for p in table["points"]} == \
        {(c, b, w) for c in (16, 64) for b in (1, 2, 4) for w in (0, 2)}
    assert all(p["status"] == "ok" and p["seconds"] > 0 for p in table["points"])
    assert "points" in capsys.readouterr().out


def test_time_budget_stops_early_and_records_the_skipped_points():
    shape = g.model_shape("tiny")
    table = g.measure(shape, "cpu", contexts=(16,), batches=(1, 2), widths=(0,), budget_s=1e-9,
                      iters=1)
    assert [p["status"] for p in table["points"]] == ["skipped: time budget"] * 2


def test_roofline_is_weight_bound_at_small_batch_and_compute_bound_when_wide():
    shape = g.model_shape("qwen2-7b")
    assert 7.0e9 < shape["params"] < 8.0e9
    h200, a = g.GPUS["h200"], g.ROOFLINE_ASSUMPTIONS
    t1 = g.roofline_seconds(shape, h200, 1, 0, 1024)
    weights_s = 2 * g._matmul_params(shape) / (h200["hbm_bytes_per_s"] * a["bandwidth_efficiency"])
    assert weights_s + a["step_overhead_s"] < t1 < 1.05 * weights_s + a["step_overhead_s"]
    # more context per request costs KV reads; a 4096-token verify is compute bound
    assert g.roofline_seconds(shape, h200, 64, 0, 16384) > g.roofline_seconds(shape, h200, 64, 0, 1024)
    wide = g.roofline_seconds(shape, h200, 256, 15, 1024)
    assert wide > 5 * g.roofline_seconds(shape, h200, 256, 0, 1024)
    # H100 has less bandwidth: slower when memory bound, equal when compute bound
    assert g.roofline_seconds(shape, g.GPUS["h100"], 1, 0, 1024) > t1
    h100_wide = g.roofline_seconds(shape, g.GPUS["h100"], 256, 15, 1024)
    assert h100_wide == pytest.approx(wide, rel=0.05)


def test_shipped_roofline_tables_are_labelled_models_and_match_the_generator():
    for gpu in ("h100", "h200"):
        with open(f"benchmarks/data/cost_{gpu}_roofline.json") as fh:
            shipped = json.load(fh)
        assert shipped["kind"] == "model, not measurement"
        assert shipped == json.loads(json.dumps(g.roofline_table(gpu, g.model_shape(
            shipped["model"]["name"]))))


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown model"):
        g.model_shape("gpt-5")
    with pytest.raises(ValueError, match="unknown GPU"):
        g.roofline_table("a100", g.model_shape("tiny"))


def test_both_attention_forms_give_the_same_logits():
    shape = g.model_shape("tiny")
    dec = g.Decoder(shape, "cpu", torch.float32, max_batch=2, context=8, max_new=4, seed=2)
    ids = torch.randint(0, shape["vocab"], (2, 4))
    stacked, plain = dec.forward(ids), dec.forward(ids[:, :1])
    dec.attention_form = "gqa"
    torch.testing.assert_close(dec.forward(ids), stacked, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dec.forward(ids[:, :1]), plain, rtol=1e-4, atol=1e-5)
    for width in (0, 3):
        record = g._time_forms(dec, 2, width, "cpu", 1, False)
        assert set(record["seconds_by_attention"]) == {"stacked", "gqa"}
        assert record["seconds"] == min(record["seconds_by_attention"].values())
        assert dec.attention_form == "stacked"
