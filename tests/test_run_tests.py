"""scripts/run_tests.py: every test module is in some job, lanes split the CPUs."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("run_tests", ROOT / "scripts" / "run_tests.py")
run_tests = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_tests)


def test_engine_modules_share_a_job_the_lossless_suite_has_its_own():
    jobs = dict(run_tests.jobs())
    assert set(jobs) == {"unit", "tests/driver", "tests/sglang", run_tests.LOSSLESS}
    assert (ROOT / run_tests.LOSSLESS).is_file()
    assert jobs[run_tests.LOSSLESS] == [run_tests.LOSSLESS]
    assert jobs["tests/sglang"] == ["tests/sglang", f"--ignore={run_tests.LOSSLESS}"]
    assert "--ignore=tests/sglang" in jobs["unit"] and "--ignore=tests/driver" in jobs["unit"]
    names = [name for name, _ in run_tests.jobs()]
    expected = [run_tests.EXPECTED_S.get(n, run_tests.DEFAULT_S) for n in names]
    assert expected == sorted(expected, reverse=True)  # longest first


def test_lanes_split_the_cpus_without_overlap():
    cpus = sorted(os.sched_getaffinity(0))
    assert run_tests.lane_cpus(1) == [set(cpus)]
    if len(cpus) >= 2:
        shares = run_tests.lane_cpus(2)
        assert shares[0] and shares[1] and not shares[0] & shares[1]
        assert shares[0] | shares[1] == set(cpus)
    assert run_tests.lane_cpus(len(cpus) + 1) == [set(cpus)] * (len(cpus) + 1)


def test_lanes_from_the_environment(monkeypatch):
    monkeypatch.setenv("RHYME_TEST_LANES", "3")
    assert run_tests.default_lanes() == 3
    monkeypatch.setenv("RHYME_TEST_LANES", "two")
    with pytest.raises(ValueError, match="RHYME_TEST_LANES"):
        run_tests.default_lanes()
    monkeypatch.delenv("RHYME_TEST_LANES")
    assert run_tests.default_lanes() == max(1, len(os.sched_getaffinity(0)) // 2)


def test_passed_job_summary_keeps_the_slowest_tests_and_the_counts():
    log = ["....", "=== slowest 2 durations ===", "12.00s call     tests/a.py::test_x",
           "3.00s setup    tests/b.py::test_y", "(1 durations < 0.005s hidden.)",
           "4 passed in 15.1s"]
    assert run_tests._summary(log) == ["12.00s call     tests/a.py::test_x",
                                       "3.00s setup    tests/b.py::test_y", "4 passed in 15.1s"]
    assert run_tests._summary(["..", "2 passed in 1.0s"]) == ["2 passed in 1.0s"]
