"""Test helpers: HF reference decoding, exact sampling distributions and distribution tests."""

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


def goodness_of_fit_pvalue(sample: list, probs: dict, min_expected: float = 5.0) -> float:
    """Chi-square test of the categorical ``sample`` against exact probabilities ``probs``.

    ``probs`` maps each possible outcome to its probability. Outcomes expected fewer than
    ``min_expected`` times are pooled into one bin (merged into the least likely kept bin when
    the pool itself is expected too rarely). An outcome of probability zero in the sample
    gives p = 0: it cannot happen under ``probs`` at all.
    """
    from scipy.stats import chisquare

    n, counts = len(sample), Counter(sample)
    if any(probs.get(k, 0.0) <= 0.0 for k in counts):
        return 0.0
    kept = sorted((k for k, p in probs.items() if n * p >= min_expected), key=lambda k: -probs[k])
    observed = [counts.get(k, 0) for k in kept]
    expected = [n * probs[k] for k in kept]
    rest_observed, rest_expected = n - sum(observed), max(0.0, n - sum(expected))
    if rest_expected >= min_expected:
        observed.append(rest_observed)
        expected.append(rest_expected)
    elif kept:
        observed[-1] += rest_observed
        expected[-1] += rest_expected
    if len(observed) < 2:
        return 1.0
    expected[-1] += n - sum(expected)  # float rounding: the totals must agree exactly
    return float(chisquare(observed, expected).pvalue)


def filtered_probs(logits, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0,
                   min_p: float = 0.0):
    """Per row, the distribution non-speculative sampling draws from (float64).

    As SGLang's sampler: softmax of ``logits / temperature`` (fp32); a token is kept when its
    rank is below ``top_k``, the mass of the more probable tokens before it is at most
    ``top_p``, and its probability is at least ``min_p`` times the row's largest; the kept
    mass is renormalised.
    """
    import torch

    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    drop = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) > top_p
    if top_k > 0:
        drop |= torch.arange(probs.shape[-1]) >= top_k
    if min_p > 0:
        drop |= sorted_probs < sorted_probs[..., :1] * min_p
    keep = torch.ones_like(drop).scatter_(-1, order, ~drop)
    out = probs.double().masked_fill(~keep, 0.0)
    return out / out.sum(-1, keepdim=True)


def exact_sampling_reference(model_path: str, prompt: list[int], temperature: float = 1.0,
                             top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0,
                             rows_per_call: int = 8192) -> dict:
    """Exact distributions of the 2nd and 3rd sampled tokens after ``prompt``, and their joint.

    Enumerates every first and second token of non-zero probability (the model in fp32, with
    HF transformers, each call of ``rows_per_call`` continuations over the prompt's KV cache)
    and sums ``p(t0) p(t1 | t0) p(t2 | t0, t1)``. Returns ``{"pos1": {t1: p}, "pos2": {t2: p},
    "joint": {(t1, t2): p}}`` with zero-probability outcomes left out.
    """
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()

    def probs_of(out):
        return filtered_probs(out.logits[:, -1], temperature, top_k, top_p, min_p)

    with torch.no_grad():
        first = model(torch.tensor([prompt]), use_cache=True)
        p0 = probs_of(first)[0]
        t0s = p0.nonzero().view(-1)
        prefixes = torch.tensor(prompt).expand(len(t0s), -1)
        p1 = probs_of(model(torch.cat([prefixes, t0s.view(-1, 1)], dim=1)))  # [len(t0s), vocab]
        pairs = (p0[t0s].view(-1, 1) * p1).nonzero()  # (index into t0s, t1)
        weights = p0[t0s][pairs[:, 0]] * p1[pairs[:, 0], pairs[:, 1]]
        vocab = p0.numel()
        joint = torch.zeros(vocab, vocab, dtype=torch.float64)
        for start in range(0, len(pairs), rows_per_call):
            chunk = pairs[start:start + rows_per_call]
            cache = copy.deepcopy(first.past_key_values)
            cache.batch_repeat_interleave(len(chunk))
            steps = torch.stack([t0s[chunk[:, 0]], chunk[:, 1]], dim=1)
            p2 = probs_of(model(steps, past_key_values=cache, use_cache=True))
            joint.index_add_(0, chunk[:, 1], weights[start:start + rows_per_call].view(-1, 1) * p2)

    def as_dict(values) -> dict:
        idx = values.nonzero()
        return {tuple(i) if len(i) > 1 else i[0]: float(values[tuple(i)])
                for i in idx.tolist()}

    return {"pos1": as_dict(joint.sum(1)), "pos2": as_dict(joint.sum(0)), "joint": as_dict(joint)}
