"""Test helpers: HF reference decoding and a two-sample distribution test."""

from __future__ import annotations

from collections import Counter


def hf_greedy(model_path: str, prompts: list[list[int]], max_new_tokens: int, dtype="float32",
              model=None) -> list[list[int]]:
    """Greedy continuation with transformers ``generate`` (no EOS stop), the reference."""
    import torch
    from transformers import AutoModelForCausalLM

    if model is None:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
    import copy

    model.eval()
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = None  # like ignore_eos: never stop, never suppress EOS
    config.pad_token_id = 0
    config.do_sample = False
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(
                ids, attention_mask=torch.ones_like(ids), generation_config=config,
                max_new_tokens=max_new_tokens,
            )
            outs.append(gen[0, len(prompt):].tolist())
    return outs


def homogeneity_pvalue(a: list, b: list, min_count: int = 10) -> float:
    """Chi-square two-sample homogeneity test on categorical samples ``a`` and ``b``.

    Categories with fewer than ``min_count`` pooled observations are merged into one bin.
    """
    from scipy.stats import chi2_contingency

    ca, cb = Counter(a), Counter(b)
    keys = set(ca) | set(cb)
    big = [k for k in keys if ca[k] + cb[k] >= min_count]
    rare_a = sum(ca[k] for k in keys if k not in big)
    rare_b = sum(cb[k] for k in keys if k not in big)
    rows = [[ca[k] for k in big], [cb[k] for k in big]]
    if rare_a + rare_b >= min_count:
        rows[0].append(rare_a)
        rows[1].append(rare_b)
    if len(rows[0]) < 2:
        return 1.0
    return float(chi2_contingency(rows)[1])
