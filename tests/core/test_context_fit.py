"""Step costs that grow with context: the online fit, and decisions that use it.

The synthetic steps follow what the CPU attention of SmolLM2 measured (stop 44, fp32, one
thread, CPU flags avx512/amx; ``benchmarks/bench_attention.py``'s op cases): at batch 11 a plain step's attention is 6.8 ms at 100-token contexts and
91 ms at 1200 (~7 us per context token), one extra row per request adds 5.8 ms at 100 and
32 ms at 1200 (~2.4 us per row x context token)."""

import numpy as np
import pytest

from rhyme_sglang.core.context_fit import ContextFit
from rhyme_sglang.core.cost_model import PLAIN, SpecCostModel, bucket_of

C_KEYS, C_ROWS = 7e-6, 2.4e-6


def true_seconds(bs, extra_rows, contexts, extra_per_request=None):
    """Weights and per-row work, plus the two context terms."""
    keys = sum(contexts)
    per = extra_per_request if extra_per_request is not None else [extra_rows // bs] * bs
    row_keys = sum(e * c for e, c in zip(per, contexts))
    return 0.030 + 0.0015 * bs + 0.0008 * extra_rows + C_KEYS * keys + C_ROWS * row_keys


def rollout_steps(seed=0, steps=600, widths=(0, 0, 0, 1, 2, 4)):
    """A shrinking batch whose contexts grow: (bs, width, contexts, seconds with 3% noise)."""
    rng = np.random.default_rng(seed)
    contexts = list(rng.integers(50, 200, size=16))
    out = []
    for step in range(steps):
        if len(contexts) > 1 and rng.random() < 0.02:
            contexts.pop(int(rng.integers(len(contexts))))
        bs = len(contexts)
        w = int(rng.choice(widths))
        sec = true_seconds(bs, w * bs, contexts) * (1 + 0.03 * rng.standard_normal())
        out.append((bs, w, list(contexts), sec))
        contexts = [c + 1 + w // 2 for c in contexts]
    return out


def test_the_fit_recovers_the_context_costs_of_a_rollout():
    fit = ContextFit()
    for bs, w, ctx, sec in rollout_steps():
        keys = sum(ctx)
        fit.observe((bucket_of(bs), w), bs, sec, keys, w * keys, w * bs)
    c_keys, c_rows = fit.coefficients()
    assert c_keys == pytest.approx(C_KEYS, rel=0.2)
    assert c_rows == pytest.approx(C_ROWS, rel=0.35)


def test_the_prior_holds_until_enough_steps_and_coefficients_stay_non_negative():
    fit = ContextFit(min_steps=10, prior=(1e-6, 0.0))
    assert fit.coefficients() == (1e-6, 0.0)
    for i in range(10):  # seconds fall as contexts grow: a negative slope is not kept
        fit.observe((8, 0), 8, 0.1 - 0.001 * i, 1000 + 100 * i, 0.0, 0)
    assert fit.coefficients() == (1e-6, 0.0)  # 9 innovations (the first step sets the group)
    fit.observe((8, 0), 8, 0.089, 2000, 0.0, 0)
    assert fit.coefficients()[0] == 0.0
    for bad in (-1.0, float("nan"), "x"):
        with pytest.raises(ValueError, match="c_keys"):
            fit.seed(bad, 0.0)
    with pytest.raises(ValueError, match="forget"):
        ContextFit(forget=0.0)


def test_one_stall_does_not_bend_the_fit():
    fit = ContextFit(min_steps=4)
    for i in range(200):
        ctx = 100 + 5 * i
        sec = 0.05 + C_KEYS * 8 * ctx
        if i == 100:
            sec *= 20  # a page fault, a neighbour's burst
        fit.observe((8, 0), 8, sec, 8 * ctx, 0.0, 0)
    assert fit.coefficients()[0] == pytest.approx(C_KEYS, rel=0.25)


def _model_after(steps, **kw):
    m = SpecCostModel(widths=(1, 2, 4), reexplore_every=10_000, **kw)
    for bs, w, ctx, sec in steps:
        m.observe_step(bs, w, sec, contexts=ctx)
    return m


def test_a_verify_cell_measured_at_short_contexts_is_priced_at_long_ones():
    """Run 28's loss: width-1 cells measured early (short contexts) and a plain baseline
    measured now (long contexts). Without contexts width 1 looks worth 10% more tokens;
    priced at the batch's contexts it costs ~25% more than plain, and plain wins."""
    steps = rollout_steps(steps=400)  # the fit learns on the way
    bs = 11
    short, long_ = [150] * bs, [1200] * bs
    m = _model_after(steps)
    for _ in range(5):
        m.observe_step(bs, 1, true_seconds(bs, bs, short), contexts=short)
        m.observe_step(bs, PLAIN, true_seconds(bs, 0, long_), contexts=long_)
    expected = {1: 0.12 * bs, 2: 0.12 * bs, 4: 0.12 * bs}  # weak drafts: 12% of a token each
    truth_w1 = (bs + expected[1]) / true_seconds(bs, bs, long_)
    truth_plain = bs / true_seconds(bs, 0, long_)
    assert truth_w1 < truth_plain  # the verify loses at these contexts
    rates = m.rates(bs, expected, calibrated=True, keys=sum(long_))
    assert rates[1] == pytest.approx(truth_w1, rel=0.1)
    assert rates[PLAIN] == pytest.approx(truth_plain, rel=0.05)
    assert m.decide(bs, expected=expected, calibrated=True, contexts=long_).width == PLAIN
    # without the contexts the cells read as measured, and the stale verify cell wins
    blind = _model_after([(b, w, c, s) for b, w, c, s in steps])
    for _ in range(5):
        blind.observe_step(bs, 1, true_seconds(bs, bs, short))
        blind.observe_step(bs, PLAIN, true_seconds(bs, 0, long_))
    assert blind.decide(bs, expected=expected, calibrated=True).width != PLAIN
    # at short contexts the same drafts pay, and the context-aware model verifies
    assert m.decide(bs, expected={w: 0.5 * bs for w in (1, 2, 4)}, calibrated=True,
                    contexts=short).width != PLAIN


def test_ragged_rows_of_a_long_request_cost_more_than_a_short_ones():
    """Same gains on two requests; the one with the long context pays ~6x per row."""
    m = _model_after(rollout_steps(steps=400))
    ctx = [100, 3000]
    bs = 2
    m.observe_step(bs, PLAIN, true_seconds(bs, 0, ctx), contexts=ctx)
    for lens in ([3, 1], [1, 3], [5, 5]):
        per = [n - 1 for n in lens]
        m.observe_step(bs, 4, true_seconds(bs, sum(per), ctx, per), rows=sum(lens),
                       contexts=ctx, lens=lens)
    gains = [[0.6, 0.4, 0.3, 0.2], [0.6, 0.4, 0.3, 0.2]]
    width, counts = m.decide(bs, gains=gains, contexts=ctx)[:2]
    assert width and counts[0] > counts[1]


def test_context_free_steps_read_as_before():
    """Callers that pass no contexts (the simulator) get the cells as measured."""
    m = SpecCostModel(widths=(2,))
    m.observe_step(4, PLAIN, 0.2)
    m.observe_step(4, 2, 0.3)
    assert m.step_time(4, PLAIN) == pytest.approx(0.2)
    assert m.step_time(4, 2) == pytest.approx(0.3)
    assert m.context_coefficients() == (0.0, 0.0)
    with pytest.raises(ValueError, match="one context"):
        m.observe_step(4, PLAIN, 0.2, contexts=[1, 2])
    with pytest.raises(ValueError, match="one context"):
        m.decide(4, expected={2: 1.0}, contexts=[1])


def test_decisions_say_why_and_what_they_expect():
    """The decision log's fields (RHYME_DECISION_LOG): the reason of each choice and the
    expected drafts and seconds of the chosen step."""
    m = SpecCostModel(widths=(2,), reexplore_every=10_000)
    ctx = [300, 500]
    gains = [[0.9, 0.8], [0.9, 0.8]]
    d = m.decide(2, gains=gains, contexts=ctx)
    assert d[:2] == (PLAIN, [0, 0]) and d.reason == "baseline"
    m.observe_step(2, PLAIN, 0.05, contexts=ctx)
    width, counts, reason = m.decide(2, gains=gains, contexts=ctx)[:3]
    assert width == 2 and reason == "explore"
    m.observe_step(2, 2, 0.06, rows=2 + sum(counts), contexts=ctx, lens=[c + 1 for c in counts])
    width, counts, reason = m.decide(2, gains=gains, contexts=ctx)[:3]
    assert width == 2 and reason == "best"
    gain, seconds = m.predict(2, gains, counts, ctx)
    assert gain == pytest.approx(sum(sum(g[:c]) for g, c in zip(gains, counts)))
    # the explore step ran one row in 0.06 s against 0.05 s plain: 0.01 s a row
    assert seconds == pytest.approx(0.05 + 0.01 * sum(counts))
    assert m.predict(2, gains, [0, 0], ctx) == (0.0, pytest.approx(0.05))
    stats = m.as_dict()  # /rhyme/stats: where each cell was measured, and the fit
    assert stats["measured_at_context"]["2"]["0"] == [400.0, 0.0]
    assert stats["measured_at_context"]["2"]["2"][0] == 400.0
    assert stats["context"]["innovations"] == 0  # one step per cell: no innovation yet
