"""Speculation on CPU is lossless (SGLang NGRAM and RHYME): greedy identity, sampled distributions.

Sampled tokens are tested against the exact distribution that non-speculative decoding draws
from: every continuation of the sampling prompt is enumerated with the same model in HF
transformers (``tests.helpers.exact_sampling_reference``), and a chi-square goodness-of-fit
test compares each speculative sample with it. Against an exact reference a sample of
``NUM_SAMPLES`` has more power than against a second sample of the same size (the earlier
two-sample design; tests/test_stats_power.py measures both), and an outcome the model cannot
produce fails at once. The non-speculative engine is checked against the same reference, so
the reference is what plain decoding samples.

Both number formats run: fp32 everywhere, and bf16 (the format ``dtype auto`` picks on CPUs
with native bf16) for greedy identity of every speculative configuration, plain sampling, and
the sampled case that walks through plain decode and every verify width. The bf16 engines are
tested against the same fp32 reference: bf16 rounding moves the tiny model's distribution far
less than a 16000-sample test can see (measured, AMX Xeon: p = 0.34 / 0.21 / 0.68 for RHYME),
so a bf16 speculative path that drifted from plain bf16 decoding would fail the same way.
"""

from __future__ import annotations

import pytest

from tests.helpers import exact_sampling_reference, goodness_of_fit_pvalue

pytestmark = pytest.mark.sglang

PROMPTS = [[1, 5, 6, 7, 8], [3, 4, 5], [10, 11, 12, 13, 14, 15, 16, 17] * 3]
GREEDY = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
SAMPLE_PROMPT = [10, 11, 12, 13, 14, 15, 16, 17] * 2
# NGRAM seeding: unseeded, a fresh NGRAM engine needed 26 verify steps for this prompt's 48
# greedy tokens (its online corpus learns the repeats); seeded with them, 13
SEED_PROMPT = [175, 87, 212, 343, 34, 47, 284, 58, 197, 308, 39, 269]
SAMPLING = {"temp1": {}, "top_p0.9": {"top_p": 0.9}, "top_k5": {"top_k": 5},
            # all three filters, each binding after this prompt: plain decoding applies them
            # as one rule (top-p over the unfiltered mass), sglang's verify would not
            "k20_p0.5_minp0.08": {"top_k": 20, "top_p": 0.5, "min_p": 0.08}}
NUM_SAMPLES = 16000  # per speculative setting; see tests/test_stats_power.py for its power
VANILLA_SAMPLES = 8000  # per setting, to check the reference against plain decoding
ALPHA = 1e-3 / 3  # three comparisons per setting
ALGORITHMS = ["tiny-ngram", "tiny-rhyme", "tiny-rhyme-cycle"]
DTYPES = ["float32", "bfloat16"]


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
    """Non-speculative greedy outputs per dtype, computed before any speculative engine starts
    (and ``"seed"``: SEED_PROMPT's, fp32)."""
    out = {dtype: [o["output_ids"] for o in tiny("tiny", dtype=dtype).generate(
        input_ids=PROMPTS, sampling_params=GREEDY)] for dtype in DTYPES}
    out["seed"] = tiny("tiny", dtype="float32").generate(
        input_ids=SEED_PROMPT, sampling_params=GREEDY)["output_ids"]
    return out


# the plain engine per dtype and setting (runs first: one engine switch per dtype)
PLAIN = [("float32", s) for s in SAMPLING] + [("bfloat16", "temp1")]


@pytest.mark.slow
@pytest.mark.parametrize("dtype,setting", PLAIN, ids=[f"{d}-{s}" for d, s in PLAIN])
def test_non_speculative_sampling_matches_exact(tiny, exact, dtype, setting):
    """The reference is the distribution plain decoding samples."""
    outs, _ = _sample(tiny("tiny", dtype=dtype), _sampling_params(setting), VANILLA_SAMPLES)
    _assert_matches_exact(outs, exact[setting])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algo", ALGORITHMS)
def test_greedy_equals_non_speculative(tiny, baseline, algo, dtype):
    engine = tiny(algo, dtype=dtype)
    spec = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    if algo != "tiny-ngram":  # second epoch: drafts come from the first one's history
        engine.rhyme_advance_epoch()
        spec = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o["output_ids"] for o in spec] == baseline[dtype]
    assert sum(o["meta_info"]["spec_num_correct_drafts"] for o in spec) > 0  # speculation ran


def test_greedy_with_one_width_per_batch_equals_non_speculative(tiny, baseline):
    """Per-request widths off (every request padded to the step's width, the padding nodes
    computed as drafts): the every-width walk keeps plain decoding's greedy tokens."""
    engine = tiny("tiny-rhyme-cycle-batch-width")
    for _ in range(2):  # the second round drafts from the first round's history
        out = [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
        assert out == baseline["float32"]


def test_ngram_seed_gives_a_fresh_engine_the_history(tiny, baseline):
    """bench_rollout's NGRAM history: a response seeded into the trie of a fresh NGRAM engine is
    drafted from its first token, and the output stays plain decoding's."""
    expected = baseline["seed"]
    # its own configuration key, so a fresh engine with an empty trie in any test order
    engine = tiny("tiny-ngram", dtype="float32", speculative_ngram_max_trie_depth=18)
    info = engine.ngram_seed([(SEED_PROMPT, expected)])
    assert info == {"sequences": 1, "windows": len(expected), "tokens": len(expected)}
    out = engine.generate(input_ids=SEED_PROMPT, sampling_params=GREEDY)
    assert out["output_ids"] == expected
    # 4 draft tokens: a verify step emits at most 4 tokens; the first comes from prefill
    assert out["meta_info"]["spec_verify_ct"] <= -(-(len(expected) - 1) // 4) + 1
    with pytest.raises(ValueError, match="pairs"):
        engine.ngram_seed([{"prompt": [1]}])
    with pytest.raises(ValueError, match="token ids"):  # the scheduler side checks too
        engine._rhyme.call("ngram_seed", sequences=[{"prompt": [1], "response": ["x"]}])
    assert engine.generate(input_ids=SEED_PROMPT, sampling_params=GREEDY)["output_ids"] == expected


# algorithm-major order: one engine switch per algorithm and dtype (sglang allows one engine
# at a time); "tiny-rhyme-cycle": decode steps walk through plain decode and every verify width
CASES = [("tiny-ngram", "temp1", "float32"), ("tiny-ngram", "top_p0.9", "float32"),
         ("tiny-rhyme", "temp1", "float32"), ("tiny-rhyme", "top_p0.9", "float32"),
         ("tiny-rhyme", "top_k5", "float32"),
         ("tiny-rhyme-cycle", "temp1", "float32"),
         ("tiny-rhyme-cycle", "k20_p0.5_minp0.08", "float32"),
         ("tiny-rhyme-cycle", "temp1", "bfloat16")]


@pytest.mark.slow
@pytest.mark.parametrize("algo,setting,dtype", CASES, ids=["-".join(c) for c in CASES])
def test_sampling_distribution_equals_non_speculative(tiny, exact, setting, algo, dtype):
    """Speculative samples fit the exact distribution of non-speculative decoding."""
    spec, accepted = _sample(tiny(algo, dtype=dtype), _sampling_params(setting), NUM_SAMPLES)
    assert accepted > NUM_SAMPLES // 4, f"speculation barely ran ({accepted} accepted drafts)"
    _assert_matches_exact(spec, exact[setting])
