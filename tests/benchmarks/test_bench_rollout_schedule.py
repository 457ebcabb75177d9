"""bench_rollout's timed runs: the alternating order that keeps machine drift out of the
speedups, and the summary that averages an epoch's rounds."""

import pytest

from benchmarks.bench_rollout import _mode_summary, schedule


def test_schedule_alternates_the_order_every_slot():
    runs = schedule(["vanilla", "ngram", "rhyme"], first=2, epochs=4)
    assert runs == [(2, 0, "vanilla"), (2, 0, "ngram"), (2, 0, "rhyme"),
                    (3, 0, "rhyme"), (3, 0, "ngram"), (3, 0, "vanilla")]


def test_schedule_gives_every_mode_the_same_mean_position():
    modes = ["vanilla", "ngram", "rhyme", "rhyme_fixed"]
    runs = schedule(modes, first=1, epochs=3, repeats=2)  # 4 slots
    assert len(runs) == 2 * 2 * len(modes)
    positions = {m: [i for i, (_, _, name) in enumerate(runs) if name == m] for m in modes}
    means = {m: sum(p) / len(p) for m, p in positions.items()}
    assert max(means.values()) - min(means.values()) < 1e-9, means
    assert [(e, r) for e, r, _ in runs[::len(modes)]] == [(1, 0), (1, 1), (2, 0), (2, 1)]


@pytest.mark.parametrize("bad", [dict(repeats=0), dict(first=3), dict(modes=[])])
def test_schedule_refuses_bad_sizes(bad):
    kwargs = dict(modes=["vanilla"], first=1, epochs=3, repeats=1)
    kwargs.update(bad)
    with pytest.raises(ValueError):
        schedule(**kwargs)


def _run(epoch, makespan, tokens, round_=0):
    return {"epoch": epoch, "round": round_, "makespan_s": makespan, "output_tokens": tokens,
            "t90_s": makespan / 2, "tau": 1.5, "mean_reward": 0.25}


def test_summary_sums_epochs_of_round_means():
    runs = [_run(2, 10.0, 100), _run(2, 14.0, 100, 1), _run(3, 20.0, 300)]
    got = _mode_summary(runs)
    assert got["makespan_s"] == pytest.approx(12.0 + 20.0)
    assert got["output_tokens"] == pytest.approx(400)
    assert got["tokens_per_s"] == pytest.approx(400 / 32.0)
    assert got["t90_s"] == pytest.approx(6.0 + 10.0)
    assert got["makespan_by_round"] == {"2": [10.0, 14.0], "3": [20.0]}
    assert got["epochs"] == [2, 3] and got["same_tokens_as_vanilla"] == 1.0
