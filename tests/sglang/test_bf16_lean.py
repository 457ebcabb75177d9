"""A bf16 model's decode and verify steps on the lean path (issue 52): where the CPU has
avx512_bf16, the tiny model in bf16 runs its steps through the native bf16 product and the
native decoder step, and ``RHYME_CPU_LEAN=check`` finds them bit-identical to sglang's own
(patched) layer stack at every step, plain decode and verify steps of every width; the verify
steps give the plain engine's greedy tokens. (The lossless suite's bf16 cases,
``test_spec_lossless.py``, cover sampling and logprobs on the same kernels.)"""

from __future__ import annotations

import os

import pytest

from rhyme_sglang.cpu_backend import native_step

pytestmark = [pytest.mark.sglang,
              pytest.mark.skipif(not native_step.takes_bf16(),
                                 reason="the native bf16 step needs avx512_bf16")]

# before the module's engine starts: every linear on the native kernel, so the native
# decoder step runs (the default measures per shape and may keep oneDNN for some buckets)
os.environ["RHYME_CPU_LINEAR"] = "native"

PROMPTS = [[1, 5, 6, 7, 8], [3, 4, 5], [10, 11, 12, 13, 14, 15, 16, 17] * 3]
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}


def _generate(engine):
    return [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


def test_bf16_lean_steps_are_bit_identical_to_sglangs(tiny, monkeypatch):
    tokens = _generate(tiny("tiny", dtype="bfloat16"))
    monkeypatch.setenv("RHYME_CPU_LEAN", "check")  # read by the engine's scheduler
    checked = tiny("tiny-rhyme-cycle", dtype="bfloat16", random_seed=7)
    for _ in range(3):  # later rounds draft from the earlier rounds' history
        assert _generate(checked) == tokens
