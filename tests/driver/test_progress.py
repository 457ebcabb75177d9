"""The CLI's progress sinks: a bar per phase of an epoch on a terminal, plain lines elsewhere."""

from __future__ import annotations


def test_phase_bars_follow_each_phase(capsys):
    from rl_driver.progress_view import PhaseBars

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


def test_phase_lines_print_a_phase_at_its_end_and_every_interval():
    import io

    from rl_driver.progress_view import PhaseLines

    now, out = [0.0], io.StringIO()
    lines = PhaseLines(out, interval_s=10.0, clock=lambda: now[0])
    for done in range(26):  # one update a second: lines at 10 s, 20 s and the end (25 s)
        lines.rollout(done, 25, 20 * done, now[0] or 1.0)
        now[0] += 1.0
    lines.rollout(25, 25, 500, 25.0)  # the loop's last update again: no second end line
    lines.train(0, 0)  # a phase with nothing to do ends at once
    lines.sync(None)
    lines.sync(2.5)
    assert out.getvalue().splitlines() == [
        "  rollout: 10/25 requests, 20 tok/s, 10.0s",
        "  rollout: 20/25 requests, 20 tok/s, 20.0s",
        "  rollout: 25/25 requests, 20 tok/s, 25.0s",
        "  train: 0/0 micro-batches, 0.0s",
        "  sync: 1/1 step, 2.5s",
    ]
    lines.rollout(0, 25, 0, 0.0)  # the next epoch's rollout is a new phase
    lines.rollout(25, 25, 500, 5.0)
    assert out.getvalue().splitlines()[-1] == "  rollout: 25/25 requests, 100 tok/s, 0.0s"


# `rhyme-rl train` with its output to pipes: a fake loop drives the real sink and epoch hook
_PIPED_TRAIN = """
import time
import rl_driver.cli as cli
import rl_driver.loop as loop
from rl_driver.progress_view import PhaseLines
from rl_driver.config import RunConfig, config_from_dict

def fake_run(config, resume, on_epoch, progress):
    for epoch in range(2):
        t0 = time.monotonic()
        for done in range(61):  # 1.2 s of rollout updates, 20 ms apart
            progress.rollout(done, 60, 10 * done, time.monotonic() - t0)
            time.sleep(0.02)
        for done in range(31):
            progress.train(done, 30)
            time.sleep(0.02)
        progress.sync(None)
        progress.sync(0.1)
        on_epoch({"epoch": epoch, "mean_reward": 0.5, "tau": 1.5})
    return []

loop.run = fake_run
cli.startup_line = lambda config: config.name + ": fake machine"
PhaseLines.INTERVAL_S = 0.5
RunConfig.resolved = lambda self: self
cli.train(config_from_dict({"name": "piped", "loop": {"report": False}}))
"""


def test_progress_to_a_pipe_is_plain_lines_at_most_one_per_interval():
    import re
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _PIPED_TRAIN], capture_output=True, timeout=120)
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    out, err = run.stdout.decode(), run.stderr.decode()
    assert "\r" not in out + err
    assert out.splitlines() == ["piped: fake machine"]
    assert [line for line in err.splitlines() if "epoch" in line] == [
        f"piped: epoch {e} done, reward 0.500, tau 1.50" for e in (0, 1)]
    phases = []  # (phase, [(done, total, seconds), ...]) per phase run
    for line in err.splitlines():
        m = re.fullmatch(r"  (rollout|train): (\d+)/(\d+) \S+(?:, \d+ tok/s)?, ([\d.]+)s", line)
        if m:
            if not phases or phases[-1][0] != m[1] or phases[-1][1][-1][0] == phases[-1][1][-1][1]:
                phases.append((m[1], []))
            phases[-1][1].append((int(m[2]), int(m[3]), float(m[4])))
    assert [name for name, _ in phases] == ["rollout", "train"] * 2
    assert all(len(seen) >= 3 for name, seen in phases if name == "rollout")  # 1.2 s: 2 + end
    for name, seen in phases:
        assert [done == total for done, total, _ in seen] == [False] * (len(seen) - 1) + [True]
        times = [s for _, _, s in seen[:-1]]  # between lines of a phase run: the interval
        assert all(b - a >= 0.5 - 0.1 for a, b in zip([0.0] + times, times)), (name, seen)
    assert err.count("  sync: 1/1 step, 0.1s") == 2
