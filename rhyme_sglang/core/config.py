"""Frozen configuration records for the draft store and the speculation window."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional


def _check_int(name: str, value: int, lo: int, hi: Optional[int] = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be an int {bound}, got {value!r}")


def _check_float(name: str, value: float, lo: float, hi: float) -> None:
    if not isinstance(value, (int, float)) or not math.isfinite(value) or not lo <= value <= hi:
        raise ValueError(f"{name} must be a finite number in [{lo}, {hi}], got {value!r}")


def check_run_ahead_weight(value: float, name: str = "run_ahead_weight") -> None:
    """ValueError naming `name` unless `value` is a finite number in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")


@dataclass(frozen=True)
class WindowConfig:
    """Constants of the per-request draft window (see `window.SpecWindow` for the rule)."""

    initial: int = 16
    minimum: int = 16
    maximum: int = 32
    decrease: float = 0.5

    def __post_init__(self) -> None:
        _check_int("window.minimum", self.minimum, 1)
        _check_int("window.maximum", self.maximum, self.minimum)
        _check_int("window.initial", self.initial, self.minimum, self.maximum)
        _check_float("window.decrease", self.decrease, 0.0, 1.0)


@dataclass(frozen=True)
class StoreConfig:
    """Settings of `DraftStore`.

    Tree shape: every stored sequence is indexed by all its substrings of length <= `max_depth`;
    a draft matches at most `max_pattern` context tokens, so a draft extends at most
    `max_depth - match_len` tokens. The global trie may be shallower (`global_depth`, None = max_depth):
    it mostly serves shared template text and is the largest structure.
    Drafting (`combine="mix"`): the prompt, live and global tries each draft from their longest
    context match; path probabilities are mixed with weights 1, `live_weight`, `global_penalty`
    and the `budget` most probable paths form the draft tree (`combine="best"` keeps the single
    best-scoring trie's draft instead). A child's probability is its weight share among its
    siblings times C / (C + `prior` * `prior_decay` ** L), C = occurrences continuing past the
    parent, L = tokens the parent spells (matched context + draft path), so one occurrence after a
    long context counts as stronger evidence than one after a short context; paths below
    `min_prob` are not proposed; `max_branch` children at most are considered per node.
    Weighting: a response contributes `recency * exp(coef * clip(advantage))`, where the
    advantage is group-relative (same prompt, same epoch), and recency is `epoch_decay ** age`.
    `reward_rule="fixed"`: coef = `reward_weight`; `"online"`: coef starts at `reward_weight` and,
    at each epoch close, becomes the grid value that best predicts which history branch the
    epoch's responses took at branch points (`branching.RewardFit`; at most `reward_fit_tokens`
    response tokens are examined per epoch). `sibling_rewards="finished"` weights the finished
    responses of the open epoch by the advantage among its finished, rewarded siblings (a proxy
    for when the reward is known at finish); `"none"` leaves them neutral until the epoch closes.
    Responses of the open epoch reach the global trie only when the epoch closes unless
    `global_same_epoch` (so in-flight data of one prompt never drafts for another prompt's group).
    `memory_budget` (bytes) bounds `DraftStore.history_bytes()`: prompt and global tries plus
    response records; over it, the least recently used prompt loses its oldest epoch, repeatedly.
    `history_epochs` keeps only the newest epochs (1 = latest epoch only; None = all).
    `dropped_global_tokens` bounds the residue of dropped prompts (`DraftStore.drop_prompts`):
    their responses' contributions to the global trie, kept until the prompt comes back (0 =
    a drop removes them too).
    A run-ahead (draft-only) record weighs `run_ahead_weight` (in (0, 1]) times a real response
    of its epoch with a neutral reward; an aborted one shorter than `run_ahead_min_tokens` is
    not kept (a short prefix drafts worse than none).
    """

    max_depth: int = 24
    max_pattern: int = 8
    global_depth: Optional[int] = 16
    prompt_prefix: int = 8
    live_prompt_tokens: int = 1024
    epoch_decay: float = 0.6
    history_epochs: Optional[int] = None
    reward_weight: float = 0.5
    reward_rule: str = "fixed"
    reward_fit_tokens: int = 16384
    sibling_rewards: str = "none"
    advantage_clip: float = 2.0
    use_global: bool = True
    global_same_epoch: bool = False
    use_live: bool = True
    min_prob: float = 0.0
    prior: float = 2.0
    prior_decay: float = 0.7
    max_branch: int = 4
    global_penalty: float = 1.0
    live_weight: float = 0.2
    combine: str = "mix"
    memory_budget: Optional[int] = None
    default_length: float = 512.0
    run_ahead_weight: float = 0.5
    run_ahead_min_tokens: int = 32
    dropped_global_tokens: int = 1 << 18
    window: WindowConfig = field(default_factory=WindowConfig)

    def __post_init__(self) -> None:
        _check_int("max_depth", self.max_depth, 2, 256)
        _check_int("max_pattern", self.max_pattern, 1, self.max_depth - 1)
        if self.global_depth is not None:
            _check_int("global_depth", self.global_depth, self.max_pattern + 1, 256)
        _check_int("prompt_prefix", self.prompt_prefix, 0)
        _check_int("live_prompt_tokens", self.live_prompt_tokens, 0)
        _check_float("epoch_decay", self.epoch_decay, 1e-3, 1.0)
        if self.history_epochs is not None:
            _check_int("history_epochs", self.history_epochs, 1)
        _check_float("reward_weight", self.reward_weight, 0.0, 10.0)
        if self.reward_rule not in ("fixed", "online"):
            raise ValueError(f"reward_rule must be 'fixed' or 'online', got {self.reward_rule!r}")
        _check_int("reward_fit_tokens", self.reward_fit_tokens, 0)
        if self.sibling_rewards not in ("none", "finished"):
            raise ValueError(f"sibling_rewards must be 'none' or 'finished', got {self.sibling_rewards!r}")
        _check_float("advantage_clip", self.advantage_clip, 0.0, 10.0)
        _check_float("min_prob", self.min_prob, 0.0, 1.0)
        _check_float("prior", self.prior, 0.0, 1e6)
        _check_float("prior_decay", self.prior_decay, 0.0, 1.0)
        _check_int("max_branch", self.max_branch, 1)
        _check_float("global_penalty", self.global_penalty, 0.0, 1.0)
        _check_float("live_weight", self.live_weight, 0.0, 1.0)
        if self.combine not in ("best", "mix"):
            raise ValueError(f"combine must be 'best' or 'mix', got {self.combine!r}")
        if self.memory_budget is not None:
            _check_int("memory_budget", self.memory_budget, 0)
        _check_float("default_length", self.default_length, 0.0, 1e9)
        check_run_ahead_weight(self.run_ahead_weight)
        _check_int("run_ahead_min_tokens", self.run_ahead_min_tokens, 1)
        _check_int("dropped_global_tokens", self.dropped_global_tokens, 0)
        if not isinstance(self.window, WindowConfig):
            raise ValueError(f"window must be a WindowConfig, got {type(self.window).__name__}")

    @property
    def chain(self) -> bool:
        """True when drafts are single chains (one branch per node)."""
        return self.max_branch == 1
