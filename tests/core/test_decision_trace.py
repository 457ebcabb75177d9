"""Same inputs, same decisions: a seeded sequence of decode steps (``decision_trace.py``) gives
the decisions recorded in ``data/decision_trace.json`` (width, counts, reason, advantage,
whether the drafts allowed a probe, a probe's prediction)."""

import json

import pytest

from tests.core.decision_trace import SEEDS, TRACE, trace


@pytest.mark.parametrize("mode", ["rows", "width"])
@pytest.mark.parametrize("seed", SEEDS)
def test_the_decisions_match_the_recorded_trace(mode, seed):
    recorded = json.loads(TRACE.read_text())[f"{mode}-{seed}"]
    assert trace(seed, mode) == recorded
