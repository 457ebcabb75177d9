"""Named workloads: a reasoning-gym task, the format its answers take, and a long-tailed size mix.

A preset turns a reasoning-gym dataset into the workload of an RL run whose policy can do the
task: a system turn that states the answer format, the question rendered so the procedure can
copy from it, an exact worked solution (the warm start's SFT target, :mod:`rl_driver.warm_start`),
and problem sizes drawn from a long-tailed mix (most problems short, a few long, as RL's
response lengths are). Rewards stay the dataset's own scorer
(:func:`rl_driver.rewards.reasoning_gym_reward`): every item is the dataset's item at its size.

Sizes: ``lo + floor((hi - lo + 1) * u ** tail)``, ``u`` uniform in [0, 1) (stratified for a
run's prompts, so a handful of prompts has the mix's shape): median
``lo + (hi - lo) / 2 ** tail``, mean ``lo + (hi - lo) / (tail + 1)``.

    >>> [p for p in PRESETS]
    ['running_sum', 'long_addition', 'letter_count', 'gsm_symbolic']
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple


def column_sums(a: int, b: int):
    """Column addition of ``a + b`` from the units up: ``(digit index from 1, x, y, carry in,
    column sum)`` per column, then the final carry (0 when none)."""
    da, db = str(a)[::-1], str(b)[::-1]
    carry, columns = 0, []
    for i in range(max(len(da), len(db))):
        x, y = int(da[i]) if i < len(da) else 0, int(db[i]) if i < len(db) else 0
        columns.append((i + 1, x, y, carry, x + y + carry))
        carry = (x + y + carry) // 10
    return columns, carry


def _terms(expression: str) -> List[int]:
    """``"4 - 1 + 7"`` -> ``[4, -1, 7]``."""
    tokens = expression.split()
    if not tokens or len(tokens) % 2 != 1:
        raise ValueError(f"not a chain of terms: {expression!r}")
    terms = [int(tokens[0])]
    for op, num in zip(tokens[1::2], tokens[2::2]):
        if op not in "+-":
            raise ValueError(f"operator {op!r} in {expression!r} is not + or -")
        terms.append(int(num) if op == "+" else -int(num))
    return terms


def _signed(t: int) -> str:
    return f"+{t}" if t >= 0 else str(t)


def running_sum_question(entry: Dict[str, Any]) -> str:
    terms = _terms(entry["metadata"]["expression"])
    lines = [f"{i}. {t if i == 1 else _signed(t)}" for i, t in enumerate(terms, 1)]
    return "Add up these numbers in order:\n" + "\n".join(lines)


def running_sum_answer(entry: Dict[str, Any]) -> str:
    """``i. a + b = c`` for term i, the running total carried; then ``<answer>``."""
    terms = _terms(entry["metadata"]["expression"])
    total, lines = terms[0], [f"1. {terms[0]}"]
    for i, t in enumerate(terms[1:], 2):
        lines.append(f"{i}. {total} {'+' if t >= 0 else '-'} {abs(t)} = {total + t}")
        total += t
    return "\n".join(lines) + f"\n<answer>{total}</answer>"


def _addends(entry: Dict[str, Any]) -> Tuple[int, int]:
    a, b = (int(x) for x in entry["metadata"]["expression"].split(" + "))
    return a, b


def long_addition_question(entry: Dict[str, Any]) -> str:
    a, b = _addends(entry)
    return f"Add these two numbers:\n{a}\n{b}"


def long_addition_answer(entry: Dict[str, Any]) -> str:
    """Column addition from the units digit up, one line per digit with the carry."""
    a, b = _addends(entry)
    columns, carry = column_sums(a, b)
    lines = [f"Digit {i}: {x} + {y} + {c} = {s}, write {s % 10}, carry {s // 10}"
             for i, x, y, c, s in columns]
    if carry:
        lines.append(f"Final carry: write {carry}")
    return "\n".join(lines) + f"\n<answer>{a + b}</answer>"


def _span(entry: Dict[str, Any]) -> Tuple[List[str], str]:
    words = entry["metadata"]["span"]
    if isinstance(words, str):  # reasoning-gym stores some metadata as repr strings
        words = re.findall(r"'([^']*)'", words)
    return list(words), entry["metadata"]["target_letter"]


def letter_count_question(entry: Dict[str, Any]) -> str:
    return entry["question"]


def letter_count_answer(entry: Dict[str, Any]) -> str:
    """One line per word: the word, its count of the letter (any case) and the running total."""
    words, letter = _span(entry)
    total, lines = 0, []
    for i, w in enumerate(words, 1):
        n = w.lower().count(letter.lower())
        total += n
        lines.append(f"{i}. {w}: {n}, total {total}")
    return "\n".join(lines) + f"\n<answer>{total}</answer>"


def gsm_question(entry: Dict[str, Any]) -> str:
    return entry["question"]


def gsm_answer(entry: Dict[str, Any]) -> str:
    return entry["metadata"]["answer_cot"].strip() + f"\n<answer>{entry['answer']}</answer>"


@dataclass(frozen=True)
class TaskPreset:
    """One named workload (see the module docstring)."""

    name: str
    dataset: str  # reasoning-gym dataset
    system: str  # the system turn: the answer format
    question: Callable[[Dict[str, Any]], str]
    answer: Callable[[Dict[str, Any]], str]  # the exact worked solution
    base_config: Dict[str, Any] = field(default_factory=dict)
    size_keys: Optional[Tuple[str, str]] = None  # (min key, max key) of the size in the config
    sizes: Tuple[int, int, float] = (1, 1, 1.0)  # (lo, hi, tail) of the size mix

    def draw_sizes(self, n: int, seed: int, sizes: Optional[Sequence[float]] = None,
                   stratified: bool = False) -> List[int]:
        """``n`` sizes of the mix. ``stratified``: one ``u`` in each of ``n`` equal strata of
        [0, 1), in a random order, so that even a few prompts have the mix's shape (8 i.i.d.
        draws can be mostly long ones); otherwise i.i.d."""
        lo, hi, tail = tuple(sizes) if sizes else self.sizes
        rng = random.Random(f"{self.name}/{seed}")
        if stratified:
            strata = list(range(n))
            rng.shuffle(strata)
            us = [(k + rng.random()) / n for k in strata]
        else:
            us = [rng.random() for _ in range(n)]
        return [int(lo + int((hi - lo + 1) * u ** tail)) for u in us]


PRESETS: Dict[str, TaskPreset] = {p.name: p for p in (
    TaskPreset(
        "running_sum", "chain_sum",
        "Add the numbers one at a time. Write one line per number, with its index: the first "
        "line is the first number, each later line is 'index. total + number = new total'. "
        "Finish with the final total in the form <answer>N</answer>.",
        running_sum_question, running_sum_answer,
        base_config={"min_digits": 1, "max_digits": 1},
        size_keys=("min_terms", "max_terms"), sizes=(4, 80, 3.0)),
    TaskPreset(
        "long_addition", "basic_arithmetic",
        "Add the two numbers digit by digit, starting from the last digit. Write one line per "
        "digit: 'Digit i: x + y + carry = s, write d, carry c'. Finish with the sum in the form "
        "<answer>N</answer>.",
        long_addition_question, long_addition_answer,
        base_config={"min_terms": 2, "max_terms": 2, "operators": ("+",),
                     "allow_parentheses": False, "allow_negation": False},
        size_keys=("min_digits", "max_digits"), sizes=(4, 40, 2.0)),
    TaskPreset(
        "letter_count", "letter_counting",
        "Go through the text word by word. Write one line per word: 'index. word: count, total "
        "running total', counting the letter in any case. Finish with the total in the form "
        "<answer>N</answer>.",
        letter_count_question, letter_count_answer,
        size_keys=("min_words", "max_words"), sizes=(4, 60, 3.0)),
    TaskPreset(
        "gsm_symbolic", "gsm_symbolic",
        "Solve the word problem step by step, then give the final number in the form "
        "<answer>N</answer>.",
        gsm_question, gsm_answer),
)}


def get_preset(name: str) -> TaskPreset:
    if name not in PRESETS:
        raise ValueError(f"task {name!r} is not a preset; choose one of {sorted(PRESETS)}")
    return PRESETS[name]


def preset_entries(name: str, n: int, seed: int, sizes: Optional[Sequence[float]] = None,
                   stratified: bool = False) -> List[Dict[str, Any]]:
    """``n`` reasoning-gym items of preset ``name`` with sizes from its mix (``sizes``
    overrides ``(lo, hi, tail)``; ``stratified`` as :meth:`TaskPreset.draw_sizes`: a run's
    prompts are, the warm start's many SFT examples are not), in draw order. Each entry carries what
    :func:`rl_driver.rewards.reasoning_gym_reward` needs to rebuild the item and score it."""
    import reasoning_gym

    preset = get_preset(name)
    wanted = preset.draw_sizes(n, seed, sizes, stratified) if preset.size_keys else [0] * n
    by_size: Dict[int, List[int]] = {}
    for i, size in enumerate(wanted):
        by_size.setdefault(size, []).append(i)
    entries: List[Optional[Dict[str, Any]]] = [None] * n
    for size, slots in sorted(by_size.items()):
        config = dict(preset.base_config)
        if preset.size_keys:
            config[preset.size_keys[0]] = config[preset.size_keys[1]] = size
        ds_seed = seed * 1000 + size
        try:
            dataset = reasoning_gym.create_dataset(preset.dataset, size=len(slots), seed=ds_seed,
                                                   **config)
        except Exception as exc:
            raise ValueError(f"task {name!r}: reasoning-gym {preset.dataset!r} with {config!r} "
                             f"could not be created: {exc}") from None
        for k, i in enumerate(slots):
            item = dataset[k]
            entries[i] = {"dataset": preset.dataset, "dataset_config": config, "seed": ds_seed,
                          "size": len(slots), "index": k, "question": item["question"],
                          "answer": item["answer"], "metadata": item.get("metadata", {}),
                          "task": name, "task_size": size}
    return entries  # type: ignore[return-value]


def chat(name: str, entry: Dict[str, Any], with_answer: bool = False) -> List[Dict[str, str]]:
    """The chat turns of ``entry``: system (the format), user (the question) and, with
    ``with_answer``, the assistant's worked solution."""
    preset = get_preset(name)
    turns = [{"role": "system", "content": preset.system},
             {"role": "user", "content": preset.question(entry)}]
    if with_answer:
        turns.append({"role": "assistant", "content": preset.answer(entry)})
    return turns
