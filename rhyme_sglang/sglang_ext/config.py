"""RHYME settings: ``--rhyme-*`` flags / ``rhyme_*`` Engine kwargs, carried to the scheduler
process through ``RHYME_*`` environment variables (read here, in one typed place).

The scheduler process is spawned, so the main process writes the environment before sglang
starts its children and the worker reads :func:`RhymeConfig.from_env` there.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import uuid
from dataclasses import dataclass, field
from typing import Optional, Sequence, Tuple, Union

SCHEDULE_POLICIES = ("lpt", "fcfs")
_PREFIX = "RHYME_"


def _opt(default, help: str, metavar: str = "", *, shown: str = "", internal: bool = False):
    """A field with its flag's ``help`` line; ``internal`` fields are set by code, not users."""
    return field(default=default, metadata={"help": help, "metavar": metavar, "shown": shown,
                                            "internal": internal})


@dataclass(frozen=True)
class RhymeConfig:
    """Knobs of the RHYME speculative algorithm (all optional; defaults are tuned for RL).

    Each field is declared with :func:`_opt`, whose ``help`` is its meaning: the
    ``launch_server --help`` line and the README's flag table are made from it
    (:mod:`rhyme_sglang.sglang_ext.flags`; a test fails on a field without help). ``metavar``
    names the flag's value and ``shown`` a default that is None.
    """

    schedule_policy: str = _opt(
        "lpt", "lpt: the waiting queue runs longest-predicted-first, each prompt group kept "
        "together (prefix-cache reuse); fcfs: SGLang's own policy", "{lpt,fcfs}")
    min_draft_prob: float = _opt(
        0.0, "drop draft paths whose estimated probability is below P", "P")
    max_branch: int = _opt(4, "children per draft-tree node (1 = chain drafts)", "K")
    epoch_decay: float = _opt(0.6, "weight of a history response per epoch of age", "D")
    run_ahead_weight: float = _opt(
        0.5, "a run-ahead request's tokens (custom_params rhyme_run_ahead) join its prompt's "
        "history as a draft-only record weighing R times a real response of its epoch", "R")
    run_ahead_min_tokens: int = _opt(
        32, "an aborted run-ahead response shorter than N tokens is not kept: a short prefix "
        "drafts worse than none (a finished one is kept at any length)", "N")
    dropped_global_tokens: int = _opt(
        1 << 18, "tokens of dropped prompts' responses (/rhyme/drop_history) that stay in the "
        "cross-prompt trie until the prompt is loaded again; the earliest dropped go first; "
        "0: a drop removes them too", "N")
    reward_weight: float = _opt(
        0.5, "a history response weighs exp(W * its clipped group advantage)", "W")
    reward_rule: str = _opt(
        "fixed", "fixed: W is --rhyme-reward-weight; online: W is refitted at each epoch close "
        "from the branches the epoch's verified responses took (measured: no gain)",
        "{fixed,online}")
    memory_mb: Optional[int] = _opt(
        None, "memory budget of the history store in MiB; the least recently used prompts lose "
        "their oldest epochs first", "M", shown="unbounded")
    snapshot_path: Optional[str] = _opt(
        None, "load this snapshot (a path inside the snapshot dir) at start-up if it exists",
        "F", shown="none")
    snapshot_dir: Optional[str] = _opt(
        None, "the server's /rhyme/save, /rhyme/load and --rhyme-snapshot-path resolve inside D "
        "(the in-process Engine API is not confined)", "D",
        shown="~/.cache/rhyme_sglang/snapshots")
    control_addr: Optional[str] = _opt(
        None, "ZeroMQ address of the worker's control socket (set by the engine or server, "
        "not a user flag)", "ADDR", shown="a fresh ipc:// address", internal=True)
    adaptive: bool = _opt(
        True, "1: the cost model picks each decode step's verify width, or a plain decode; "
        "0: always verify the largest width")
    widths: Optional[Tuple[int, ...]] = _opt(
        None, "verify widths (draft tokens per request) a step may use, each at most N-1 "
        "(N = --speculative-num-draft-tokens)", "W1,W2,...",
        shown="powers of two below N-1, plus N-1")
    cycle_widths: bool = _opt(
        False, "diagnostic: decode steps walk through plain decode and every width so that "
        "every switch between two of them happens (the lossless tests); with ragged, every "
        "other step gives the requests different node counts, 0 included")
    ragged: bool = _opt(
        True, "1: each request verifies its own number of draft nodes (CPU, synchronous "
        "scheduler): the cost model takes the batch's most probable nodes wherever they are "
        "and the forward runs only those; 0: every request is padded to the step's width")
    group_prefill: bool = _opt(
        True, "1: a prefill pass takes one request per prompt group whose prompt is not cached "
        "yet, its siblings follow a pass later and prefill from the prefix cache (a cached "
        "prompt's group goes whole); 0: SGLang's admission")
    cost_cache: bool = _opt(
        True, "1: the cost model starts from the step costs an earlier engine measured on this "
        "machine, model shape, dtype, threads and (CPU) kernel revisions, and saves its own "
        "(every 30 s while decoding and at shutdown) in $RHYME_STEP_COSTS, default "
        "~/.cache/rhyme_sglang/step_costs.json; 0: start cold")
    horizon: bool = _opt(
        True, "1: the cost model counts a step's tokens only as far as they shorten the "
        "rollout's critical path (the longest predicted remainder, the waiting queue's "
        "predicted tokens); 0: batch tokens per second")
    request_calibration: bool = _opt(
        False, "1: each request's expected acceptance is also scaled by what its own recent "
        "verifies accepted against what the shared calibration expected; 0: the shared "
        "calibration alone (the default: bench_rollout A/Bs measured no gain from 1)")

    def __post_init__(self) -> None:
        if self.widths is not None:
            object.__setattr__(self, "widths", parse_widths(self.widths))
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"rhyme schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}"
            )
        if not 0.0 <= self.min_draft_prob <= 1.0:
            raise ValueError(f"rhyme min_draft_prob must be in [0, 1], got {self.min_draft_prob!r}")
        if self.reward_rule not in ("fixed", "online"):
            raise ValueError(f"rhyme reward_rule must be 'fixed' or 'online', got {self.reward_rule!r}")
        from rhyme_sglang.core.config import check_run_ahead_weight

        check_run_ahead_weight(self.run_ahead_weight, "rhyme run_ahead_weight")
        if self.run_ahead_min_tokens < 1:
            raise ValueError(f"rhyme run_ahead_min_tokens must be >= 1, got {self.run_ahead_min_tokens!r}")
        if self.dropped_global_tokens < 0:
            raise ValueError(f"rhyme dropped_global_tokens must be >= 0, got {self.dropped_global_tokens!r}")
        if self.max_branch < 1:
            raise ValueError(f"rhyme max_branch must be >= 1, got {self.max_branch!r}")
        if self.memory_mb is not None and self.memory_mb <= 0:
            raise ValueError(f"rhyme memory_mb must be positive, got {self.memory_mb!r}")

    def snapshot_root(self) -> str:
        """The snapshot directory: ``snapshot_dir``, else ``snapshots`` under the model cache
        (``$RHYME_CACHE_DIR``, default ``~/.cache/rhyme_sglang``)."""
        if self.snapshot_dir:
            return os.path.expanduser(self.snapshot_dir)
        from rhyme_sglang.models import cache_dir

        return str(cache_dir().parent / "snapshots")

    def store_config(self):
        from rhyme_sglang.core import StoreConfig

        return StoreConfig(
            max_branch=self.max_branch, min_prob=self.min_draft_prob, epoch_decay=self.epoch_decay,
            run_ahead_weight=self.run_ahead_weight, run_ahead_min_tokens=self.run_ahead_min_tokens,
            dropped_global_tokens=self.dropped_global_tokens,
            reward_weight=self.reward_weight, reward_rule=self.reward_rule,
            memory_budget=None if self.memory_mb is None else self.memory_mb * 2**20,
        )

    # ---------------------------------------------------------------- transport
    def to_env(self, env: Optional[dict] = None) -> dict:
        env = os.environ if env is None else env
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            key = _PREFIX + f.name.upper()
            if value is None:
                env.pop(key, None)
            elif f.name == "widths":
                env[key] = ",".join(str(w) for w in value)
            else:
                env[key] = str(int(value) if isinstance(value, bool) else value)
        return env

    @classmethod
    def from_env(cls, env: Optional[dict] = None) -> "RhymeConfig":
        env = os.environ if env is None else env
        kwargs = {}
        for f in dataclasses.fields(cls):
            raw = env.get(_PREFIX + f.name.upper())
            if raw is None:
                continue
            default = getattr(cls, f.name, None)
            if f.name == "widths":
                kwargs[f.name] = raw
            elif isinstance(default, bool):
                kwargs[f.name] = raw not in ("0", "false", "False", "")
            elif isinstance(default, int) or f.name == "memory_mb":
                kwargs[f.name] = int(raw)
            elif isinstance(default, float):
                kwargs[f.name] = float(raw)
            else:
                kwargs[f.name] = raw
        return cls(**kwargs)

    @classmethod
    def pop_from_kwargs(cls, kwargs: dict) -> "RhymeConfig":
        """Take ``rhyme_*`` keys out of Engine kwargs (ValueError on unknown ones)."""
        names = {f.name for f in dataclasses.fields(cls)}
        given = {k[len("rhyme_"):]: kwargs.pop(k) for k in list(kwargs) if k.startswith("rhyme_")}
        unknown = sorted(set(given) - names)
        if unknown:
            raise ValueError(f"unknown rhyme option(s): {['rhyme_' + u for u in unknown]}")
        return cls(**given)

    @classmethod
    def pop_from_argv(cls, argv: list) -> tuple["RhymeConfig", list]:
        """Take ``--rhyme-*`` flags out of a command line (ValueError on unknown ones)."""
        names = {f.name: f for f in dataclasses.fields(cls)}
        rest, given, i = [], {}, 0
        while i < len(argv):
            arg = argv[i]
            if not arg.startswith("--rhyme-"):
                rest.append(arg)
                i += 1
                continue
            key, _, value = arg[len("--rhyme-"):].partition("=")
            name = key.replace("-", "_")
            if name not in names:
                raise ValueError(f"unknown flag --rhyme-{key}")
            if not value:
                if i + 1 >= len(argv):
                    raise ValueError(f"flag --rhyme-{key} needs a value")
                value, i = argv[i + 1], i + 1
            given[name] = value
            i += 1
        return cls.from_env({_PREFIX + k.upper(): v for k, v in given.items()}), rest


def parse_widths(value: Union[str, Sequence[int]]) -> Tuple[int, ...]:
    """Verify widths from ``"2,4,8"`` or a sequence of ints (ValueError naming a bad value)."""
    from rhyme_sglang.core.cost_model import check_widths

    if isinstance(value, str):
        items = [v.strip() for v in value.split(",") if v.strip()]
        try:
            value = [int(v) for v in items]
        except ValueError:
            raise ValueError(f"rhyme widths must be comma-separated ints, got {value!r}") from None
    return check_widths(list(value))


def check_widths_fit(config: "RhymeConfig", num_draft_tokens) -> None:
    """ValueError when a configured verify width exceeds ``num_draft_tokens - 1`` (sglang's
    ``speculative_num_draft_tokens`` counts the last verified token too; default 8)."""
    if config.widths is None:
        return
    from rhyme_sglang.core.cost_model import check_widths

    n = 8 if num_draft_tokens is None else int(num_draft_tokens)
    check_widths(list(config.widths), max_width=n - 1)


def new_control_addr() -> str:
    """A fresh IPC address for one engine's control socket."""
    return f"ipc://{tempfile.gettempdir()}/rhyme-control-{uuid.uuid4().hex[:12]}.sock"
