"""Prompt sets for the loop: reasoning-gym chat prompts and a synthetic target-token task.

A ``Prompt`` carries its id, token ids and whatever the reward function needs (``entry``).
The prompts are a dataset: an epoch visits each once, and a step samples
``rollout.prompts_per_step`` of them (:mod:`rl_driver.steps`; 0 = all, one step per epoch).
History drafting serves a prompt's later visits, so prompt ids are stable for a given seed.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import Any, Dict, List

from rl_driver.config import TaskConfig
from rl_driver.task_presets import column_sums

def sampling_seed(seed: int, epoch, prompt_id, sample: int) -> int:
    """A ``sampling_seed`` for sample ``sample`` of prompt ``prompt_id`` in ``epoch`` (63 bits,
    a hash of the four; ``epoch`` is an int for real samples, the global step in a run of
    steps, and a ``"runahead/<step>"`` string for run-ahead requests): engines that get the
    same one draw the same tokens from the same policy, speculating or not."""
    digest = hashlib.blake2b(f"{seed}/{epoch}/{prompt_id}/{sample}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


INSTRUCTION = "Reason briefly step by step, then give the final answer inside <answer>...</answer>."
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
FEW_SHOT = [
    ("Calculate 3 + 4.", "We add 4 to 3: 3 + 4 = 7.\n<answer>7</answer>"),
    ("State the final answer to the following arithmetic problem: 6 - 2 =",
     "We subtract 2 from 6: 6 - 2 = 4.\n<answer>4</answer>"),
    ("Calculate 5 + 2 - 1.", "First 5 + 2 = 7, then 7 - 1 = 6.\n<answer>6</answer>"),
]


def running_sum_solution(terms) -> str:
    """A worked running sum: one line per term, the running total on each line."""
    total, lines = terms[0], [f"Start with {terms[0]}."]
    for t in terms[1:]:
        lines.append(f"{total} + {t} = {total + t}")
        total += t
    return "\n".join(lines) + f"\n<answer>{total}</answer>"


def long_addition_solution(a: int, b: int) -> str:
    """Column addition written digit by digit, units first, with the carry on each line."""
    columns, carry = column_sums(a, b)
    lines = [f"Digit {i}: {x} + {y} + carry {c} = {s}, write {s % 10}, carry {s // 10}."
             for i, x, y, c, s in columns]
    digits = [str(s % 10) for *_, s in columns] + ([str(carry)] if carry else [])
    if carry:
        lines.append(f"Final carry: write {carry}.")
    return "\n".join(lines) + f"\nReading the digits from last to first: {''.join(digits[::-1])}." \
        + f"\n<answer>{a + b}</answer>"


def letter_count_solution(words, letter: str) -> str:
    """A word-by-word count of ``letter``: one line per word with its count and the running
    total (case-insensitive, as reasoning-gym's letter_counting scores it)."""
    total, lines = 0, []
    for w in words:
        n = w.lower().count(letter.lower())
        total += n
        lines.append(f"{w} -> {n} (total {total})")
    return "\n".join(lines) + f"\n<answer>{total}</answer>"


_COUNT_TEXT = "a cat sat on the mat near seven green trees".split()
_SUM_TERMS = ([4, 7, 2, 9, 5, 1, 8, 3, 6, 2, 7, 4], [6, 1, 8, 3, 9, 2, 5, 7, 4, 6],
              [3, 8, 5, 2, 9, 6, 1, 7, 4, 8, 2, 5, 9, 3])
_ADDENDS = ((4805, 739), (62917, 8254), (350816, 47293))
# prompt_style -> (instruction, few-shot turns); long structured procedures for long responses
PROMPT_STYLES = {
    "default": (INSTRUCTION, FEW_SHOT),
    "running_sum": (
        "Add the numbers one at a time, writing the running total on its own line, then give "
        "the final answer inside <answer>...</answer>.",
        [("Calculate " + " + ".join(map(str, t)) + ".", running_sum_solution(t)) for t in _SUM_TERMS]),
    # one short worked example with both signs: a short prompt for the demo's longer answers
    "running_sum_short": (
        "Go term by term, writing the running total on its own line, then give the final "
        "answer inside <answer>...</answer>.",
        [("Calculate 6 + 3 - 2 + 5 - 4.",
          "Start with 6.\n6 + 3 = 9\n9 - 2 = 7\n7 + 5 = 12\n12 - 4 = 8\n<answer>8</answer>")]),
    "long_addition": (
        "Add the two numbers digit by digit from the right, writing each digit and carry on "
        "its own line, then give the final answer inside <answer>...</answer>.",
        [(f"Calculate {a} + {b}.", long_addition_solution(a, b)) for a, b in _ADDENDS]),
    # reasoning-gym letter_counting, counted word by word: long, copy-heavy responses
    "letter_count_words": (
        "Go through the text word by word, writing each word with how many times the letter "
        "appears in it and the running total, then give the final answer inside "
        "<answer>...</answer>.",
        [(f'How many times does the letter "e" appear in the text: "{" ".join(_COUNT_TEXT)}"?',
          letter_count_solution(_COUNT_TEXT, "e"))]),
}
EASY_DATASET_CONFIGS = {
    "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
    "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                         "operators": ("+", "-")},
}


@dataclass(frozen=True)
class Prompt:
    """One prompt of the run (``entry``: task data for the reward function)."""

    prompt_id: str
    token_ids: List[int]
    entry: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if not self.prompt_id:
            raise ValueError("prompt_id must be non-empty")
        if not self.token_ids:
            raise ValueError(f"prompt {self.prompt_id!r} has no tokens")


def chat_ids(tokenizer, messages, add_generation_prompt: bool = True) -> List[int]:
    """Token ids of ``messages`` under the tokenizer's chat template (a list, whether the
    tokenizer returns ids or an encoding)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def chat_messages(question: str, few_shot: int, style: str = "default") -> List[Dict[str, str]]:
    if style not in PROMPT_STYLES:
        raise ValueError(f"task.prompt_style must be one of {sorted(PROMPT_STYLES)}, got {style!r}")
    instruction, shots = PROMPT_STYLES[style]
    messages = [{"role": "system", "content": SYSTEM}]
    for q, a in shots[:few_shot]:
        messages.append({"role": "user", "content": f"{q}\n{instruction}"})
        messages.append({"role": "assistant", "content": a})
    messages.append({"role": "user", "content": f"{question}\n{instruction}"})
    return messages


def reasoning_gym_prompts(cfg: TaskConfig, tokenizer, seed: int) -> List[Prompt]:
    """``cfg.num_prompts`` chat prompts from a reasoning-gym dataset (easy settings by default)."""
    import reasoning_gym

    ds_config = dict(EASY_DATASET_CONFIGS.get(cfg.dataset, {}))
    ds_config.update(cfg.dataset_config)
    try:
        dataset = reasoning_gym.create_dataset(cfg.dataset, size=cfg.num_prompts, seed=seed,
                                               **ds_config)
    except Exception as exc:
        raise ValueError(f"task.dataset {cfg.dataset!r} with task.dataset_config {ds_config!r} "
                         f"could not be created: {exc}") from None
    prompts = []
    for i in range(cfg.num_prompts):
        entry = dataset[i]
        ids = chat_ids(tokenizer, chat_messages(entry["question"], cfg.few_shot, cfg.prompt_style))
        prompts.append(Prompt(
            prompt_id=f"{cfg.dataset}-{seed}-{i}", token_ids=list(ids),
            entry={"dataset": cfg.dataset, "dataset_config": ds_config, "seed": seed,
                   "size": cfg.num_prompts, "index": i, "question": entry["question"],
                   "answer": entry["answer"], "metadata": entry.get("metadata", {})},
        ))
    return prompts


def target_token_prompts(cfg: TaskConfig, vocab_size: int, seed: int) -> List[Prompt]:
    """Random-token prompts for :func:`rl_driver.rewards.target_token_reward`."""
    rng = random.Random(seed)
    if cfg.target_token_id >= vocab_size:
        raise ValueError(f"task.target_token_id {cfg.target_token_id} is outside the vocabulary "
                         f"({vocab_size})")
    entry = {"target_token_id": cfg.target_token_id, "target_modulus": cfg.target_modulus}
    return [Prompt(prompt_id=f"target-{seed}-{i}",
                   token_ids=[rng.randrange(16, vocab_size) for _ in range(cfg.prompt_length)],
                   entry=dict(entry)) for i in range(cfg.num_prompts)]


def preset_prompts(cfg: TaskConfig, tokenizer, seed: int) -> List[Prompt]:
    """``cfg.num_prompts`` prompts of the named workload ``cfg.preset``
    (:mod:`rl_driver.task_presets`): its system turn and question, sizes stratified over its
    mix."""
    from rl_driver.task_presets import chat, preset_entries

    prompts = []
    entries = preset_entries(cfg.preset, cfg.num_prompts, seed, cfg.sizes or None, stratified=True)
    for i, entry in enumerate(entries):
        ids = chat_ids(tokenizer, chat(cfg.preset, entry))
        prompts.append(Prompt(prompt_id=f"{cfg.preset}-{seed}-{i}", token_ids=list(ids),
                              entry=entry))
    return prompts


def build_prompts(cfg: TaskConfig, tokenizer, seed: int) -> List[Prompt]:
    if cfg.preset:
        return preset_prompts(cfg, tokenizer, seed)
    if cfg.kind == "reasoning_gym":
        return reasoning_gym_prompts(cfg, tokenizer, seed)
    return target_token_prompts(cfg, len(tokenizer), seed)
