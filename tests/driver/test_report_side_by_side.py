"""``write_report`` on a fake run dir: per-epoch figures without ratios to epoch 0, whole-epoch
ticks, and the side-by-side section from ``side_by_side.json`` (no engines started)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("matplotlib")

from rhyme_sglang.core.breakdown import TimeBreakdown  # noqa: E402
from rl_driver.metrics import append_metrics, summarize_breakdown  # noqa: E402
from rl_driver.report import SIDE_BY_SIDE, save_side_by_side, write_report  # noqa: E402


def _breakdown(steps):
    """A summarized engine breakdown: one prefill, then ``steps`` as ``(width, count,
    requests, tokens, rows)`` decode steps of 0.1 s each."""
    b = TimeBreakdown(clock=lambda: 0.0, faults=lambda: 0)
    b.on_prefill(0.0, 0.5, requests=4, tokens=40, cached_tokens=0)
    t = 0.5
    for width, count, requests, tokens, rows in steps:
        for _ in range(count):
            b.on_decode(t, width, 0.1, requests=requests, tokens=tokens, rows=rows)
            t += 0.1
    b.on_step_end(0.3, busy=False)
    return summarize_breakdown(b.as_dict(now=t))


def _epoch(epoch, tokens_per_s):
    return {"epoch": epoch, "mean_reward": 0.1 * epoch, "rollout_makespan_s": 10.0 - epoch,
            "tokens_per_s": tokens_per_s, "tau": 1.5, "mean_response_len": 40.0,
            "bubble_ratio": 0.1, "migrations": 0, "train_time_s": 3.0, "sync_time_s": 0.5,
            "predicted_imbalance": 1.01, "predicted_imbalance_round_robin": 1.1,
            "timeline": {"0": [[0.0, 5.0]]}, "engine_busy_s": [5.0],
            "breakdown": [_breakdown([(0, 5, 4, 4, 4), (2, 3, 4, 8, 12)])]}


# vanilla: 100 plain steps; RHYME: 10 plain + 30 verify_w2 steps -> 60 decode steps saved
COMPARE = {
    "vanilla": {"makespan_s": 20.0, "tokens_per_s": 50.0, "tau": 1.0, "output_tokens": 1000,
                "output_ids": [[0, 0, [1, 2, 3]]], "breakdown": _breakdown([(0, 100, 4, 4, 4)])},
    "rhyme": {"makespan_s": 12.5, "tokens_per_s": 80.0, "tau": 2.5, "output_tokens": 1000,
              "output_ids": [[0, 0, [1, 2, 3]]],
              "breakdown": _breakdown([(0, 10, 4, 4, 4), (2, 30, 4, 12, 12)])},
    "concurrent": True, "same_tokens": 0.95, "speedup_tokens_per_s": 1.6,
    "speedup_makespan": 1.6,
}


@pytest.fixture
def run_dir(tmp_path):
    for epoch, tps in enumerate((100.0, 300.0, 320.0)):
        append_metrics(tmp_path / "metrics.jsonl", _epoch(epoch, tps))
    return tmp_path


def test_report_has_no_ratio_to_epoch_0_and_no_side_by_side_without_its_file(run_dir):
    text = write_report(run_dir, title="fake run").read_text()
    assert "| epoch | reward | rollout s | tok/s | tau |" in text
    assert "| 1 | 0.100 | 9.0 | 300 | 1.50 |" in text
    assert "ep0" not in text and "speedup" not in text and "3.00x" not in text
    assert "Side by side" not in text
    for name in ("reward.png", "tau.png", "rollout_time.png", "timeline.png", "breakdown.png"):
        assert (run_dir / name).stat().st_size > 1000


def test_report_has_the_side_by_side_section(run_dir):
    path = save_side_by_side(run_dir, COMPARE)
    saved = json.loads(path.read_text())
    assert path.name == SIDE_BY_SIDE
    assert "output_ids" not in saved["vanilla"] and "output_ids" not in saved["rhyme"]
    assert saved["rhyme"]["breakdown"]["decode"]["verify_w2"]["steps"] == 30
    text = write_report(run_dir, title="fake run").read_text()
    section = text[text.index("## Side by side: vanilla SGLang vs RHYME (final policy)"):]
    assert "(both engines at once)" in section
    assert "| vanilla SGLang | 20.0 | 50 | 1.00 |" in section
    assert "| RHYME | 12.5 | 80 | 2.50 |" in section
    assert "x1.60 tok/s, x1.60 makespan; same tokens for 95% of requests" in section
    assert "Decode steps saved by RHYME: 60 (vanilla 100, RHYME 40," in section
    assert "**vanilla SGLang**: prefill 0.5 s, other 0.3 s" in section
    # rows per kind, most seconds first: steps, seconds, s a step, batch, rows in, tokens out
    rhyme = section[section.index("**RHYME**"):]
    assert rhyme.index("| verify_w2 | 30 | 3.0 | 0.100 | 4.0 | 12.0 | 12.0 |") < rhyme.index(
        "| plain | 10 | 1.0 | 0.100 | 4.0 | 4.0 | 4.0 |")
    assert "ep0" not in text and "speedup" not in text


def test_demo_steps_text_uses_the_report_figures():
    from rl_driver.demo import _steps_text

    text = _steps_text(COMPARE["rhyme"]["breakdown"]).splitlines()
    assert text[0] == "prefill 0.5s, other 0.3s, decode:"
    assert text[1].split() == ["verify_w2", "30", "steps", "3.0s", "(0.100", "s,", "batch", "4.0,",
                               "12.0", "rows", "in,", "12.0", "tokens", "out", "a", "step)"]
    assert _steps_text(None) == "no breakdown"


def test_epoch_axes_tick_whole_epochs_only():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rl_driver.report import _epoch_axis

    fig, ax = plt.subplots()
    ax.plot([0, 1, 2], [1.0, 2.0, 3.0])
    _epoch_axis(ax)
    fig.canvas.draw()
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    plt.close(fig)
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
