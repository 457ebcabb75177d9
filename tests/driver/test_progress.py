"""The CLI's progress sink: one bar per phase of an epoch, closed when the phase is done."""

from __future__ import annotations


def test_phase_bars_follow_each_phase(capsys):
    from rl_driver.cli import PhaseBars

    bars = PhaseBars(nested=False)
    bars.rollout(0, 4, 0, 0.0)
    bars.rollout(4, 4, 300, 2.0)
    assert bars._bar is None  # a finished phase closes its bar
    bars.train(1, 2)
    assert bars._phase == "train" and bars._bar.n == 1
    bars.sync(None)
    bars.sync(1.25)
    bars.close()
    err = capsys.readouterr().err
    assert "rollout: 4/4 req" in err and "150 tok/s" in err
    assert "train: 1/2 micro-batch" in err and "sync: 1/1 step" in err and "1.2s" in err
