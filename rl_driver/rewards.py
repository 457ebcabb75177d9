"""Reward functions (the loop finds them by dotted path: ``task.reward_fn``).

Signature: ``fn(prompt: Prompt, response_text: str, response_ids: list[int]) -> float``.
"""

from __future__ import annotations

import functools
import importlib
import re
from typing import Callable, List

from rl_driver.tasks import Prompt

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
FORMAT_BONUS = 0.1

RewardFn = Callable[[Prompt, str, List[int]], float]


def extract_answer(text: str):
    """The content of the last ``<answer>...</answer>`` tag, or None."""
    found = ANSWER_RE.findall(text)
    return found[-1].strip() if found else None


@functools.lru_cache(maxsize=16)
def _dataset(name: str, size: int, seed: int, config_items: tuple):
    import reasoning_gym

    return reasoning_gym.create_dataset(name, size=size, seed=seed, **dict(config_items))


def reasoning_gym_reward(prompt: Prompt, response_text: str, response_ids: List[int]) -> float:
    """The dataset's ``score_answer`` on the last ``<answer>`` tag, plus 0.1 for a well-formed tag."""
    answer = extract_answer(response_text)
    if answer is None:
        return 0.0
    e = prompt.entry
    dataset = _dataset(e["dataset"], e["size"], e["seed"],
                       tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                                    for k, v in e["dataset_config"].items())))
    entry = {"question": e["question"], "answer": e["answer"], "metadata": e["metadata"]}
    return float(dataset.score_answer(answer, entry)) + FORMAT_BONUS


def target_token_reward(prompt: Prompt, response_text: str, response_ids: List[int]) -> float:
    """Fraction of response tokens that hit the target: equal to ``entry["target_token_id"]``,
    or, when that is -1, divisible by ``entry["target_modulus"]`` (a toy task a tiny random
    model learns in a few GRPO steps)."""
    if not response_ids:
        return 0.0
    target = prompt.entry.get("target_token_id", -1)
    if target >= 0:
        hits = sum(t == target for t in response_ids)
    else:
        hits = sum(t % prompt.entry.get("target_modulus", 4) == 0 for t in response_ids)
    return hits / len(response_ids)


def load_reward_fn(dotted: str) -> RewardFn:
    """Import ``package.module.function``; ValueError names the path when it does not resolve."""
    module_name, _, attr = dotted.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"task.reward_fn {dotted!r} does not resolve to a function: {exc}") from None
    if not callable(fn):
        raise ValueError(f"task.reward_fn {dotted!r} is not callable")
    return fn
