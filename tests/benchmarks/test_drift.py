"""benchmarks.drift: a bench_rollout report's makespans at one pooled plain-step speed."""

import pytest

from benchmarks.drift import speed_factors, summary


def _run(epoch, round_, slow, batches, makespan, verify_s=0.0):
    """A timed run whose plain steps at batch b take b * 10 ms times ``slow``."""
    timeline = [[0.0, "plain", bs, 0.01 * bs * slow, bs] for bs in batches]
    if verify_s:
        timeline.append([0.0, "verify_w4", 4, verify_s, 6])
    return ({"epoch": epoch, "round": round_, "window_s": makespan, "timeline": timeline},
            {"epoch": epoch, "round": round_, "makespan_s": makespan})


def _report(runs_by_mode):
    report = {"breakdown": {}, "per_epoch": {}}
    for mode, runs in runs_by_mode.items():
        for b, e in runs:
            report["breakdown"].setdefault(mode, []).append(b)
            report["per_epoch"].setdefault(mode, []).append(e)
    return report


def test_a_slow_run_is_levelled_to_the_pools_speed():
    steps = [1, 1, 2, 2, 8, 32]
    report = _report({
        # vanilla's epoch 2 ran in a phase 30% slower; both took the same steps
        "vanilla": [_run(2, 0, 1.3, steps, 130.0), _run(3, 0, 1.0, steps, 100.0)],
        "rhyme": [_run(2, 0, 1.0, steps, 90.0), _run(3, 0, 1.0, steps, 90.0)],
    })
    factors = speed_factors(report)
    slow, fast = factors["vanilla"]
    assert slow["factor"] == pytest.approx(1 / 1.3) and fast["factor"] == pytest.approx(1.0)
    out = summary(report)
    assert out["vanilla"]["levelled_s"] == pytest.approx(200.0)
    assert out["rhyme"]["raw_ratio"] == pytest.approx(230.0 / 180.0)
    assert out["rhyme"]["levelled_ratio"] == pytest.approx(200.0 / 180.0)


def test_round_means_per_epoch_and_runs_without_plain_steps_left_out():
    steps = [1, 2, 4]
    report = _report({
        "vanilla": [_run(2, 0, 1.0, steps, 100.0), _run(2, 1, 1.0, steps, 110.0)],
        "rhyme": [_run(2, 0, 1.0, steps, 80.0), _run(2, 1, 1.0, steps, 100.0)],
        "rhyme_fixed": [_run(2, 0, 1.0, [], 150.0, verify_s=0.5)],
    })
    out = summary(report)
    assert "rhyme_fixed" not in out
    assert out["vanilla"]["makespan_s"] == pytest.approx(105.0)
    assert out["rhyme"]["levelled_ratio"] == pytest.approx(105.0 / 90.0)


def test_a_report_without_vanilla_plain_steps_is_refused():
    report = _report({"rhyme": [_run(2, 0, 1.0, [1, 2], 50.0)]})
    with pytest.raises(ValueError, match="vanilla"):
        summary(report)
