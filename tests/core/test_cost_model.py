"""The per-step width choice maximises expected tokens per second over measured step costs."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from rhyme_sglang.core.cost_model import PLAIN, SpecCostModel, bucket_of, check_widths, default_widths
from rhyme_sglang.core.draft_rest import DraftRest
from rhyme_sglang.core.node_search import DraftNodes, best_prefix
from rhyme_sglang.core.horizon import Horizon, remaining_tokens
from rhyme_sglang.core.draft import Draft, best_first_order, expected_accepts, truncate


def test_buckets_and_widths():
    assert [bucket_of(b) for b in (1, 2, 3, 4, 5, 48)] == [1, 2, 4, 4, 8, 64]
    with pytest.raises(ValueError):
        bucket_of(0)
    assert default_widths(16) == (1, 2, 4, 8, 16)
    assert default_widths(7) == (1, 2, 4, 7)
    assert default_widths(1) == (1,)
    assert check_widths([8, 2, 2]) == (2, 8)
    for bad in ([0], [], [2.5], [True]):
        with pytest.raises(ValueError):
            check_widths(bad)
    with pytest.raises(ValueError, match="exceeds"):
        check_widths([4, 16], max_width=8)


def test_measures_plain_first_then_explores_then_exploits():
    m = SpecCostModel(widths=(2, 8), reexplore_every=1000)
    expected = {2: 1.5 * 4, 8: 2.0 * 4}  # per-request 1.5 / 2.0 expected accepts, bs 4
    assert m.decide(4, expected=expected).width == PLAIN
    m.observe_step(4, PLAIN, 0.20)  # 20 tok/s
    # both verify cells unmeasured: the curve extrapolates proportionally from 4 tokens;
    # width 2 (12 tokens, est 0.6 s -> 16.7 tok/s) is within 0.5 of plain: explored first
    assert m.decide(4, expected=expected).width == 2
    m.observe_step(4, 2, 0.24)  # (4 + 6) / 0.24 = 41.7 tok/s
    # width 8: 36 tokens, proportional beyond 12 tokens: 0.72 s -> 16.7 tok/s < 0.5 * 41.7
    assert m.decide(4, expected=expected).width == 2
    m.observe_step(4, 8, 0.30)  # measured after all: (4 + 8) / 0.3 = 40 tok/s
    assert m.decide(4, expected=expected).width == 2
    assert m.decide(4, expected={2: 6.0, 8: 20.0}).width == 8  # (4 + 20) / 0.3 = 80 > 41.7
    assert m.decide(4, expected={2: 0.1, 8: 0.2}).width == PLAIN  # 4.1 / 0.24 = 17 < 20


def test_worthless_drafts_mean_plain_decode():
    m = SpecCostModel()
    assert m.decide(8, expected={w: 0.0 for w in m.widths}).width == PLAIN
    assert m.decide(8, expected={}).width == PLAIN


def test_calibration_scales_the_store_estimate():
    m = SpecCostModel(widths=(4,), reexplore_every=1000, alpha=1.0)
    m.observe_step(1, PLAIN, 0.01)
    m.observe_step(1, 4, 0.02)
    assert m.decide(1, expected={4: 0.5}).width == PLAIN  # 1.5 / 0.02 = 75 < 100
    for _ in range(4):  # the store under-predicts x4 (a prior of 4 verifies holds it at first)
        m.observe_acceptance(predicted=0.5, accepted=2)
    assert m.calibrated(0.5) > 1.0
    assert m.decide(1, expected={4: 0.5}).width == 4  # 2.36 / 0.02 = 118 > 100


def test_calibration_is_a_ratio_of_sums_not_of_heavy_tailed_ratios():
    m = SpecCostModel(calibration_decay=0.01)
    for i in range(400):  # 4 in 5 verifies accept nothing, 1 in 5 accepts 2 of 0.5 predicted
        m.observe_acceptance(predicted=0.5, accepted=2 if i % 5 == 4 else 0)
    assert m.calibration == pytest.approx(0.8, rel=0.1)  # 0.4 accepted / 0.5 predicted
    m.observe_acceptance(predicted=0.5, accepted=16)  # one lucky request barely moves it
    assert m.calibration < 1.2
    with pytest.raises(ValueError, match="calibration_decay"):
        SpecCostModel(calibration_decay=0.0)


def test_reexplores_periodically_the_cells_within_reach():
    m = SpecCostModel(widths=(4,), reexplore_every=5)
    m.observe_step(1, 4, 0.02)  # 1.5 / 0.02 = 75 tok/s: behind plain's 100, within 0.5 of it
    m.observe_step(1, PLAIN, 0.01)
    choices = [m.decide(1, expected={4: 0.5}).width for _ in range(10)]
    assert choices.count(4) == 2 and choices.count(PLAIN) == 8
    # a cell far behind (1.5 tok/s) is not re-run: it would cost a step 100x a plain one
    far = SpecCostModel(widths=(4,), reexplore_every=5)
    far.observe_step(1, 4, 1.0)
    far.observe_step(1, PLAIN, 0.01)
    assert [far.decide(1, expected={4: 0.5}).width for _ in range(10)] == [PLAIN] * 10
    # the plain baseline is always refreshed, however far behind a verify it looks
    poisoned = SpecCostModel(widths=(4,), reexplore_every=5, alpha=1.0, max_jump=100.0)
    poisoned.observe_step(1, PLAIN, 0.01)
    poisoned.observe_step(1, 4, 0.01)
    poisoned.observe_step(1, PLAIN, 1.0)
    assert PLAIN in [poisoned.decide(1, expected={4: 3.0}).width for _ in range(5)]


def test_reexploring_refreshes_the_stalest_cell_plain_included():
    """A plain cell poisoned by one slow step is refreshed though it is not the runner-up."""
    m = SpecCostModel(widths=(1, 2), reexplore_every=4, alpha=1.0, max_jump=100.0)
    m.observe_step(32, PLAIN, 0.5)
    m.observe_step(32, 1, 0.6)
    m.observe_step(32, 2, 0.7)
    m.observe_step(32, PLAIN, 5.0)  # one stalled step: plain now looks 10x dearer
    expected = {1: 2.0, 2: 3.0}
    chosen = []
    for _ in range(12):
        w = m.decide(32, expected=expected).width
        chosen.append(w)
        m.observe_step(32, w, {PLAIN: 0.5, 1: 0.6, 2: 0.7}[w])  # the machine's true costs
    assert PLAIN in chosen[:4]  # refreshed at the first re-explore turn
    assert chosen[-4:].count(PLAIN) >= 3  # then plain wins: 32 / 0.5 > 34 / 0.7 > 34 / 0.6


def test_one_stalled_step_moves_a_cell_at_most_max_jump():
    m = SpecCostModel(widths=(1,), alpha=1.0, max_jump=2.0)
    m.observe_step(8, PLAIN, 0.4)
    m.observe_step(8, PLAIN, 40.0)
    assert m.step_time(8, PLAIN) == pytest.approx(0.8)
    m.observe_step(8, PLAIN, 0.001)
    assert m.step_time(8, PLAIN) == pytest.approx(0.4)
    for _ in range(4):  # a lasting change still arrives within a few steps
        m.observe_step(8, PLAIN, 4.0)
    assert m.step_time(8, PLAIN) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="max_jump"):
        SpecCostModel(max_jump=1.0)


def test_a_seeded_plain_cell_is_measured_before_any_verify():
    m = SpecCostModel(widths=(4,), reexplore_every=1000)
    m.seed({(4, PLAIN): 0.2, (4, 4): 0.21})
    assert m.decide(4, expected={4: 8.0}).width == PLAIN  # the seed is a prior, not the baseline
    m.observe_step(4, PLAIN, 0.2)
    assert m.decide(4, expected={4: 8.0}).width == 4
    poisoned = SpecCostModel(widths=(4,))
    poisoned.seed({(32, PLAIN): 1.5})
    poisoned.observe_step(32, PLAIN, 0.5)  # the first measurement replaces a seeded cell
    assert poisoned.step_time(32, PLAIN) == pytest.approx(0.5)
    poisoned.observe_step(32, PLAIN, 1.5)  # later ones move it by EMA, at most x2 a step
    assert poisoned.step_time(32, PLAIN) == pytest.approx(0.8 * 0.5 + 0.2 * 1.0)


def test_estimate_interpolates_over_tokens_per_forward_and_seed():
    m = SpecCostModel(widths=(1, 4))
    m.seed({(2, PLAIN): 0.10, (2, 4): 0.30})  # 2 tokens: 0.1 s, 10 tokens: 0.3 s
    assert m.step_time(2, 4) == pytest.approx(0.30)
    assert m.estimate(2, 1) == pytest.approx(0.10 + 0.2 * (4 - 2) / 8)  # 4 tokens
    assert m.estimate(4, 4) == pytest.approx(0.30 * 20 / 10)  # proportional past the end
    d = m.as_dict()
    assert d["widths"] == [1, 4] and set(d["seconds_per_request_step"]["2"]) == {"0", "4"}


def test_bad_arguments():
    with pytest.raises(ValueError):
        SpecCostModel(alpha=0.0)
    with pytest.raises(ValueError):
        SpecCostModel(widths=())
    with pytest.raises(ValueError, match="width"):
        SpecCostModel(widths=(2, 4)).observe_step(1, 3, 0.1)
    with pytest.raises(ValueError):
        SpecCostModel().observe_step(1, PLAIN, -1.0)


# ---------------------------------------------------------------- draft widths
def _tree():
    #   a(0.9) -> b(0.6) -> c(0.3)
    #   d(0.05)   e(0.5) under a
    return Draft(token_ids=[10, 11, 12, 13, 14], parents=[-1, 0, 1, -1, 0],
                 probs=[0.9, 0.6, 0.3, 0.05, 0.5])


def test_truncate_keeps_the_most_probable_ancestor_closed_nodes():
    d = _tree()
    assert best_first_order(d) == [0, 1, 4, 2, 3]
    t = truncate(d, 3)
    assert t.token_ids == [10, 11, 14] and t.parents == [-1, 0, 0]
    assert t.check_integrity() and t.score == pytest.approx(2.0)
    assert truncate(d, 0).token_ids == [] and truncate(d, 9) is d
    assert expected_accepts(d, [0, 1, 3, 5, 8]) == pytest.approx(
        {0: 0.0, 1: 0.9, 3: 2.0, 5: 2.35, 8: 2.35})
    with pytest.raises(ValueError):
        truncate(d, -1)
    with pytest.raises(ValueError):
        expected_accepts(d, [1.5])


@st.composite
def _drafts(draw):
    n = draw(st.integers(0, 12))
    parents, probs = [], []
    for i in range(n):
        p = draw(st.integers(-1, i - 1))
        parent_prob = 1.0 if p < 0 else probs[p]
        probs.append(parent_prob * draw(st.floats(0.0, 1.0)))
        parents.append(p)
    return Draft(token_ids=list(range(100, 100 + n)), parents=parents, probs=probs)


@settings(max_examples=200, deadline=None)
@given(_drafts(), st.integers(0, 14))
def test_truncation_is_the_top_w_closed_subtree(draft, width):
    t = truncate(draft, width)
    assert len(t) == min(width, len(draft)) and t.check_integrity()
    kept = set(t.token_ids)
    for tok, parent in zip(t.token_ids, t.parents):  # ancestor-closed
        assert parent == -1 or t.token_ids[parent] in kept
    best = sorted(draft.probs, reverse=True)[:width]
    assert sum(t.probs) == pytest.approx(sum(best))  # monotone probs: the w most probable
    assert expected_accepts(draft, [width])[width] == pytest.approx(sum(t.probs))


def test_cost_at_a_batch_size_follows_the_measured_points_not_per_request_scaling():
    """A step costs a fixed part plus a part per request: the plain cell of bucket 32 measured
    while the batch was filling (17 requests) must not be scaled per request to 32."""
    true_plain = lambda bs: 0.155 + 0.0114 * bs  # noqa: E731 (SmolLM2 fp32, this CPU)
    m = SpecCostModel(widths=(1,), reexplore_every=1000, alpha=1.0)
    for bs in (1, 8, 17):
        m.observe_step(bs, PLAIN, true_plain(bs))
    m.observe_step(32, 1, 0.55)
    assert m.step_time(32, PLAIN) == pytest.approx(true_plain(32))
    assert m.step_time(20, PLAIN) == pytest.approx(true_plain(20))
    assert m.step_time(32, PLAIN) < true_plain(17) * 32 / 17 * 0.85
    d = m.as_dict()
    assert d["measured_at_batch_size"]["32"] == {"0": 17.0, "1": 32.0}
    # the baseline is read, not extrapolated, before a verify is chosen: plain at 32 first
    d = m.decide(32, expected={1: 8.0})
    assert d.width == PLAIN and d.advantage is None
    m.observe_step(32, PLAIN, true_plain(32))
    # one request's worth of expected drafts does not pay for the wider step at full batch
    d = m.decide(32, expected={1: 0.5})
    assert d.width == PLAIN and 0 < d.advantage < 1
    d = m.decide(32, expected={1: 8.0})
    assert d.width == 1 and d.advantage > 1


def test_calibration_per_prediction_level():
    """A store over-confident where it is most confident (requests predicted to accept 3 drafts
    accept 0.3) and under-confident below (predicted 0.3, accept 0.9). The overall factor is
    dominated by the many low predictions and keeps verifying the confident requests; the
    per-level factors do not."""
    m = SpecCostModel(widths=(4,), reexplore_every=1000, alpha=1.0, calibration_decay=0.005)
    for i in range(300):
        m.observe_acceptance(3.0, 1 if i % 10 < 3 else 0)
        for j in range(10):
            m.observe_acceptance(0.3, 1 if j < 9 else 0)
    assert 0.3 < m.calibrated(3.0) < 0.4  # 0.3, a little above it: 4 prior verifies at face value
    assert m.calibrated(0.3) == pytest.approx(0.9, rel=0.2)
    assert m.calibrated(0.0) == 0.0
    assert m.calibrated(20.0) == pytest.approx(20.0)  # an unseen level with none above: face value
    m.observe_step(8, PLAIN, 0.27)
    m.observe_step(8, 4, 0.40)  # pays only above 8 * (0.40 / 0.27 - 1) = 3.85 accepted
    confident = [{4: 3.0}] * 8
    assert m.batch_expected(confident)[4] == pytest.approx(8 * m.calibrated(3.0))
    assert m.decide(8, expected=m.batch_expected(confident), calibrated=True).width == PLAIN
    assert m.calibration > 1.2  # the overall factor ...
    assert m.decide(8, expected={4: 8 * 3.0}).width == 4  # ... would verify them
    assert set(m.as_dict()["calibration_by_prediction"]) == {"0.25-0.5", "2-4"}


def test_request_evidence_discounts_a_request_whose_verifies_fail():
    """A long answer that left its history: the shared calibration still expects what the
    batch accepted; the request's own failed verifies bring its factor down, plain steps
    fade that evidence, and a request accepting more than expected is raised (bounded)."""
    from rhyme_sglang.core.calibration import RequestEvidence

    ev = RequestEvidence()
    assert ev.factor() == 1.0
    for _ in range(6):
        ev.observe(expected=0.5, accepted=0, tokens=1)
    assert ev.factor() < 0.3
    low = ev.factor()
    ev.advance(23)  # ~ one half-life of plain tokens
    assert low < ev.factor() < 0.6
    ev.advance(400)
    assert ev.factor() == pytest.approx(1.0, abs=0.01)
    good = RequestEvidence()
    for _ in range(5):
        good.observe(expected=1.0, accepted=4, tokens=5)
    assert 2.0 < good.factor() <= 4.0
    for _ in range(50):
        good.observe(expected=0.1, accepted=8, tokens=9)
    assert good.factor() == 4.0
    for bad in (dict(prior=0.0), dict(fade=0.0), dict(fade=1.5)):
        with pytest.raises(ValueError):
            RequestEvidence(**bad)
    with pytest.raises(ValueError):
        ev.observe(expected=-1.0, accepted=0, tokens=1)
    with pytest.raises(ValueError):
        ev.advance(-1)


def test_request_factors_scale_batch_and_critical_expectations():
    m = SpecCostModel(widths=(2, 4))
    per_request = [{2: 1.0, 4: 1.5}, {2: 1.0, 4: 1.5}]
    plain = m.batch_expected(per_request)
    scaled = m.batch_expected(per_request, [1.0, 0.1])
    assert scaled[4] == pytest.approx(plain[4] * 0.55)
    horizon = Horizon((100.0, 10.0))  # request 0 alone is critical
    assert m.critical_expected(per_request, horizon, [0.5, 1.0])[2] == \
        pytest.approx(0.5 * m.critical_expected(per_request, horizon)[2])


# ------------------------------------------------------------ per-request widths (ragged)
def _ragged_model():
    """bs 8: plain 0.20 s; width 4 measured at 2 draft rows per request (16 drafts, 24 rows in
    the forward) 0.32 s, so a draft row costs 7.5 ms: at plain's 40 tok/s a node is worth
    verifying when it is accepted with p > 0.3."""
    m = SpecCostModel(widths=(4, 8), reexplore_every=1000)
    m.observe_step(8, PLAIN, 0.20)
    m.observe_step(8, 4, 0.32, rows=24)
    return m


def test_ragged_takes_the_confident_nodes_wherever_they_are():
    m = _ragged_model()
    assert m.step_time_rows(8, 0) == pytest.approx(0.20)
    assert m.step_time_rows(8, 8) == pytest.approx(0.26)  # interpolated: 0.20 + 8 x 7.5 ms
    assert m.step_time_rows(8, 16) == pytest.approx(0.32)
    assert m.step_time_rows(8, 32) == pytest.approx(0.44)  # along the last segment
    # two requests with confident chains, six with worthless drafts
    gains = [[0.9, 0.85, 0.8, 0.7]] * 2 + [[0.05, 0.02]] * 6
    width, counts = m.decide(8, gains=gains)[:2]
    assert counts == [4, 4, 0, 0, 0, 0, 0, 0] and width == 4  # (8 + 6.5) / 0.26 s = 56 tok/s
    # a uniform width 4 would verify 32 drafts: (8 + 6.9) / 0.44 s = 34 tok/s, below plain's 40
    assert (8 + 2 * 3.25 + 6 * 0.07) / m.step_time_rows(8, 32) < 8 / 0.20


def test_ragged_worthless_drafts_and_unmeasured_plain_mean_plain():
    m = SpecCostModel(widths=(1, 2, 4))
    assert m.decide(2, gains=[[0.9], [0.9]])[:2] == (PLAIN, [0, 0])  # plain is measured first
    m.observe_step(2, PLAIN, 0.1)
    assert m.decide(2, gains=[[], [0.0]])[:2] == (PLAIN, [0, 0])
    with pytest.raises(ValueError, match="one gain list per request"):
        m.decide(2, gains=[[0.5]])


def test_ragged_width_is_the_smallest_that_holds_the_largest_count():
    m = _ragged_model()
    m.observe_step(8, 8, 0.40, rows=8 + 40)
    gains = [[0.95] * 6] + [[]] * 7  # one request, six confident nodes
    width, counts = m.decide(8, gains=gains)[:2]
    assert counts == [6, 0, 0, 0, 0, 0, 0, 0] and width == 8


def test_ragged_explores_an_unmeasured_cell_once_then_uses_what_it_measured():
    m = SpecCostModel(widths=(2, 4), reexplore_every=1000)
    m.observe_step(4, PLAIN, 0.2)
    gains = [[0.9, 0.9]] * 4
    width, counts = m.decide(4, gains=gains)[:2]  # only plain known: the curve's estimate, explored
    assert width == 2 and sum(counts) >= 1
    m.observe_step(4, width, 0.21, rows=4 + sum(counts))
    width, counts = m.decide(4, gains=gains)[:2]
    assert width == 2 and counts == [2, 2, 2, 2]  # measured cheap: every confident node


def test_ragged_observation_checks_rows():
    m = SpecCostModel(widths=(2,))
    with pytest.raises(ValueError, match="rows"):
        m.observe_step(4, 2, 0.1, rows=13)  # more than 4 x 3
    with pytest.raises(ValueError, match="rows"):
        m.observe_step(4, 2, 0.1, rows=3)  # fewer than the batch


# ----------------------------------------------------------------- the critical path (Horizon)
def test_remaining_tokens_and_horizon_basics():
    assert remaining_tokens(100, 10) == 90
    assert remaining_tokens(100, 80) == 40  # past two thirds: half of what is done
    assert remaining_tokens(100, 300) == 150  # an overrun is in the long tail
    assert remaining_tokens(0, 0) == 1.0
    with pytest.raises(ValueError, match="done"):
        remaining_tokens(10, -1)
    h = Horizon((100, 90, 10, 5), queued=15)
    assert h.longest == 100 and h.work == 220
    assert h.critical() == (0, 1)  # within 80% of the longest
    assert h.useful(4, 0.0) == pytest.approx(2.2)  # the long ones set the pace: 220 / 100
    assert h.useful(4, 1.0) == pytest.approx(4.0)  # capped by the batch's own tokens
    for bad in ((), (1, 0)):
        with pytest.raises(ValueError, match="remaining"):
            Horizon(bad)
    with pytest.raises(ValueError, match="queued"):
        Horizon((1,), queued=-1)


def _tail_model():
    m = SpecCostModel(widths=(4,), reexplore_every=1000, alpha=1.0)
    m.observe_step(4, PLAIN, 0.10)
    m.observe_step(4, 4, 0.16)
    return m


def test_horizon_skips_verifies_that_only_speed_up_short_requests():
    m = _tail_model()
    tail = Horizon((100, 5, 5, 5))  # one long response holds the rollout
    per_request = [{4: 0.0}, {4: 3.0}, {4: 3.0}, {4: 3.0}]  # the short ones draft well
    expected = m.batch_expected(per_request)
    assert m.decide(4, expected=expected, calibrated=True).width == 4  # 13 / 0.16 = 81 > 40 tok/s
    critical = m.critical_expected(per_request, tail)
    assert critical == {4: 0.0}
    assert m.decide(4, expected=expected, calibrated=True, horizon=tail,
                    critical=critical).width == PLAIN
    # a long queue: the batch's throughput matters again
    busy = Horizon((100, 5, 5, 5), queued=2000)
    assert m.decide(4, expected=expected, calibrated=True, horizon=busy,
                    critical=m.critical_expected(per_request, busy)).width == 4
    with pytest.raises(ValueError, match="horizon"):
        m.decide(3, expected=expected, horizon=tail)


def test_horizon_verifies_for_the_long_request_where_the_batch_mean_says_plain():
    m = _tail_model()
    tail = Horizon((100, 5, 5, 5))
    per_request = [{4: 2.0}, {4: 0.0}, {4: 0.0}, {4: 0.0}]
    expected = m.batch_expected(per_request)
    assert m.decide(4, expected=expected, calibrated=True).width == PLAIN  # 6 / 0.16 = 37.5 < 40
    # useful tokens: plain min(4, 1.15) / 0.10 = 11.5; verify min(6, 3 x 1.15) / 0.16 = 21.6
    assert m.decide(4, expected=expected, calibrated=True, horizon=tail,
                    critical=m.critical_expected(per_request, tail)).width == 4


def test_ragged_horizon_takes_the_long_requests_nodes():
    m = _ragged_model()
    gains = [[0.6, 0.5, 0.4, 0.3]] + [[0.9, 0.85, 0.8, 0.7]] * 2 + [[]] * 5
    _, counts = m.decide(8, gains=gains)[:2]
    assert counts[1] == counts[2] == 4  # without a horizon the best nodes are the short ones'
    tail = Horizon((200,) + (5,) * 7)
    width, counts = m.decide(8, gains=gains, horizon=tail)[:2]
    assert counts[0] >= 1 and counts[1:] == [0] * 7 and width >= max(counts)
    # every request short but one with no drafts: nothing shortens the rollout, plain
    assert m.decide(8, gains=[[]] + [[0.9] * 4] * 7, horizon=tail)[:2] == (PLAIN, [0] * 8)
    with pytest.raises(ValueError, match="horizon"):
        m.decide(8, gains=gains, horizon=Horizon((1, 2)))


def test_background_requests_are_no_work_on_the_critical_path():
    h = Horizon((100, 300, 90, 10), queued=15, background={1})
    assert h.longest == 100 and h.work == 215 and h.rows(4) == 3
    assert h.critical() == (0, 2) and not h.foreground(1) and h.foreground(0)
    alone = Horizon((5, 7), background={0, 1})  # the engine's only work: all of it counts
    assert alone.background == frozenset() and alone.longest == 7 and alone.rows(2) == 2
    for bad in ({4}, {-1}, {"1"}):
        with pytest.raises(ValueError, match="background"):
            Horizon((1, 2, 3, 4), background=bad)


def test_run_ahead_rows_neither_hold_back_nor_take_the_verify():
    """One straggler with confident drafts and seven run-ahead requests with long predicted
    remainders. Counted as work, the run-ahead rows are the critical path and have no drafts,
    so the step is plain; as background the straggler's nodes are verified, and background
    drafts are never taken, however confident."""
    m = _ragged_model()
    gains = [[0.9, 0.85, 0.8, 0.7]] + [[]] * 7
    remaining = (150.0,) + (300.0,) * 7
    assert m.decide(8, gains=gains, horizon=Horizon(remaining))[:2] == (PLAIN, [0] * 8)
    ahead = Horizon(remaining, background=set(range(1, 8)))
    width, counts = m.decide(8, gains=gains, horizon=ahead)[:2]
    assert counts == [4] + [0] * 7 and width == 4  # (1 + 3.25) / 0.23 s against 1 / 0.20 s
    confident = [[0.9, 0.85, 0.8, 0.7]] + [[0.99] * 4] * 7
    assert m.decide(8, gains=confident, horizon=ahead)[1] == [4] + [0] * 7
    # one width for the batch: the rate counts the foreground's rows and drafts only
    tail = _tail_model()
    per_request = [{4: 2.0}] + [{}] * 3  # the worker leaves background requests out
    expected = tail.batch_expected(per_request)
    quiet = Horizon((100, 300, 300, 300), background={1, 2, 3})
    assert tail.decide(4, expected=expected, calibrated=True, horizon=quiet,
                       critical=tail.critical_expected(per_request, quiet)).width == 4
    loud = Horizon((100, 300, 300, 300))
    assert tail.decide(4, expected=expected, calibrated=True, horizon=loud,
                       critical=tail.critical_expected(per_request, loud)).width == PLAIN


def test_a_promising_seeded_cell_is_tried_at_once_then_judged_on_its_measurement():
    """A seeded cell is an estimate: within ``explore_within`` of the best rate it is run on
    the first decision (a seed saved by a long-context rollout kept bench_serving's batch-1
    chats on plain steps), and its first measurement replaces the seed."""
    for width_seconds, then in ((0.037, 8), (0.060, PLAIN)):
        m = SpecCostModel(widths=(8,), reexplore_every=1000, close_refresh=1000)
        m.seed({(1, PLAIN): 0.025, (1, 8): 0.0466})
        m.observe_step(1, PLAIN, 0.025)
        expected = {8: 0.6}  # (1 + 0.6) / 0.0466 = 34 tok/s against plain's 40
        assert m.decide(1, expected=expected, calibrated=True).width == 8  # tried once
        m.observe_step(1, 8, width_seconds)  # 43 tok/s: kept; 27 tok/s: plain from then on
        assert [m.decide(1, expected=expected, calibrated=True).width for _ in range(3)] == [then] * 3


def test_a_seeded_cell_is_run_once_however_slow_it_reads():
    """Seeds come from earlier engines (slower kernels, other code): a verify cell seeded at 3x
    a plain step is measured once at a re-exploration point, then judged on what it measured;
    a cell this model measured that slow is not re-run."""
    m = SpecCostModel(widths=(4,), reexplore_every=8, alpha=1.0, close_refresh=1000)
    m.seed({(4, PLAIN): 0.10, (4, 4): 0.30})
    m.observe_step(4, PLAIN, 0.10)  # plain measured here; the verify cell is only a seed
    expected = {4: 1.0}  # (4 + 1) / 0.30 = 17 tok/s against plain's 40: far behind
    choices = [m.decide(4, expected=expected).width for _ in range(8)]
    assert choices == [PLAIN] * 7 + [4]  # the 8th decision runs the seeded cell once
    m.observe_step(4, 4, 0.12)  # it got cheaper: (4 + 1) / 0.12 = 42 tok/s
    assert m.decide(4, expected=expected).width == 4
    slow = SpecCostModel(widths=(4,), reexplore_every=8, alpha=1.0)
    slow.observe_step(4, PLAIN, 0.10)
    slow.observe_step(4, 4, 0.30)  # measured here at 3x: not re-run
    assert [slow.decide(4, expected=expected).width for _ in range(16)] == [PLAIN] * 16


def test_the_baseline_is_measured_near_the_batch_size_it_judges():
    """Stop 39, bench_serving at batch 16: bucket 16's plain cell was measured while a round's
    prefills were still joining (~12 requests, slow steps) and read 56 ms extrapolated to 16
    requests, against 42-44 ms measured there; width-1 verifies (51 ms) looked cheaper than
    plain steps for a whole round. A verify is now judged against plain steps measured within
    ``baseline_near`` of the batch size."""
    m = SpecCostModel(widths=(1,), reexplore_every=1000)
    m.observe_step(8, PLAIN, 0.0336)
    for _ in range(5):
        m.observe_step(12, PLAIN, 0.045)
    m.observe_step(15, 1, 0.051, rows=16)
    gains = [[0.01]] + [[]] * 15
    old_plain = m.steps._at(m.steps._cell[(16, PLAIN)], 16, PLAIN)  # what the cell alone reads at 16
    assert old_plain > 0.055 > 0.051 * 16 / 15  # the verify measured cheaper than plain read:
    assert m.step_time_rows(16, 1) == pytest.approx(old_plain)  # floored there, any gain won
    d = m.decide(16, gains=gains)
    assert d[:2] == (PLAIN, [0] * 16) and d.advantage is None
    m.observe_step(16, PLAIN, 0.043)
    assert m.step_time(16, PLAIN) == pytest.approx(0.043)
    d = m.decide(16, gains=gains)
    assert d[:2] == (PLAIN, [0] * 16) and 0 < d.advantage < 1
    # between measured sizes near enough on each side: linear
    m.observe_step(14, PLAIN, 0.041)
    assert m.step_time(15, PLAIN) == pytest.approx(0.042)
    d = m.decide(32, expected={1: 4.0})
    assert d.width == PLAIN and d.advantage is None  # bucket 32: unmeasured
    with pytest.raises(ValueError, match="baseline_near"):
        SpecCostModel(baseline_near=1.0)


def test_draft_rest_backs_off_after_clear_losses_and_wakes_on_news():
    rest = DraftRest(below=0.8, longest=7)
    steps = []
    for _ in range(4):  # clear losses: rest 1, then 3, then 7 steps
        rest.decided(PLAIN, 0.5)
        n = 0
        while rest.resting(new_requests=False):
            n += 1
        steps.append(n)
    assert steps == [1, 3, 7, 7] and rest.rested == 18
    rest.decided(PLAIN, 0.9)  # a close call: draft every step
    assert not rest.resting(False)
    rest.decided(PLAIN, 0.5)
    rest.decided(1, 2.0)  # a verify ends the streak
    assert not rest.resting(False)
    rest.decided(PLAIN, None)  # plain to measure the baseline: no verdict on the drafts
    assert not rest.resting(False)
    rest.decided(PLAIN, 0.0)
    rest.decided(PLAIN, 0.0)
    assert rest.resting(False)
    assert not rest.resting(new_requests=True)  # a new request: draft now, streak over
    rest.decided(PLAIN, 0.0)
    assert rest.resting(False) and not rest.resting(False)
    assert not DraftRest(longest=0).resting(False)
    for bad in (dict(below=1.5), dict(longest=-1)):
        with pytest.raises(ValueError):
            DraftRest(**bad)


def test_a_close_call_re_measures_the_plain_baseline_often():
    m = SpecCostModel(widths=(1,), reexplore_every=1000, close_call=1.25, close_refresh=4,
                      alpha=1.0)
    m.observe_step(8, PLAIN, 0.050)  # one slow plain step
    m.observe_step(8, 1, 0.045, rows=16)
    gains = [[0.1]] * 8  # (8 + 0.8) / 0.045 = 196 tok/s against 8 / 0.05 = 160: x1.22
    picks = []
    for _ in range(8):
        width, _counts = m.decide(8, gains=gains)[:2]
        picks.append(width)
        m.observe_step(8, width, 0.030 if width == PLAIN else 0.045, rows=16 if width else None)
    assert picks[:4] == [1, 1, 1, PLAIN]  # the plain step is re-run within close_refresh
    assert m.step_time(8, PLAIN) < 0.045 and picks[4:] == [PLAIN] * 4  # then plain wins
    far = SpecCostModel(widths=(1,), reexplore_every=1000, close_refresh=1)
    far.observe_step(8, PLAIN, 0.050)
    far.observe_step(8, 1, 0.045, rows=16)
    assert [far.decide(8, gains=[[0.9]] * 8).width for _ in range(3)] == [1, 1, 1]  # no close call
    with pytest.raises(ValueError, match="close_call"):
        SpecCostModel(close_call=0.5)


def _rows_time_direct(m, bs, extra):
    """``step_time_rows`` as its docstring says it, one row count at a time."""
    if extra <= 0:
        return m.estimate(bs, PLAIN)
    points = m.steps._rows_points(bs)
    if not points:
        return m.steps._curve_at(bs + extra)
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if extra <= x1:
            break
    (xa, ya), (xz, yz) = points[0], points[-1]
    if extra > xz:  # past the last point: the last segment's slope, or the chord's if steeper
        slope = (y1 - y0) / (x1 - x0) if x1 - x0 >= 1e-9 else 0.0
        chord = (yz - ya) / (xz - xa) if xz - xa >= 1e-9 else 0.0
        return max(yz + max(slope, chord) * (extra - xz), points[0][1], 1e-9)
    if x1 - x0 < 1e-9:
        return max(y1, 1e-9)
    return max(y0 + (y1 - y0) * (extra - x0) / (x1 - x0), points[0][1], 1e-9)


def test_rows_past_the_last_cell_cost_at_least_the_average_row():
    """Stop 45: cells measured with ~2 draft rows a step and a flat last segment priced 23
    rows at batch 12 at 0.6 ms a row; past the last measured point a row now costs at least
    the chord's (first point to last) average."""
    m = SpecCostModel(widths=(8, 16), alpha=1.0)
    m.observe_step(12, PLAIN, 0.057)
    m.observe_step(12, 8, 0.063, rows=12 + 2)  # 2 rows: +6 ms, 3 ms a row
    m.observe_step(12, 16, 0.0635, rows=12 + 3)  # 3 rows: the last segment +0.5 ms a row
    assert m.step_time_rows(12, 3) == pytest.approx(0.0635)
    assert m.step_time_rows(12, 23) == pytest.approx(0.0635 + 20 * (0.0065 / 3))
    assert m.step_time_rows(12, 2) == pytest.approx(0.063)  # inside: interpolated as before


def test_allocation_search_matches_the_direct_loops():
    """``choose_rows``'s array pieces equal the per-node loops they replace: the step
    times of 0..n rows (the segment search one row count at a time) and the best prefix of a node order
    (rates summed node by node; the first best wins)."""
    import random

    rng = random.Random(7)
    for case in range(200):
        m = SpecCostModel(widths=(1, 2, 4, 8, 16))
        for _ in range(rng.randint(1, 12)):
            bs, w = rng.randint(1, 40), rng.choice((0, 1, 2, 4, 8, 16))
            m.observe_step(bs, w, rng.uniform(0.01, 0.3), None if w == 0 else bs + rng.randint(1, bs * w))
        bs = rng.randint(1, 40)
        n = rng.randint(0, 60)
        times = m.steps.rows_times(bs, n)
        assert times == [_rows_time_direct(m, bs, k) for k in range(n + 1)]
        if None in times:
            continue
        nodes = [(rng.random(), rng.randrange(bs), 0) for _ in range(n)]
        horizon = None if case % 2 else Horizon(tuple(rng.uniform(1, 50) for _ in range(bs)), 5.0)
        critical = set() if horizon is None else set(horizon.critical())
        best, gain, crit = (0.0, 0), 0.0, 0.0
        for k, (g, i, _) in enumerate(nodes, start=1):
            gain += g
            crit += g if i in critical else 0.0
            tokens = bs + gain if horizon is None else horizon.useful(bs + gain, crit / len(critical))
            if tokens / times[k] > best[0]:
                best = (tokens / times[k], k)
        is_critical = np.zeros(bs, dtype=bool)
        is_critical[list(critical)] = True
        gain, request = np.array([x[0] for x in nodes]), np.array([x[1] for x in nodes], dtype=int)
        assert best_prefix(bs, gain, request, np.asarray(times[1:]), horizon, is_critical) == best


def test_nodes_are_ordered_best_first_with_ties_by_rank_then_batch_order():
    import random

    rng = random.Random(3)
    for _ in range(100):
        gains = [sorted((rng.choice((0.0, 0.25, 0.5, rng.random())) for _ in range(rng.randint(0, 20))),
                        reverse=True) for _ in range(rng.randint(1, 12))]
        nodes = DraftNodes(gains, 16)
        expected = sorted(((g, i, j) for i, row in enumerate(gains) for j, g in enumerate(row[:16])
                           if g > 0), key=lambda x: (-x[0], x[2]))
        assert list(zip(nodes.gain.tolist(), nodes.request.tolist(), nodes.rank.tolist())) == expected
