"""The real pretrained model through our Engine matches transformers greedy decoding."""

from __future__ import annotations

import pytest

from tests.helpers import hf_greedy

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

MESSAGES = [
    "What is the capital of France?",
    "What is 7 + 5? Answer briefly.",
    "Name a primary colour.",
]


def test_smollm2_greedy_first_16_tokens_match_transformers(engines, smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True,
                                tokenize=True, return_dict=False)
        for m in MESSAGES
    ]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) else list(p) for p in prompts]
    engine = engines.get("smollm2", model_path=smollm2_path, dtype="float32")
    out = engine.generate(
        input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    )
    ref = hf_greedy(smollm2_path, prompts, 16, dtype="float32")

    def upto_eos(ids):  # transformers stops at EOS; compare through the first EOS
        return ids[: ids.index(tok.eos_token_id) + 1] if tok.eos_token_id in ids else ids

    assert [upto_eos(o["output_ids"]) for o in out] == [upto_eos(r) for r in ref]
    assert sum(len(upto_eos(r)) for r in ref) >= 12
    assert "Paris" in tok.decode(out[0]["output_ids"])
