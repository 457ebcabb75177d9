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
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

SCHEDULE_POLICIES = ("lpt", "fcfs")
_PREFIX = "RHYME_"


@dataclass(frozen=True)
class RhymeConfig:
    """Knobs of the RHYME speculative algorithm (all optional; defaults are tuned for RL).

    * ``schedule_policy``: ``lpt`` orders the waiting queue longest-predicted-first (prompt
      groups kept together, for prefix-cache reuse); ``fcfs`` leaves sglang's policy alone.
    * ``min_draft_prob``: drop draft paths whose estimated probability is below this.
    * ``max_branch``: children considered per draft-tree node (1 = chain drafts).
    * ``epoch_decay``/``reward_weight``: history weighting (see ``rhyme_sglang.core``).
    * ``reward_rule``: ``fixed`` uses ``reward_weight`` as the advantage coefficient; ``online``
      refits it at each epoch close from the branches the epoch's responses took.
    * ``memory_mb``: memory budget of the history store (None = unbounded).
    * ``snapshot_path``: load this snapshot at start-up if it exists.
    * ``snapshot_dir``: the server's ``/rhyme/save``, ``/rhyme/load`` and
      ``--rhyme-snapshot-path`` resolve inside it (default ``<cache>/snapshots``, see
      :meth:`snapshot_root`); the in-process ``Engine`` API is not confined.
    * ``control_addr``: ZeroMQ address of the worker's control socket (set automatically).
    * ``adaptive``: choose each decode step's verify width (or a plain decode) from the
      measured cost model; off = always verify the largest width.
    * ``widths``: the verify widths (draft tokens per request) a step may use; each at most
      ``speculative_num_draft_tokens - 1``. None = powers of two below that, plus it.
    * ``group_prefill``: a prefill pass takes one request per prompt group whose prompt is
      not cached yet; its siblings follow a pass later and prefill from the prefix cache.
    * ``cost_cache``: start the cost model from the step costs an earlier engine measured on
      this machine, model shape, dtype and threads, and keep them for the next one
      (:mod:`.step_costs`; file ``$RHYME_STEP_COSTS`` or ``<cache>/rhyme_sglang/step_costs.json``).
    * ``ragged``: each request of a verify step verifies its own number of draft nodes
      (CPU, synchronous scheduler): the cost model takes the batch's most probable nodes
      wherever they are (:meth:`SpecCostModel.choose_rows`), and the forward runs only the
      nodes taken (no padding rows). Off = every request verifies the step's width.
    * ``horizon``: the cost model counts a step's tokens only as far as they shorten the
      rollout's critical path (the longest predicted remainder, the waiting queue's
      predicted tokens; :class:`rhyme_sglang.core.horizon.Horizon`); off = batch
      tokens per second.
    * ``request_calibration``: scale each request's expected acceptance by what its own
      recent verifies accepted against what the shared calibration expected
      (:class:`rhyme_sglang.core.calibration.RequestEvidence`); off (the default: two
      ``bench_rollout`` A/Bs in stop 45 measured no gain) = the shared calibration alone.
    * ``cycle_widths``: diagnostic/test mode: decode steps walk through plain and every
      width in an order that makes every switch between two of them (lossless tests); with
      ``ragged``, every other step gives the requests different node counts, 0 included.
    """

    schedule_policy: str = "lpt"
    min_draft_prob: float = 0.0
    max_branch: int = 4
    epoch_decay: float = 0.6
    reward_weight: float = 0.5
    reward_rule: str = "fixed"
    memory_mb: Optional[int] = None
    snapshot_path: Optional[str] = None
    snapshot_dir: Optional[str] = None
    control_addr: Optional[str] = None
    adaptive: bool = True
    widths: Optional[Tuple[int, ...]] = None
    cycle_widths: bool = False
    ragged: bool = True
    group_prefill: bool = True
    cost_cache: bool = True
    horizon: bool = True
    request_calibration: bool = False

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
