"""Run the test suite as separate pytest processes on parallel lanes (what `make test` calls).

Jobs are chosen by marker (``tests/conftest.py`` derives ``sglang`` / ``torch`` / ``ray`` from a
module's imports and ``engine`` from the ``engines`` fixture; ``server`` and ``slow`` are
written on the modules), so a test lands in its job wherever its file lies:

* ``unit``: neither an engine nor Ray;
* ``ray``: the driver's tests that start Ray (and its engines inside actors);
* ``engine``: the in-process engine tests, in one process: the session's ``EnginePool`` keeps
  one engine alive at a time, and after the first each starts in a few seconds (its scheduler
  and detokenizer are forked from a process that has sglang imported already; see
  ``rhyme_sglang/sglang_ext/forkserver.py``);
* ``server``: the modules that start HTTP server processes (router, server), together;
* the lossless suite (``LOSSLESS``), a job of its own.

Every marker combination matches exactly one job (``job_of``; a unit test checks it). A crashed
engine ends its job, and the runner reports that job's log. Lanes take jobs in turn from one
queue (see :func:`run_order`). A job's output is kept in a log and printed when it ends: in
full when it failed, its summary line when it passed. Arguments after ``--`` go to every job;
a ``-m EXPR`` there narrows each job's own expression.

Lanes default to one per two usable cores, each pinned to its own two or more, and to two lanes
sharing the cores on a machine with two or three: one job alone leaves much of a 2-core machine
idle (an engine's greedy tests keep one core busy, server starts wait on each other, the
driver's tests mostly wait for engines to start). A lane is pinned only to two or more cores:
an engine job needs more than one at its peaks (scheduler, detokenizer, tokenizer manager).
``RHYME_TEST_LANES`` or ``--lanes`` overrides the count. Measured timings per job are in
``docs/testing.md``.

    python scripts/run_tests.py [--lanes N] [--list] [-- PYTEST_ARGS...]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOSSLESS = "tests/sglang/test_spec_lossless.py"

# Each job's marker expression; together they match every marker set exactly once.
MARKER_JOBS = {
    "unit": "not engine and not server and not ray",
    "ray": "ray",
    "engine": "engine and not server and not ray",
    "server": "server and not ray",
}

# Expected seconds per job, measured on a 2-core machine with two lanes (a fresh clone, AMD
# EPYC with avx512_bf16); only the order of jobs depends on them. A job missing here: DEFAULT_S.
EXPECTED_S = {
    "ray": 725,
    "engine": 490,
    LOSSLESS: 430,
    "unit": 155,
    "server": 220,
}
DEFAULT_S = 60


def job_of(markers: set) -> str:
    """The job whose marker expression matches a test carrying ``markers`` (lossless aside)."""
    return next(name for name, expr in MARKER_JOBS.items() if _matches(expr, markers))


def _matches(expr: str, markers: set) -> bool:
    from _pytest.mark.expression import Expression

    return Expression.compile(expr).evaluate(lambda name, **_: name in markers)


def jobs(user_marks: str = "") -> list[tuple[str, list[str]]]:
    """(name, pytest arguments) of every job, longest expected first; ``user_marks`` (a
    ``-m`` expression given after ``--``) narrows each marker job."""
    out = [(LOSSLESS, [LOSSLESS] + (["-m", user_marks] if user_marks else []))]
    for name, expr in MARKER_JOBS.items():
        marks = f"({expr}) and ({user_marks})" if user_marks else expr
        out.append((name, ["tests", f"--ignore={LOSSLESS}", "-m", marks]))
    return sorted(out, key=lambda job: -EXPECTED_S.get(job[0], DEFAULT_S))


def run_order(lanes: int, user_marks: str = "") -> list[tuple[str, list[str]]]:
    """One lane: shortest first, so a failure shows early. Several lanes: the shortest job
    first, then longest first (LPT): the short job shares the machine at the start instead of
    running alone at the end on a half-idle machine (2 cores: the unit job alone for
    the last 1:39 of 16:43)."""
    order = jobs(user_marks)
    return order[::-1] if lanes == 1 else order[-1:] + order[:-1]


def default_lanes() -> int:
    """``RHYME_TEST_LANES``, else one lane per two usable cores, and two lanes sharing the cores
    on a machine with two or three."""
    env = os.environ.get("RHYME_TEST_LANES")
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"RHYME_TEST_LANES must be a positive integer, got {env!r}")
        return int(env)
    cores = len(os.sched_getaffinity(0))
    return max(1, cores // 2) if cores >= 4 else min(2, cores)


def lane_cpus(lanes: int) -> list[set[int]]:
    """Each lane's CPUs: the usable ones split into ``lanes`` contiguous shares of at least two
    (an engine job keeps about two cores busy at its peaks); with fewer, every lane shares them
    all and the kernel balances the lanes."""
    cpus = sorted(os.sched_getaffinity(0))
    if lanes <= 1 or 2 * lanes > len(cpus):
        return [set(cpus)] * lanes
    size = len(cpus) // lanes
    return [set(cpus[i * size:(i + 1) * size if i < lanes - 1 else None]) for i in range(lanes)]


def passed(rc: int) -> bool:
    """pytest's exit code 5 (every test of a job deselected, e.g. by ``-m``) is not a failure."""
    return rc in (0, 5)


DURATIONS = 8  # each job lists its slowest tests (``--durations``), so a log shows where time went


def _summary(lines: list[str]) -> list[str]:
    """A passed job's summary: pytest's slowest-durations table, if any, then its closing
    lines (counts, skips, xfails)."""
    slowest = []
    for i, line in enumerate(lines):
        if "slowest" in line and "durations" in line:
            for row in lines[i + 1:]:
                if not re.match(r"\d+\.\d+s ", row):
                    break
                slowest.append(row)
    return slowest + [ln for ln in lines[-15:] if "durations" not in ln and (
        ln.startswith(("=", "SKIPPED", "XFAIL")) or " passed" in ln or " skipped" in ln)]


def _clock(seconds: float) -> str:
    return f"{int(seconds) // 60}:{int(seconds) % 60:02d}"


class Runner:
    def __init__(self, pytest_args: list[str], log_dir: Path, lanes: int, user_marks: str = ""):
        self.pytest_args, self.log_dir, self.lanes = pytest_args, log_dir, lanes
        self.lock = threading.Lock()
        self.queue = run_order(lanes, user_marks)
        self.results: list[tuple[str, int, float]] = []
        self.start = time.monotonic()

    def _next(self):
        with self.lock:
            return self.queue.pop(0) if self.queue else None

    def lane(self, index: int, cpus: set[int]) -> None:
        pin = cpus != os.sched_getaffinity(0)
        while (job := self._next()) is not None:
            name, args = job
            log = self.log_dir / (name.replace("/", "_") + ".log")
            started = time.monotonic()
            with open(log, "w") as fh:
                pin_lane = (lambda: os.sched_setaffinity(0, cpus)) if pin else None
                durations = ([] if any(a.startswith("--durations") for a in self.pytest_args)
                             else [f"--durations={DURATIONS}"])
                rc = subprocess.call([sys.executable, "-m", "pytest", "-q", *args, *durations,
                                      *self.pytest_args], cwd=ROOT, stdout=fh,
                                     stderr=subprocess.STDOUT, preexec_fn=pin_lane)
            took = time.monotonic() - started
            self._report(name, rc, took, index, log)

    def _report(self, name: str, rc: int, took: float, lane: int, log: Path) -> None:
        text = log.read_text(errors="replace")
        ok = passed(rc)
        with self.lock:
            self.results.append((name, rc, took))
            status = "passed" if ok else f"FAILED (exit {rc})"
            print(f"== [{_clock(time.monotonic() - self.start)}] lane {lane}: {name} {status} "
                  f"in {_clock(took)}", flush=True)
            lines = text.rstrip().splitlines()
            shown = _summary(lines) if ok else lines
            for line in shown or lines[-1:]:
                print("   " + line, flush=True)

    def run(self) -> int:
        lanes = self.lanes
        threads = [threading.Thread(target=self.lane, args=(i + 1, cpus))
                   for i, cpus in enumerate(lane_cpus(lanes))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failed = [name for name, rc, _ in self.results if not passed(rc)]
        total = time.monotonic() - self.start
        print(f"== {len(self.results)} jobs on {lanes} lane(s) in {_clock(total)}; "
              + (f"FAILED: {', '.join(failed)}" if failed else "all passed"), flush=True)
        return 1 if failed else 0


def split_marks(pytest_args: list[str]) -> tuple[list[str], str]:
    """``pytest_args`` without its ``-m EXPR`` (or ``-mEXPR``), and that expression ("" if none)."""
    rest, marks = [], ""
    args = iter(pytest_args)
    for arg in args:
        if arg == "-m":
            marks = next(args, "")
        elif arg.startswith("-m") and not arg.startswith("--"):
            marks = arg[2:]
        else:
            rest.append(arg)
    return rest, marks


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args = []
    if "--" in argv:
        at = argv.index("--")
        argv, pytest_args = argv[:at], argv[at + 1:]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lanes", type=int, default=None, help="parallel pytest processes")
    parser.add_argument("--list", action="store_true", help="print the jobs in run order and exit")
    args = parser.parse_args(argv)
    pytest_args, user_marks = split_marks(pytest_args)
    lanes = default_lanes() if args.lanes is None else args.lanes
    if lanes < 1:
        parser.error(f"--lanes must be at least 1, got {lanes}")
    if args.list:
        for name, job_args in run_order(lanes, user_marks):
            print(f"{EXPECTED_S.get(name, DEFAULT_S):5d} s  {name}: pytest {' '.join(job_args)}")
        return 0
    with tempfile.TemporaryDirectory(prefix="rhyme-tests-") as tmp:
        print(f"== {len(jobs())} pytest jobs on {lanes} lane(s) (logs in {tmp} while they run)",
              flush=True)
        return Runner(pytest_args, Path(tmp), lanes, user_marks).run()


if __name__ == "__main__":
    sys.exit(main())
