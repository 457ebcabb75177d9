"""The distribution test used for losslessness detects a 2% bias at the sample sizes used."""

import numpy as np

from tests.helpers import homogeneity_pvalue


def test_distribution_test_has_power():
    rng = np.random.default_rng(0)
    p = np.array([0.3, 0.25, 0.2, 0.15, 0.1])
    q = p.copy()
    q[0] -= 0.02
    q[1] += 0.02  # total-variation distance 0.02, on the two most likely tokens (hardest case)
    n, alpha, trials = 16000, 1e-3 / 3, 20
    rejections = false_alarms = 0
    for _ in range(trials):
        a, b, c = (rng.choice(5, size=n, p=d).tolist() for d in (p, q, p))
        rejections += homogeneity_pvalue(a, b) < alpha
        false_alarms += homogeneity_pvalue(a, c) < alpha
    assert rejections >= trials // 2, rejections
    assert false_alarms == 0
