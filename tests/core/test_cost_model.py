"""The batch-level speculation budget picks the mode with the higher expected throughput."""

import pytest

from rhyme_sglang.core.cost_model import SpecCostModel, bucket_of


def test_buckets():
    assert [bucket_of(b) for b in (1, 2, 3, 4, 5, 48)] == [1, 2, 4, 4, 8, 64]
    with pytest.raises(ValueError):
        bucket_of(0)


def test_explores_each_mode_once_then_exploits():
    m = SpecCostModel(reexplore_every=1000)
    assert m.should_speculate(4, 2.0) is True  # spec unmeasured -> try it
    m.observe_step("spec", 4, 0.4)  # 0.1 s per request-step
    assert m.should_speculate(4, 2.0) is False  # plain unmeasured -> try it
    m.observe_step("plain", 4, 0.2)  # 0.05 s per request-step
    # spec: (4 + 2) tokens / 0.4 s = 15 tok/s < plain 20 tok/s
    assert m.should_speculate(4, 2.0) is False
    # with 8 expected accepts: 12 / 0.4 = 30 tok/s > 20
    assert m.should_speculate(4, 8.0) is True


def test_calibration_scales_the_store_estimate():
    m = SpecCostModel(reexplore_every=1000, alpha=1.0)
    m.observe_step("spec", 1, 0.02)
    m.observe_step("plain", 1, 0.01)
    assert m.should_speculate(1, 0.5) is False  # 1.5 / 0.02 = 75 < 100
    m.observe_acceptance(predicted=0.5, accepted=2)  # the store under-predicts x4
    assert m.should_speculate(1, 0.5) is True  # 3 / 0.02 = 150 > 100


def test_reexplores_the_losing_mode_periodically():
    m = SpecCostModel(reexplore_every=5)
    m.observe_step("spec", 1, 1.0)
    m.observe_step("plain", 1, 0.01)
    choices = [m.should_speculate(1, 0.0) for _ in range(10)]
    assert choices.count(True) == 2 and choices.count(False) == 8


def test_bad_arguments():
    with pytest.raises(ValueError):
        SpecCostModel(alpha=0.0)
    with pytest.raises(ValueError):
        SpecCostModel().observe_step("turbo", 1, 0.1)
