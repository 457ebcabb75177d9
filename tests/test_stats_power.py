"""The distribution tests used for losslessness detect a 2% bias at the sample sizes used.

The lossless suite compares speculative samples with the exact distribution of plain decoding
(one-sample goodness of fit); it used to compare them with a second, non-speculative sample of
the same size (two-sample homogeneity). Both are measured here, on the same draws: the exact
reference must be at least as powerful, and neither may raise false alarms.
"""

import numpy as np

from tests.helpers import goodness_of_fit_pvalue, homogeneity_pvalue

P = np.array([0.3, 0.25, 0.2, 0.15, 0.1])
N, ALPHA, TRIALS = 16000, 1e-3 / 3, 20


def _biased() -> np.ndarray:
    q = P.copy()
    q[0] -= 0.02
    q[1] += 0.02  # total-variation distance 0.02, on the two most likely tokens (hardest case)
    return q


def test_distribution_tests_have_power():
    rng = np.random.default_rng(0)
    exact = dict(enumerate(P.tolist()))
    two_sample = one_sample = false_two = false_one = 0
    for _ in range(TRIALS):
        a, b, c = (rng.choice(5, size=N, p=d).tolist() for d in (P, _biased(), P))
        two_sample += homogeneity_pvalue(a, b) < ALPHA
        false_two += homogeneity_pvalue(a, c) < ALPHA
        one_sample += goodness_of_fit_pvalue(b, exact) < ALPHA
        false_one += goodness_of_fit_pvalue(c, exact) < ALPHA
    assert two_sample >= TRIALS // 2, two_sample
    assert one_sample >= max(two_sample, TRIALS - 1), (one_sample, two_sample)
    assert false_two == 0 and false_one == 0, (false_two, false_one)


def test_goodness_of_fit_pools_rare_outcomes_and_refuses_impossible_ones():
    probs = {0: 0.5, 1: 0.4999, 2: 0.0001}  # outcome 2 is expected 0.1 times in 1000
    rng = np.random.default_rng(1)
    sample = rng.choice(3, size=1000, p=list(probs.values())).tolist()
    assert goodness_of_fit_pvalue(sample, probs) > 1e-3
    assert goodness_of_fit_pvalue(sample + [7], probs) == 0.0  # 7 has probability zero
    assert goodness_of_fit_pvalue([0] * 1000, probs) < 1e-6
    assert goodness_of_fit_pvalue([0] * 10, {0: 1.0}) == 1.0  # one outcome: nothing to test
