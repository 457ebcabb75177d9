"""The request table: every store request it starts it finishes, each output token reaches the
store once, and a verify's outcome becomes evidence exactly once."""

import pytest
from hypothesis import given, settings, strategies as st

from rhyme_sglang.core import DraftStore
from rhyme_sglang.core.cost_model import PLAIN, SpecCostModel
from rhyme_sglang.core.requests import RequestTable
from rhyme_sglang.core.width_cycle import CycleWidths


class _Stats:
    def __init__(self):
        self.verifies = []

    def record(self, epoch, proposed, emitted):
        self.verifies.append((proposed, emitted))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["step", "verify", "finish"]),
                          st.integers(1, 4)), max_size=40))
def test_the_table_and_the_store_agree_after_any_sequence(ops):
    store, stats = DraftStore(), _Stats()
    table = RequestTable(store, SpecCostModel(widths=(1, 2, 4)), stats)
    outputs, finished, verifies = {}, 0, 0
    for i, op, n in ops:
        rid = f"r{i}"
        if rid not in table:
            table.start(rid, [1, 2, 3], prompt_id="p", sample=i)
            outputs[rid] = []
        if op == "verify":
            table.propose(rid, n, 0.5 * n, 0.5 * n)
            verifies += 1
        outputs[rid] = outputs[rid] + [7] * n
        if op == "finish":
            table.finish(rid, outputs[rid], add_to_history=True)
            finished += 1
        else:
            table.sync(rid, outputs[rid])
            assert table.get(rid).synced == len(outputs[rid])
        table.check_integrity()
    assert set(store.active_requests) == {f"r{i}" for i in range(3) if f"r{i}" in table}
    assert store.num_responses == finished
    assert len(stats.verifies) == verifies  # each verify's outcome counted once
    table.start("x", [1])
    with pytest.raises(ValueError, match="already tracked"):
        table.start("x", [1])


def test_overlap_mode_keeps_the_last_accepted_token_once():
    table = RequestTable(DraftStore(), SpecCostModel())
    table.start("r", [1, 2])
    assert table.take_last("r") is None
    table.hold_last("r", 9)
    assert table.take_last("r") == 9 and table.take_last("r") is None


def test_the_width_cycle_runs_every_ordered_pair_of_kinds():
    cycle = CycleWidths((1, 2), ragged=False)
    widths = [cycle.decide(4).width for _ in range(18)]
    pairs = {(widths[k], widths[k + 1]) for k in range(0, 18, 2)}
    assert pairs == {(a, b) for a in (PLAIN, 1, 2) for b in (PLAIN, 1, 2)}
    ragged = CycleWidths((2,), ragged=True)
    decisions = [ragged.decide(3) for _ in range(8)]
    assert all(d.reason == "cycle" for d in decisions)
    assert any(d.counts is not None and d.counts != [d.width] * 3 for d in decisions)
    assert all(d.counts is None or max(d.counts) <= d.width for d in decisions)
