"""Speculation on CPU is lossless (SGLang NGRAM and RHYME): greedy identity, sampled distributions.

Sampled tokens are tested against the exact distribution that non-speculative decoding draws
from: every continuation of the sampling prompt is enumerated with the same model in HF
transformers (``tests.helpers.exact_sampling_reference``), and a chi-square goodness-of-fit
test compares each speculative sample with it. Against an exact reference a sample of
``NUM_SAMPLES`` has more power than against a second sample of the same size (the earlier
two-sample design; tests/test_stats_power.py measures both), and an outcome the model cannot
produce fails at once. The non-speculative engine is checked against the same reference, so
the reference is what plain decoding samples.
"""

from __future__ import annotations

import pytest

from tests.helpers import exact_sampling_reference, goodness_of_fit_pvalue

pytestmark = pytest.mark.sglang

PROMPTS = [[1, 5, 6, 7, 8], [3, 4, 5], [10, 11, 12, 13, 14, 15, 16, 17] * 3]
GREEDY = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
SAMPLE_PROMPT = [10, 11, 12, 13, 14, 15, 16, 17] * 2
SAMPLING = {"temp1": {}, "top_p0.9": {"top_p": 0.9}, "top_k5": {"top_k": 5}}
NUM_SAMPLES = 16000  # per speculative setting; see tests/test_stats_power.py for its power
VANILLA_SAMPLES = 8000  # per setting, to check the reference against plain decoding
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


def _assert_matches_exact(outs, reference):
    """Tokens at positions 1 and 2 (produced by verify steps when speculating) and their joint."""
    for pos in (1, 2):
        p = goodness_of_fit_pvalue([o[pos] for o in outs], reference[f"pos{pos}"])
        assert p > ALPHA, f"position {pos}: the sample does not fit the exact distribution (p={p:.2e})"
    p = goodness_of_fit_pvalue([tuple(o[1:3]) for o in outs], reference["joint"])
    assert p > ALPHA, f"joint (t1, t2): the sample does not fit the exact distribution (p={p:.2e})"


@pytest.fixture(scope="module")
def exact(tiny_model_path):
    """Exact distributions of every sampling setting (a few seconds on the tiny model)."""
    return {name: exact_sampling_reference(tiny_model_path, SAMPLE_PROMPT, **SAMPLING[name])
            for name in SAMPLING}


@pytest.fixture(scope="module")
def baseline(tiny):
    """Non-speculative greedy outputs, computed before the NGRAM engine starts."""
    engine = tiny("tiny")
    return {"greedy": [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]}


@pytest.mark.slow
@pytest.mark.parametrize("setting", list(SAMPLING))
def test_non_speculative_sampling_matches_exact(tiny, exact, setting):
    """The reference is the distribution plain decoding samples (runs first: one engine switch)."""
    outs, _ = _sample(tiny("tiny"), _sampling_params(setting), VANILLA_SAMPLES)
    _assert_matches_exact(outs, exact[setting])


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
def test_sampling_distribution_equals_non_speculative(tiny, exact, setting, algo):
    """Speculative samples fit the exact distribution of non-speculative decoding."""
    spec, accepted = _sample(tiny(algo), _sampling_params(setting), NUM_SAMPLES)
    assert accepted > NUM_SAMPLES // 4, f"speculation barely ran ({accepted} accepted drafts)"
    _assert_matches_exact(spec, exact[setting])
