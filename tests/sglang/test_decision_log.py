"""The decision log: set by RHYME_DECISION_LOG (the settings; conftest's monkeypatch re-reads
them), off (None) when unset, one JSON line per step, and it stops writing (with a warning)
where it cannot."""

import json

from rhyme_sglang.core.cost_model import Decision, SpecCostModel
from rhyme_sglang.sglang_ext.decision_log import DecisionLog


def test_unset_means_no_log(monkeypatch):
    monkeypatch.delenv("RHYME_DECISION_LOG", raising=False)
    assert DecisionLog.from_settings() is None


def test_one_line_per_step(monkeypatch, tmp_path):
    path = tmp_path / "decisions.jsonl"
    monkeypatch.setenv("RHYME_DECISION_LOG", str(path))
    log = DecisionLog.from_settings()
    cost = SpecCostModel(widths=(2,))
    cost.observe_step(2, 0, 0.05)
    cost.observe_step(2, 2, 0.07)
    log.record(cost, Decision(2, reason="best"), [[0.9, 0.5], []], [10, 20], 0.06, 1)
    log.record(cost, Decision(0, reason="rest"), [[], []], [11, 21], 0.05, 0)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(x["width"], x["rows"], x["reason"]) for x in lines] == [(2, 4, "best"), (0, 2, "rest")]
    assert lines[0]["expected"] == 1.4 and lines[0]["accepted"] == 1 and lines[1]["keys"] == 32


def test_an_unwritable_log_stops(tmp_path, caplog):
    log = DecisionLog(str(tmp_path / "missing" / "decisions.jsonl"))
    log.record(SpecCostModel(), Decision(0), [[]], [1], 0.01, 0)
    assert log.path is None and "cannot write" in caplog.text
