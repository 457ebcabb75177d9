"""Typed run configuration: frozen dataclasses loaded from YAML, with errors that name the bad key.

A config file has one mapping per section (``engine``, ``rollout``, ``task``, ``train``,
``sync``, ``loop``, ``warm_start``, ``cluster``) plus ``name``, ``model`` and ``seed`` at the
top; ``task:`` may also be a preset's name alone (``task: running_sum``). Unknown keys and bad
values raise ``ConfigError`` (a ``ValueError``) naming ``section.key`` and the value.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Mapping, Optional


class ConfigError(ValueError):
    """A bad configuration value; the message names the key and the value."""


def _check(cond: bool, key: str, value: Any, why: str) -> None:
    if not cond:
        raise ConfigError(f"config key {key!r}: {why}, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    """How each rollout engine is started."""

    num_engines: int = 1
    dtype: str = "auto"  # auto = measured (rhyme_sglang.machine): bf16 only where native
    cpu_threads: int = 0  # scheduler compute threads per engine; 0 = the machine's rule
    kernel_threads: int = 0  # native kernel threads per engine; 0 = cores / engines
    rhyme: bool = True
    speculative_num_draft_tokens: int = 17  # widths 1..16 per step (the cost model picks)
    rhyme_schedule_policy: str = "lpt"
    # KV pool in tokens; 0 = sized per model and dtype on CPU (cpu_defaults.kv_pool_tokens),
    # sglang's own sizing on a GPU
    max_total_tokens: int = 0
    mem_fraction_static: float = 0.5
    sleep_on_idle: bool = True  # idle schedulers block instead of spinning (CPU for the trainer)
    # the driver sends and reads token ids: no detokenizer process work per step (rewards
    # decode each finished response once); false for stop strings or text outputs
    skip_tokenizer_init: bool = True
    # Ray resources of each engine's placement bundle (GPU engines get CUDA_VISIBLE_DEVICES
    # from Ray); 0 and 0 = no reservation (engines share the node's cores)
    num_cpus: float = 0.0
    num_gpus: float = 0.0
    extra: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        _check(isinstance(self.num_engines, int) and self.num_engines >= 1,
               "engine.num_engines", self.num_engines, "must be an int >= 1")
        _check(self.dtype in ("auto", "bfloat16", "float32", "float16"), "engine.dtype",
               self.dtype, "must be auto, bfloat16, float16 or float32")
        _check(isinstance(self.cpu_threads, int) and self.cpu_threads >= 0, "engine.cpu_threads",
               self.cpu_threads, "must be an int >= 0 (0 = the machine's rule)")
        _check(isinstance(self.kernel_threads, int) and not isinstance(self.kernel_threads, bool)
               and self.kernel_threads >= 0, "engine.kernel_threads", self.kernel_threads,
               "must be an int >= 0 (0 = the machine's rule)")
        _check(isinstance(self.rhyme, bool), "engine.rhyme", self.rhyme, "must be true or false")
        _check(isinstance(self.speculative_num_draft_tokens, int)
               and 1 <= self.speculative_num_draft_tokens <= 64,
               "engine.speculative_num_draft_tokens", self.speculative_num_draft_tokens,
               "must be an int in [1, 64]")
        _check(isinstance(self.max_total_tokens, int) and self.max_total_tokens >= 0,
               "engine.max_total_tokens", self.max_total_tokens, "must be an int >= 0 (0 = sized "
               "per model)")
        _check(0 < self.mem_fraction_static < 1, "engine.mem_fraction_static",
               self.mem_fraction_static, "must be in (0, 1)")
        _check(isinstance(self.skip_tokenizer_init, bool), "engine.skip_tokenizer_init",
               self.skip_tokenizer_init, "must be true or false")
        _check_resources("engine", self.num_cpus, self.num_gpus)

    def server_args(self, model_path: str) -> Dict[str, Any]:
        """Keyword arguments for ``rhyme_sglang.Engine``."""
        args: Dict[str, Any] = dict(
            model_path=model_path, dtype=self.dtype, cpu_threads=self.cpu_threads or None,
            kernel_threads=self.kernel_threads or None,
            log_level="warning",
            max_total_tokens=self.max_total_tokens or None,
            mem_fraction_static=self.mem_fraction_static,
            sleep_on_idle=self.sleep_on_idle, skip_tokenizer_init=self.skip_tokenizer_init,
        )
        if self.rhyme:
            args.update(speculative_algorithm="RHYME",
                        speculative_num_draft_tokens=self.speculative_num_draft_tokens,
                        rhyme_schedule_policy=self.rhyme_schedule_policy)
        args.update(self.extra)
        return args


@dataclass(frozen=True)
class RolloutConfig:
    """Sampling and multi-engine balancing."""

    group_size: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 128
    balance: str = "lpt"  # lpt | round_robin
    migrate: bool = True
    default_predicted_length: float = 64.0
    overrun_factor: float = 1.5
    poll_interval_s: float = 0.25
    stop_token_ids: tuple = ()
    # steps and epochs (rl_driver/steps.py): prompts a step samples (one GRPO update and one
    # weight sync per step; 0 = all prompts, one step per epoch)
    prompts_per_step: int = 0
    # where prompts' histories live between visits: in_engine (each engine keeps what it
    # served) | per_step (the driver's store, run_dir/history; engines hold the current and
    # the next step's prompts)
    history: str = "in_engine"
    history_shards: int = 16  # per_step: folders of the driver's history store (a file a prompt)
    # idle engines draft the next step's prompts while others finish (outputs discarded)
    run_ahead: bool = False
    run_ahead_samples: int = 2  # run-ahead requests per next-step prompt

    def __post_init__(self):
        for key, low in (("prompts_per_step", 0), ("history_shards", 1), ("run_ahead_samples", 1)):
            value = getattr(self, key)
            _check(isinstance(value, int) and not isinstance(value, bool) and value >= low,
                   f"rollout.{key}", value, f"must be an int >= {low}")
        _check(self.history in ("in_engine", "per_step"), "rollout.history", self.history,
               "must be 'in_engine' or 'per_step'")
        _check(isinstance(self.run_ahead, bool), "rollout.run_ahead", self.run_ahead,
               "must be true or false")
        _check(isinstance(self.group_size, int) and self.group_size >= 1,
               "rollout.group_size", self.group_size, "must be an int >= 1")
        _check(self.temperature >= 0, "rollout.temperature", self.temperature, "must be >= 0")
        _check(0 < self.top_p <= 1, "rollout.top_p", self.top_p, "must be in (0, 1]")
        _check(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
               "rollout.max_new_tokens", self.max_new_tokens, "must be an int >= 1")
        _check(self.balance in ("lpt", "round_robin"), "rollout.balance", self.balance,
               "must be 'lpt' or 'round_robin'")
        _check(self.default_predicted_length > 0, "rollout.default_predicted_length",
               self.default_predicted_length, "must be > 0")
        _check(self.overrun_factor >= 1, "rollout.overrun_factor", self.overrun_factor,
               "must be >= 1")

    def sampling_params(self) -> Dict[str, Any]:
        params = {"temperature": self.temperature, "top_p": self.top_p,
                  "max_new_tokens": self.max_new_tokens}
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        return params


@dataclass(frozen=True)
class TaskConfig:
    """Where prompts come from and how responses are scored."""

    kind: str = "reasoning_gym"  # reasoning_gym | target_token
    dataset: str = "chain_sum"
    dataset_config: Dict[str, Any] = field(default_factory=dict)
    num_prompts: int = 8
    few_shot: int = 2
    reward_fn: str = "rl_driver.rewards.reasoning_gym_reward"
    target_token_id: int = -1  # target_token task: the target; -1 = ids divisible by modulus
    target_modulus: int = 4
    prompt_length: int = 8  # target_token task: random prompt length
    prompt_style: str = "default"  # rl_driver.tasks.PROMPT_STYLES: instruction + few-shot turns
    # a named workload (rl_driver.task_presets): its dataset, format and size mix; when set,
    # dataset, dataset_config, prompt_style and few_shot are not used
    preset: str = ""
    sizes: tuple = ()  # a preset's size mix (lo, hi, tail); () = the preset's own

    def __post_init__(self):
        _check(self.kind in ("reasoning_gym", "target_token"), "task.kind", self.kind,
               "must be 'reasoning_gym' or 'target_token'")
        if self.preset:
            from rl_driver.task_presets import PRESETS

            _check(self.preset in PRESETS, "task.preset", self.preset,
                   f"must be one of {sorted(PRESETS)}")
        _check_sizes("task.sizes", self.sizes)
        _check(isinstance(self.num_prompts, int) and self.num_prompts >= 1,
               "task.num_prompts", self.num_prompts, "must be an int >= 1")
        _check(isinstance(self.reward_fn, str) and "." in self.reward_fn, "task.reward_fn",
               self.reward_fn, "must be a dotted path 'package.module.function'")
        _check(isinstance(self.target_modulus, int) and self.target_modulus >= 1,
               "task.target_modulus", self.target_modulus, "must be an int >= 1")
        _check(0 <= self.few_shot <= 8, "task.few_shot", self.few_shot, "must be in [0, 8]")


def _check_sizes(key: str, sizes) -> None:
    _check(sizes == () or (len(sizes) == 3 and all(isinstance(x, (int, float)) for x in sizes)
                           and 1 <= sizes[0] <= sizes[1] and sizes[2] > 0), key, sizes,
           "must be [lo, hi, tail] with 1 <= lo <= hi and tail > 0, or []")


@dataclass(frozen=True)
class WarmStartConfig:
    """The SFT warm start run before RL (:mod:`rl_driver.warm_start`); ``enabled`` makes the
    loop train from its output (built, or reused from the models cache)."""

    enabled: bool = False
    task: str = "running_sum"  # a preset of rl_driver.task_presets
    examples: int = 240
    epochs: int = 1
    lr: float = 1e-3
    lora_rank: int = 16
    batch_tokens: int = 2048
    seed: int = 1
    sizes: tuple = ()  # the preset's size mix for the SFT data; () = the preset's own
    eval_prompts: int = 16
    eval_samples: int = 2

    def __post_init__(self):
        from rl_driver.task_presets import PRESETS

        _check(isinstance(self.enabled, bool), "warm_start.enabled", self.enabled,
               "must be true or false")
        _check(self.task in PRESETS, "warm_start.task", self.task, f"must be one of {sorted(PRESETS)}")
        for key in ("examples", "epochs", "lora_rank", "batch_tokens"):
            value = getattr(self, key)
            _check(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                   f"warm_start.{key}", value, "must be an int >= 1")
        _check(self.lr > 0, "warm_start.lr", self.lr, "must be > 0")
        _check(isinstance(self.seed, int), "warm_start.seed", self.seed, "must be an int")
        _check(isinstance(self.eval_prompts, int) and self.eval_prompts >= 0,
               "warm_start.eval_prompts", self.eval_prompts, "must be an int >= 0")
        _check(isinstance(self.eval_samples, int) and self.eval_samples >= 1,
               "warm_start.eval_samples", self.eval_samples, "must be an int >= 1")
        _check_sizes("warm_start.sizes", self.sizes)


@dataclass(frozen=True)
class TrainConfig:
    """The GRPO update."""

    lr: float = 5e-6
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    micro_batch_size: int = 8
    # at most this many response tokens (rows x longest response) a micro-batch, however
    # many samples micro_batch_size allows: 8 responses of ~1000 tokens ran out of 24 GB,
    # 2 of them fit (the masked attention keeps each layer's scores for the backward); 0 = no cap
    micro_batch_tokens: int = 2048
    num_minibatches: int = 1
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    kl_coef: float = 0.0
    dtype: str = "float32"
    autocast_bf16: Any = "auto"  # true | false | auto (= bf16 where the machine computes it natively)
    adv_eps: float = 1e-6
    old_logprobs: str = "rollout"  # rollout (engine logprobs) | recompute (trainer forward)
    num_threads: int = 0  # torch threads in the trainer; 0 = all cores (engines idle meanwhile)
    # one forward of each distinct prompt per micro-batch, its KV shared by the group's
    # responses (same gradients as a forward per sample; G-fold less prompt compute)
    share_prompt_forward: bool = True
    # leave samples whose advantage is exactly 0 (groups with equal rewards) out of the
    # forward/backward when there is no KL term: their loss and gradient are exactly 0, and
    # they still count in the token-mean, so the update is the same, for less compute
    skip_zero_advantage: bool = True
    # Ray resources of the trainer's placement bundle; 0 and 0 = no reservation
    num_cpus: float = 0.0
    num_gpus: float = 0.0

    def __post_init__(self):
        _check(self.lr > 0, "train.lr", self.lr, "must be > 0")
        _check(self.weight_decay >= 0, "train.weight_decay", self.weight_decay, "must be >= 0")
        _check(self.grad_clip > 0, "train.grad_clip", self.grad_clip, "must be > 0")
        _check(isinstance(self.micro_batch_size, int) and self.micro_batch_size >= 1,
               "train.micro_batch_size", self.micro_batch_size, "must be an int >= 1")
        _check(isinstance(self.micro_batch_tokens, int) and self.micro_batch_tokens >= 0,
               "train.micro_batch_tokens", self.micro_batch_tokens, "must be an int >= 0 (0 = no cap)")
        _check(isinstance(self.num_minibatches, int) and self.num_minibatches >= 1,
               "train.num_minibatches", self.num_minibatches, "must be an int >= 1")
        _check(0 <= self.clip_eps_low < 1, "train.clip_eps_low", self.clip_eps_low,
               "must be in [0, 1)")
        _check(self.clip_eps_high >= 0, "train.clip_eps_high", self.clip_eps_high, "must be >= 0")
        _check(self.kl_coef >= 0, "train.kl_coef", self.kl_coef, "must be >= 0")
        _check(self.old_logprobs in ("rollout", "recompute"), "train.old_logprobs",
               self.old_logprobs, "must be 'rollout' or 'recompute'")
        _check(isinstance(self.num_threads, int) and self.num_threads >= 0, "train.num_threads",
               self.num_threads, "must be an int >= 0")
        _check(isinstance(self.share_prompt_forward, bool), "train.share_prompt_forward",
               self.share_prompt_forward, "must be true or false")
        _check(isinstance(self.skip_zero_advantage, bool), "train.skip_zero_advantage",
               self.skip_zero_advantage, "must be true or false")
        _check(self.dtype in ("float32", "bfloat16"), "train.dtype", self.dtype,
               "must be float32 or bfloat16")
        _check(self.autocast_bf16 is True or self.autocast_bf16 is False
               or self.autocast_bf16 == "auto", "train.autocast_bf16", self.autocast_bf16,
               "must be true, false or auto")
        _check_resources("train", self.num_cpus, self.num_gpus)


@dataclass(frozen=True)
class SyncConfig:
    """How trained weights reach the engines."""

    method: str = "tensor"  # tensor | distributed | disk
    bucket_mb: float = 64.0
    backend: str = "auto"  # distributed: auto (gloo on CPU, nccl on GPU) | gloo | nccl
    # distributed: the rendezvous host; auto = the trainer node's IP, found at run time
    master_address: str = "auto"
    # disk: the folder weights are written to, one every node mounts ("" = run_dir/weights,
    # checked at start to be seen by every engine)
    disk_dir: str = ""

    def __post_init__(self):
        _check(self.method in ("tensor", "distributed", "disk"), "sync.method", self.method,
               "must be 'tensor', 'distributed' or 'disk'")
        _check(self.bucket_mb > 0, "sync.bucket_mb", self.bucket_mb, "must be > 0")
        _check(self.backend in ("auto", "gloo", "nccl"), "sync.backend", self.backend,
               "must be 'auto', 'gloo' or 'nccl'")


@dataclass(frozen=True)
class LoopConfig:
    """Epochs, outputs, checkpoints and fault tolerance."""

    epochs: int = 3
    output_dir: str = "runs"
    checkpoint: bool = True
    max_actor_restarts: int = 3
    trace: bool = True
    report: bool = True
    ray_num_cpus: int = 0  # 0 = let Ray decide
    save_final: bool = False  # write the final policy as an HF folder (run_dir/final)

    def __post_init__(self):
        _check(isinstance(self.epochs, int) and self.epochs >= 1, "loop.epochs", self.epochs,
               "must be an int >= 1")
        _check(isinstance(self.max_actor_restarts, int) and self.max_actor_restarts >= 0,
               "loop.max_actor_restarts", self.max_actor_restarts, "must be an int >= 0")


STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True)
class ClusterConfig:
    """Which Ray cluster the run joins and where its actors go (``docs/ray-cluster.md``).

    A placement group holds one bundle per engine (``engine.num_cpus`` / ``engine.num_gpus``
    plus ``engine_resources``) and one for the trainer (``train.num_cpus`` /
    ``train.num_gpus`` plus ``trainer_resources``), placed by ``strategy``. With nothing
    reserved anywhere there is no placement group (the actors share the node, as on a laptop)."""

    # "" = RAY_ADDRESS when set, else a new local instance; "auto" = the cluster this node
    # belongs to; "ray://head:10001" (Ray client) or "head:6379" (the GCS)
    address: str = ""
    strategy: str = "PACK"  # PACK | SPREAD | STRICT_PACK | STRICT_SPREAD
    # custom Ray resources per engine bundle: one mapping for every engine, or a list of one
    # mapping per engine (pinning: [{"node_a": 1}, {"node_b": 1}])
    engine_resources: Any = field(default_factory=dict)
    trainer_resources: Dict[str, Any] = field(default_factory=dict)
    # seconds a restart waits for Ray to re-place a dead engine's bundle before it starts the
    # engine outside the group (its node is gone and no other node fits the bundle)
    replace_wait_s: float = 10.0

    def __post_init__(self):
        _check(isinstance(self.address, str), "cluster.address", self.address,
               "must be a string: '', 'auto', 'ray://host:port' or 'host:port'")
        _check(self.strategy in STRATEGIES, "cluster.strategy", self.strategy,
               f"must be one of {', '.join(STRATEGIES)}")
        per_engine = (self.engine_resources if isinstance(self.engine_resources, (list, tuple))
                      else [self.engine_resources])
        for res in per_engine + [self.trainer_resources]:
            _check(isinstance(res, Mapping) and all(
                isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
                and v >= 0 for k, v in res.items()),
                "cluster.engine_resources" if res is not self.trainer_resources
                else "cluster.trainer_resources", res,
                "must map resource names to numbers >= 0")
        _check(self.replace_wait_s >= 0, "cluster.replace_wait_s", self.replace_wait_s,
               "must be >= 0")

    def engine_resources_of(self, i: int) -> Dict[str, float]:
        """Engine ``i``'s custom resources (a list's entry ``i``, or the one mapping)."""
        res = self.engine_resources
        if isinstance(res, (list, tuple)):
            if i >= len(res):
                raise ConfigError(f"config key 'cluster.engine_resources': {len(res)} entries "
                                  f"for engine {i} (one per engine, or one mapping for all)")
            res = res[i]
        return {k: float(v) for k, v in res.items()}


def _check_resources(section: str, cpus, gpus) -> None:
    for key, value in (("num_cpus", cpus), ("num_gpus", gpus)):
        _check(isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0,
               f"{section}.{key}", value, "must be a number >= 0")


@dataclass(frozen=True)
class RunConfig:
    """A whole run: model, seed and the section configs."""

    name: str = "run"
    model: str = "tiny"
    seed: int = 0
    engine: EngineConfig = field(default_factory=EngineConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def __post_init__(self):
        _check(isinstance(self.name, str) and self.name and "/" not in self.name, "name",
               self.name, "must be a non-empty string without '/'")
        _check(isinstance(self.model, str) and self.model, "model", self.model,
               "must be 'tiny', 'smollm2' or a model folder")
        _check(isinstance(self.seed, int), "seed", self.seed, "must be an int")
        per_engine = self.cluster.engine_resources
        _check(not isinstance(per_engine, (list, tuple)) or len(per_engine) == self.engine.num_engines,
               "cluster.engine_resources", per_engine,
               f"a list needs one mapping per engine ({self.engine.num_engines})")
        _check(self.rollout.prompts_per_step <= self.task.num_prompts, "rollout.prompts_per_step",
               self.rollout.prompts_per_step, f"must be <= task.num_prompts ({self.task.num_prompts})")
        for key, on in (("run_ahead", self.rollout.run_ahead),
                        ("history", self.rollout.history == "per_step")):
            _check(self.engine.rhyme or not on, f"rollout.{key}", getattr(self.rollout, key),
                   "needs the engines' RHYME history (engine.rhyme: true)")

    @property
    def run_dir(self) -> Path:
        return Path(self.loop.output_dir) / self.name

    def replace(self, **changes) -> "RunConfig":
        return dataclasses.replace(self, **changes)

    def resolved(self, engine_dtype=None, cores=None, train_dtype=None) -> "RunConfig":
        """This config with the machine's choices made concrete: ``engine.dtype: auto`` (by
        ``engine_dtype(requested)``, default the measured :func:`rhyme_sglang.dtypes.resolve_dtype`),
        ``train.autocast_bf16: auto`` (:func:`trainer_autocast`, the trainer's own measurement
        by ``train_dtype``, default :func:`rhyme_sglang.dtypes.resolve_train_dtype`),
        ``engine.cpu_threads: 0``, ``engine.kernel_threads: 0`` and
        ``train.num_threads: 0`` (the thread rules on ``cores`` usable cores). Idempotent."""
        from rhyme_sglang import dtypes, machine

        pick = engine_dtype or dtypes.resolve_dtype
        cores = machine.usable_cores() if cores is None else cores
        dtype = pick(self.engine.dtype)
        autocast = self.train.autocast_bf16
        if autocast == "auto":
            autocast = trainer_autocast(self.engine.dtype, pick, train_dtype)
        threads = machine.choose_scheduler_threads(self.engine.cpu_threads or None, cores,
                                                   self.engine.num_engines)
        kernels = machine.choose_kernel_threads(self.engine.kernel_threads or None, cores,
                                                self.engine.num_engines)
        return self.replace(
            engine=dataclasses.replace(self.engine, dtype=dtype, cpu_threads=threads,
                                       kernel_threads=kernels),
            train=dataclasses.replace(
                self.train, autocast_bf16=autocast,
                num_threads=machine.choose_trainer_threads(self.train.num_threads, cores)))

    def machine_summary(self) -> str:
        """One line on a resolved config: the dtype and threads a run uses."""
        return (f"dtype {self.engine.dtype}, engine threads {self.engine.cpu_threads} torch + "
                f"{self.engine.kernel_threads} kernel x {self.engine.num_engines} engine(s), "
                f"trainer threads {self.train.num_threads}, "
                f"trainer autocast bf16 {'on' if self.train.autocast_bf16 else 'off'}")


def trainer_autocast(engine_dtype: str, pick=None, train_pick=None) -> bool:
    """What ``train.autocast_bf16: auto`` means for engines asked to run ``engine_dtype``: true
    iff they run bf16 (``pick(engine_dtype)``, default the measured
    :func:`rhyme_sglang.dtypes.resolve_dtype`), so rollout and trainer logprobs come from the
    same number format, and the trainer's own measurement picks bf16 (``train_pick("auto")``,
    default :func:`rhyme_sglang.dtypes.resolve_train_dtype`: training is compute-bound, so it
    is decided on large products, not on the engines' decode steps)."""
    from rhyme_sglang import dtypes

    pick = pick or dtypes.resolve_dtype
    train_pick = train_pick or dtypes.resolve_train_dtype
    return pick(engine_dtype) == "bfloat16" and train_pick("auto") == "bfloat16"


SECTIONS = {"engine": EngineConfig, "rollout": RolloutConfig, "task": TaskConfig,
            "train": TrainConfig, "sync": SyncConfig, "loop": LoopConfig,
            "warm_start": WarmStartConfig, "cluster": ClusterConfig}


def _build_section(name: str, cls, raw: Any):
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config section {name!r} must be a mapping, got {raw!r}")
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key not in known:
            raise ConfigError(f"unknown config key {name}.{key!s} (allowed in {name}: "
                              f"{', '.join(sorted(known))})")
        default = known[key].default
        if isinstance(default, bool) and not isinstance(value, bool):
            raise ConfigError(f"config key '{name}.{key}': must be true or false, got {value!r}")
        if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(default, (int, float)) and not isinstance(default, bool) and (
                isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ConfigError(f"config key '{name}.{key}': must be a number, got {value!r}")
        if isinstance(default, tuple) and isinstance(value, list):
            value = tuple(value)
        kwargs[key] = value
    return cls(**kwargs)


def config_from_dict(raw: Mapping[str, Any], overrides: Optional[Mapping[str, Any]] = None) -> RunConfig:
    """Build a ``RunConfig``; ``overrides`` maps ``"section.key"`` (or a top key) to a value."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"a config must be a mapping at the top level, got {type(raw).__name__}")
    raw = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in raw.items()}
    for dotted, value in (overrides or {}).items():
        section, _, key = dotted.partition(".")
        if key:
            raw.setdefault(section, {})
            if not isinstance(raw[section], dict):
                raise ConfigError(f"config section {section!r} must be a mapping")
            raw[section][key] = value
        else:
            raw[section] = value
    if isinstance(raw.get("task"), str):  # `task: running_sum`: a preset by name
        raw["task"] = {"preset": raw["task"]}
    top = {}
    for key, value in raw.items():
        if key in SECTIONS:
            top[key] = _build_section(key, SECTIONS[key], value if value is not None else {})
        elif key in ("name", "model", "seed"):
            top[key] = value
        else:
            raise ConfigError(f"unknown config key {key!r} (allowed: name, model, seed, "
                              f"{', '.join(SECTIONS)})")
    return RunConfig(**top)


def load_config(path: str, overrides: Optional[Mapping[str, Any]] = None) -> RunConfig:
    """Read a YAML config file; errors name the file and the bad key."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {path!r} does not exist")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path!r} is not valid YAML: {exc}") from None
    try:
        return config_from_dict(raw, overrides)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
