"""Speculation on CPU is lossless (SGLang NGRAM and RHYME): greedy identity, sampled distributions."""

from __future__ import annotations

import pytest

from tests.helpers import homogeneity_pvalue

pytestmark = pytest.mark.sglang

PROMPTS = [[1, 5, 6, 7, 8], [3, 4, 5], [10, 11, 12, 13, 14, 15, 16, 17] * 3]
GREEDY = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
SAMPLE_PROMPT = [10, 11, 12, 13, 14, 15, 16, 17] * 2
SAMPLING = {"temp1": {}, "top_p0.9": {"top_p": 0.9}, "top_k5": {"top_k": 5}}
NUM_SAMPLES = 16000  # per side; see tests/test_stats_power.py for the power this gives
ALPHA = 1e-3 / 3  # three comparisons per setting
ALGORITHMS = ["tiny-ngram", "tiny-rhyme"]


def _sample(engine, params, num_samples, batch=512):
    outs, accepted = [], 0
    for start in range(0, num_samples, batch):
        n = min(batch, num_samples - start)
        res = engine.generate(input_ids=[SAMPLE_PROMPT] * n, sampling_params=params)
        outs += [o["output_ids"] for o in res]
        accepted += sum(o["meta_info"].get("spec_num_correct_drafts", 0) for o in res)
    return outs, accepted


def _sampling_params(name):
    return {"temperature": 1.0, "max_new_tokens": 3, "ignore_eos": True, **SAMPLING[name]}


@pytest.fixture(scope="module")
def baseline(tiny, request):
    """Non-speculative outputs, computed once before the NGRAM engine starts."""
    engine = tiny("tiny")
    out = {"greedy": [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]}
    if request.config.getoption("-m") != "not slow":
        for name in SAMPLING:
            out[name] = _sample(engine, _sampling_params(name), NUM_SAMPLES)[0]
    return out


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_greedy_equals_non_speculative(tiny, baseline, algo):
    spec = tiny(algo).generate(input_ids=PROMPTS, sampling_params=GREEDY)
    if algo == "tiny-rhyme":  # second epoch: drafts come from the first one's history
        tiny(algo).rhyme_advance_epoch()
        spec = tiny(algo).generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o["output_ids"] for o in spec] == baseline["greedy"]
    assert sum(o["meta_info"]["spec_num_correct_drafts"] for o in spec) > 0  # speculation ran


# algorithm-major order: one engine switch per algorithm (sglang allows one engine at a time)
# "tiny-rhyme-cycle": decode steps walk through plain decode and every verify width 1..16
CASES = [("tiny-ngram", "temp1"), ("tiny-ngram", "top_p0.9"),
         ("tiny-rhyme", "temp1"), ("tiny-rhyme", "top_p0.9"), ("tiny-rhyme", "top_k5"),
         ("tiny-rhyme-cycle", "temp1")]


@pytest.mark.slow
@pytest.mark.parametrize("algo,setting", CASES, ids=[f"{a}-{s}" for a, s in CASES])
def test_sampling_distribution_equals_non_speculative(tiny, baseline, setting, algo):
    """Token distributions at positions 1 and 2 (produced by verify steps) and their joint."""
    base = baseline[setting]
    spec, accepted = _sample(tiny(algo), _sampling_params(setting), NUM_SAMPLES)
    assert accepted > NUM_SAMPLES // 4, f"speculation barely ran ({accepted} accepted drafts)"
    for pos in (1, 2):
        p = homogeneity_pvalue([o[pos] for o in base], [o[pos] for o in spec])
        assert p > ALPHA, f"position {pos}: distributions differ (p={p:.2e})"
    p = homogeneity_pvalue([tuple(o[1:3]) for o in base], [tuple(o[1:3]) for o in spec])
    assert p > ALPHA, f"joint (t1, t2) distributions differ (p={p:.2e})"
