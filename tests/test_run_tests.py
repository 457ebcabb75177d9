"""scripts/run_tests.py: every test module is in some job, lanes split the CPUs."""

from __future__ import annotations

import importlib.util
import itertools
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("run_tests", ROOT / "scripts" / "run_tests.py")
run_tests = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_tests)


def test_every_marker_set_lands_in_exactly_one_job():
    """Jobs are chosen by marker: every combination of the markers that decide a job matches
    exactly one job's expression; the lossless suite runs alone and no marker job runs it."""
    decisive = ("engine", "server", "ray", "sglang", "torch", "slow")
    for bits in itertools.product((False, True), repeat=len(decisive)):
        markers = {m for m, on in zip(decisive, bits) if on}
        matching = [n for n, e in run_tests.MARKER_JOBS.items() if run_tests._matches(e, markers)]
        assert matching == [run_tests.job_of(markers)], markers
    assert run_tests.job_of({"ray", "engine", "sglang"}) == "ray"
    assert run_tests.job_of({"engine", "server"}) == "server"
    assert run_tests.job_of({"engine", "sglang", "torch"}) == "engine"
    assert run_tests.job_of({"sglang", "torch"}) == "unit"
    jobs = dict(run_tests.jobs())
    assert (ROOT / run_tests.LOSSLESS).is_file() and jobs[run_tests.LOSSLESS] == [run_tests.LOSSLESS]
    for name, expr in run_tests.MARKER_JOBS.items():
        assert jobs[name] == ["tests", f"--ignore={run_tests.LOSSLESS}", "-m", expr]
    names = [name for name, _ in run_tests.jobs()]
    expected = [run_tests.EXPECTED_S.get(n, run_tests.DEFAULT_S) for n in names]
    assert expected == sorted(expected, reverse=True)  # longest first


def test_a_users_marker_expression_narrows_every_job():
    rest, marks = run_tests.split_marks(["-x", "-m", "not slow", "-k", "loop"])
    assert rest == ["-x", "-k", "loop"] and marks == "not slow"
    assert run_tests.split_marks(["-mslow"]) == ([], "slow")
    jobs = dict(run_tests.jobs("not slow"))
    assert jobs["ray"][-2:] == ["-m", "(ray) and (not slow)"]
    assert jobs[run_tests.LOSSLESS] == [run_tests.LOSSLESS, "-m", "not slow"]


def test_lanes_split_the_cpus_without_overlap(monkeypatch):
    """Lanes of at least two cores each get disjoint shares; with fewer cores they share all."""
    cpus = sorted(os.sched_getaffinity(0))
    assert run_tests.lane_cpus(1) == [set(cpus)]
    for machine in (list(range(2)), list(range(3)), list(range(4)), list(range(9))):
        monkeypatch.setattr(run_tests.os, "sched_getaffinity", lambda _pid, m=machine: set(m))
        shares = run_tests.lane_cpus(2)
        if len(machine) < 4:
            assert shares == [set(machine)] * 2
        else:
            assert all(len(s) >= 2 for s in shares) and not shares[0] & shares[1]
            assert shares[0] | shares[1] == set(machine)
        assert run_tests.lane_cpus(len(machine)) == [set(machine)] * len(machine)


def test_default_lanes_follow_the_cores(monkeypatch):
    monkeypatch.delenv("RHYME_TEST_LANES", raising=False)
    for cores, lanes in ((1, 1), (2, 2), (3, 2), (4, 2), (8, 4)):
        monkeypatch.setattr(run_tests.os, "sched_getaffinity", lambda _pid, n=cores: set(range(n)))
        assert run_tests.default_lanes() == lanes, cores


def test_lanes_from_the_environment(monkeypatch):
    monkeypatch.setenv("RHYME_TEST_LANES", "3")
    assert run_tests.default_lanes() == 3
    monkeypatch.setenv("RHYME_TEST_LANES", "two")
    with pytest.raises(ValueError, match="RHYME_TEST_LANES"):
        run_tests.default_lanes()
    monkeypatch.delenv("RHYME_TEST_LANES")
    cores = len(os.sched_getaffinity(0))
    assert run_tests.default_lanes() == (cores // 2 if cores >= 4 else min(2, cores))


def test_passed_job_summary_keeps_the_slowest_tests_and_the_counts():
    log = ["....", "=== slowest 2 durations ===", "12.00s call     tests/a.py::test_x",
           "3.00s setup    tests/b.py::test_y", "(1 durations < 0.005s hidden.)",
           "4 passed in 15.1s"]
    assert run_tests._summary(log) == ["12.00s call     tests/a.py::test_x",
                                       "3.00s setup    tests/b.py::test_y", "4 passed in 15.1s"]
    assert run_tests._summary(["..", "2 passed in 1.0s"]) == ["2 passed in 1.0s"]


def test_run_order_one_lane_shortest_first_several_lanes_shortest_then_longest():
    expected = lambda order: [run_tests.EXPECTED_S.get(n, run_tests.DEFAULT_S) for n, _ in order]
    one = expected(run_tests.run_order(1))
    assert one == sorted(one)
    two = expected(run_tests.run_order(2))
    assert two[0] == min(two) and two[1:] == sorted(two[1:], reverse=True)
    assert sorted(run_tests.run_order(2)) == sorted(run_tests.jobs())
