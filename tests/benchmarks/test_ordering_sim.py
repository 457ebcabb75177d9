"""The ordering simulator used to explain bench_rollout's FCFS-vs-LPT measurement."""

import pytest

from benchmarks.ordering_sim import compare, makespan, order_queue, step_curve

REQS = [("short", 1), ("short", 1), ("long", 10)]
PRED = {"short": 1.0, "long": 10.0}


def test_lpt_queue_puts_longest_predicted_group_first_and_keeps_groups_together():
    reqs = [("a", 3), ("b", 9), ("a", 4), ("b", 8), ("c", 1)]
    got = order_queue(reqs, {"a": 3.0, "b": 8.5, "c": 1.0}, "lpt")
    assert got == [("b", 9), ("b", 8), ("a", 3), ("a", 4), ("c", 1)]
    assert order_queue(reqs, {}, "fcfs") == reqs


def test_flat_step_cost_rewards_longest_first():
    # 2 slots, each step costs 1 s whatever the batch: FCFS runs the long request last.
    assert makespan(REQS, PRED, "fcfs", 2, lambda b: 1.0) == 11.0
    assert makespan(REQS, PRED, "lpt", 2, lambda b: 1.0) == 10.0


def test_step_cost_proportional_to_batch_makes_order_irrelevant():
    # When a step costs in proportion to the requests in it, the makespan is the total work.
    for policy in ("fcfs", "lpt"):
        assert makespan(REQS, PRED, policy, 2, lambda b: float(b)) == 12.0
    assert compare(REQS, PRED, 2, lambda b: float(b))["lpt_speedup"] == 1.0


def test_step_curve_from_cost_model_interpolates_between_buckets():
    curve = step_curve({"seconds_per_request_step": {"1": {"plain": 0.06, "spec": 0.07},
                                                     "4": {"plain": 0.02, "spec": None}}})
    assert curve(1) == pytest.approx(0.06)
    assert curve(4) == pytest.approx(0.08)
    assert curve(2) == pytest.approx(0.06 + (0.08 - 0.06) / 3)
    assert curve(8) == pytest.approx(0.16)
    by_width = step_curve({"seconds_per_request_step": {"1": {"0": 0.06, "4": 0.07},
                                                        "4": {"0": 0.02}}})
    assert by_width(4) == pytest.approx(0.08)


def test_bad_arguments():
    with pytest.raises(ValueError, match="policy"):
        order_queue(REQS, PRED, "sjf")
    with pytest.raises(ValueError, match="slots"):
        makespan(REQS, PRED, "fcfs", 0, lambda b: 1.0)
    with pytest.raises(ValueError, match="plain"):
        step_curve({"seconds_per_request_step": {}})


def test_a_stepper_sees_its_engines_waiting_queue_before_each_step():
    """The rollout simulator's cost model needs the waiting queue (its predicted tokens) for
    the critical-path horizon, as the engine notes it after each scheduling pass."""
    from benchmarks.ordering_sim import SimRequest, Stepper, simulate

    class Recording(Stepper):
        def __init__(self):
            self.seen = []

        def queue(self, engine, waiting):
            self.seen.append((engine, [r.key for r in waiting]))

        def step(self, engine, running):
            return 1.0, [1] * len(running)

    reqs = [SimRequest(f"r{i}", "g", 2) for i in range(3)]
    stepper = Recording()
    assert simulate([reqs], 1, stepper)["makespan_s"] == 6.0
    assert stepper.seen == [(0, ["r1", "r2"])] * 2 + [(0, ["r2"])] * 2 + [(0, [])] * 2
