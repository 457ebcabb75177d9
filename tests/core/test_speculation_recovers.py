"""Speculation cannot lock itself out: a few misses cannot pin the calibration to its floor,
probes keep verifying where the store's drafts look good, and on a perfect history the
calibrated decision verifies again within a bounded number of steps.

The bound (``RECOVERY_STEPS``): after any prefix of misses, a run of perfect drafts gets a
verify within ``probe_every`` steps of its bucket (a probe), and the decision itself
verifies again within ``16 * probe_every`` steps of the run's start, then keeps verifying:
each probe adds one perfect verify per request it verifies to the calibration, whose misses
weigh at most ``1 / decay`` = 50 verifies and fade by ``1 - decay`` per verify. The worst
prefix is many large predictions missed at the perfect drafts' own level, in a batch of
many requests whose verifies barely pay (each probe verifies one node per request there).
"""

import logging

import pytest
from hypothesis import given, settings, strategies as st

from rhyme_sglang.core.calibration import _LOWEST, AcceptanceCalibration
from rhyme_sglang.core.cost_model import PLAIN, SpecCostModel
from rhyme_sglang.core.health import AT_BOUND, OK, STARVED, SpecHealth

PROBE_EVERY = 32
RECOVERY_STEPS = 16 * PROBE_EVERY
PLAIN_S, ROW_S = 0.004, 0.0003  # a plain step and each draft row of a verify (1.3x plain at 8 rows)


def _step_seconds(bs: int, rows: int) -> float:
    return PLAIN_S * (1 + 0.05 * (bs - 1)) + ROW_S * rows


def _model(bs: int, first_verify_s: float) -> SpecCostModel:
    """A model that measured plain steps and one verify, up to 20% slow (the engine does not
    price a width's first step, its warm-up)."""
    m = SpecCostModel(widths=(1, 2, 4, 8), probe_every=PROBE_EVERY)
    for _ in range(3):
        m.observe_step(bs, PLAIN, _step_seconds(bs, 0))
    m.observe_step(bs, 1, first_verify_s, rows=2 * bs)
    return m


def _run(m: SpecCostModel, bs: int, probs, accept, steps: int):
    """``steps`` decode steps of ``bs`` requests whose best-first draft nodes have path
    probabilities ``probs`` and of which a verify accepts ``accept(count)``; returns each
    step's (width, reason)."""
    out = []
    for _ in range(steps):
        gains = [[p * m.calibrated(sum(probs)) / sum(probs) for p in probs]] * bs
        d = m.decide(bs, gains=gains, raw=[list(probs)] * bs)
        width, counts = d.width, d.counts
        out.append((width, d.reason))
        if width != PLAIN:
            for c in counts:
                if c:
                    m.observe_acceptance(sum(probs[:c]), accept(c), level=sum(probs))
            if d.reason == "probe":
                m.probes.outcome(bs, sum(accept(c) for c in counts if c), d.probe_predicted)
        m.observe_step(bs, width, _step_seconds(bs, sum(counts)), rows=bs + sum(counts))
    return out


@settings(max_examples=40, deadline=None)
@given(misses=st.lists(st.tuples(st.floats(0.01, 16.0), st.integers(0, 3)), max_size=6))
def test_a_handful_of_misses_cannot_pin_the_calibration(misses):
    cal = AcceptanceCalibration()
    for predicted, accepted in misses:
        cal.observe(predicted, min(accepted, int(predicted * 0.2)))
    assert cal.at_bound() == []
    # at worst prior / (prior + n) for n misses, twice (its own sums, then the levels above)
    worst = (cal.prior / (cal.prior + len(misses))) ** 2
    for k in range(7):
        assert cal.level_factor(k) >= worst - 1e-9 > _LOWEST
    assert cal.factor >= cal.prior / (cal.prior + len(misses)) - 1e-9


def test_misses_of_weak_guesses_do_not_drag_down_confident_levels():
    cal = AcceptanceCalibration()
    for _ in range(200):
        cal.observe(0.3, 0)
    assert cal.calibrated(0.3) < 0.1 * 0.3
    assert cal.calibrated(6.0) == pytest.approx(6.0)  # no evidence at or above 4-8: face value
    for _ in range(200):  # a confident level that misses says the weaker ones do too
        cal.observe(6.0, 0)
    assert cal.calibrated(1.5) < 0.2 * 1.5
    cal.forget(0.0)  # new history: the prior again
    assert cal.calibrated(1.5) == pytest.approx(1.5) and cal.factor == pytest.approx(1.0)
    with pytest.raises(ValueError, match="prior"):
        AcceptanceCalibration(prior=0.0)
    with pytest.raises(ValueError, match="keep"):
        cal.forget(1.5)


@settings(max_examples=25, deadline=None)
@given(bs=st.sampled_from([1, 2, 8, 12]),
       misses=st.lists(st.tuples(st.floats(0.05, 8.0), st.sampled_from([1, 2, 4, 8])),
                       min_size=0, max_size=300),
       first_verify_x=st.floats(1.0, 1.2))
def test_after_any_misses_perfect_drafts_bring_verification_back(bs, misses, first_verify_x):
    m = _model(bs, first_verify_x * _step_seconds(bs, bs))
    for predicted, width in misses:  # verifies whose drafts all missed
        m.observe_acceptance(predicted, 0)
        m.observe_step(bs, width, _step_seconds(bs, bs * width), rows=bs * (width + 1))
    m.steps.observe(bs, PLAIN, _step_seconds(bs, 0), now=m._decisions)
    probs = [0.95 ** (i + 1) for i in range(8)]  # a perfect history: 6.3 predicted, 8 accepted
    steps = _run(m, bs, probs, accept=lambda c: c, steps=RECOVERY_STEPS + 2 * PROBE_EVERY)
    verify_at = [i for i, (w, _) in enumerate(steps) if w != PLAIN]
    assert verify_at and verify_at[0] < PROBE_EVERY
    decided = [i for i, (w, why) in enumerate(steps) if w != PLAIN
               and why not in ("probe", "reexplore")]
    assert decided and decided[0] < RECOVERY_STEPS, steps
    after = steps[decided[0]:decided[0] + 2 * PROBE_EVERY]
    assert sum(w != PLAIN for w, _ in after) > len(after) // 2  # it stays on


def test_useless_drafts_get_at_most_one_probe_per_probe_every_steps():
    bs = 8
    m = _model(bs, 2 * _step_seconds(bs, bs))
    probs = [0.9, 0.8, 0.7]  # confident drafts that always miss
    steps = _run(m, bs, probs, accept=lambda c: 0, steps=10 * PROBE_EVERY)
    verifies = sum(w != PLAIN for w, _ in steps)
    probes = sum(why == "probe" for _, why in steps)
    assert 1 <= probes <= 10 and verifies <= 2 * 10  # the probes and the periodic re-explorations
    assert m.calibrated(sum(probs)) < 0.35 * sum(probs)


def test_no_probe_where_the_store_predicts_less_than_a_token():
    bs = 4
    m = _model(bs, 2 * _step_seconds(bs, bs))
    steps = _run(m, bs, [0.02], accept=lambda c: 0, steps=3 * PROBE_EVERY)
    assert not any(why == "probe" for _, why in steps)


def test_rested_steps_count_toward_the_next_probe():
    m = SpecCostModel(probe_every=4)
    m.probes.verified(8)
    for _ in range(3):
        m.probes.tick(8)
    assert not m.probes.due(8)
    m.probes.tick(8)
    assert m.probes.due(8) and not m.probes.due(1)  # per batch bucket
    m.probes.verified(7)  # same bucket (5-8)
    assert not m.probes.due(8)
    with pytest.raises(ValueError, match="probe_every"):
        SpecCostModel(probe_every=0)


def test_probes_that_succeed_grow_and_come_sooner_and_a_miss_resets_them():
    """A verify's fixed cost measured on a one-row verify reads as a row's cost, so every
    larger verify looks too slow: probes grow while they are accepted until they measure
    what a verify of the good drafts costs."""
    bs = 3
    m = SpecCostModel(widths=(1, 2, 3), probe_every=32)
    m.observe_step(bs, PLAIN, 0.0012)
    m.observe_step(bs, 1, 0.0029, rows=bs + 1)  # fixed cost 1.5 ms, read as one row's
    probs = [0.9, 0.85, 0.8]

    def true_seconds(rows):
        return 0.0012 + 0.0008 + 0.0001 * rows

    sizes, steps = [], 0
    while steps < 200:
        steps += 1
        gains = [[p * m.calibrated(sum(probs)) / sum(probs) for p in probs]] * bs
        d = m.decide(bs, gains=gains, raw=[probs] * bs)
        width, counts = d.width, d.counts
        if width:
            for c in counts:
                if c:
                    m.observe_acceptance(sum(probs[:c]), c, level=sum(probs))
            if d.reason == "probe":
                sizes.append(sum(counts))
                predicted = d.probe_predicted
                m.probes.outcome(bs, sum(counts), predicted)
            elif d.reason in ("best", "close_call"):
                break
        m.observe_step(bs, width, true_seconds(sum(counts)), rows=bs + sum(counts))
    assert sizes[:2] == [3, 6] and steps < 32 + 16 + 8 + 4 + 8, (sizes, steps)
    m.probes.outcome(bs, 0, predicted)  # a probe whose drafts missed
    assert m.probes.cap(bs) == 3 and not m.probes.due(bs)


def test_batch_width_path_probes_too():
    m = SpecCostModel(widths=(4,), probe_every=2, probe_every_min=2, alpha=1.0)
    m.observe_step(4, PLAIN, 0.010)
    m.observe_step(4, 4, 0.014)
    for _ in range(300):
        m.observe_acceptance(3.0, 0)
    raw = {4: 4 * 3.0}
    expected = m.batch_expected([{4: 3.0}] * 4)
    picks = []
    for _ in range(4):
        picks.append(m.decide(4, expected=expected, calibrated=True, raw=raw).width)
        m.observe_step(4, picks[-1], 0.014 if picks[-1] else 0.010)
    assert picks == [PLAIN, 4, PLAIN, 4]  # one probe every 2 steps
    assert [m.decide(4, expected=expected, calibrated=True).width for _ in range(3)] == [PLAIN] * 3


def test_health_names_a_starved_or_floored_calibration_once(caplog):
    health = SpecHealth(window=64, min_steps=16)
    for _ in range(20):
        health.record([2.0, 0.1], verified=False)
    with caplog.at_level(logging.WARNING, logger="rhyme_sglang.core.health"):
        report = health.report([])
        assert report["status"] == STARVED and report["verify_share_when_promising"] == 0.0
        health.report([])
    assert sum("verify_starved" in r.message for r in caplog.records) == 1
    for _ in range(64):  # the window moves on: weak drafts only
        health.record([0.2], verified=False)
    assert health.report([])["status"] == OK
    assert health.report(["0.25-0.5"])["status"] == AT_BOUND
    for _ in range(64):
        health.record([3.0], verified=True)
    report = health.report([])
    assert report["status"] == OK and report["verify_share_when_promising"] == 1.0
    with pytest.raises(ValueError):
        SpecHealth(window=8, min_steps=9)


def test_a_probe_is_wanted_only_after_drafts_good_enough_for_one():
    """Resting steps skip drafting; a due probe ends the rest only where the last decision's
    drafts could have been probed (else useless drafts would be looked up every step)."""
    m = _model(4, _step_seconds(4, 4))
    for _ in range(PROBE_EVERY):
        d = m.decide(4, gains=[[0.02]] * 4, raw=[[0.02]] * 4)
    assert m.probes.due(4) and not d.promising
    d = m.decide(4, gains=[[0.02]] * 4, raw=[[0.9, 0.8]] * 4)  # a probe: drafts predict 1.7 tokens
    assert d.reason == "probe" and d.promising
