"""The process's ``RHYME_*`` switches, read once into a frozen :class:`Settings`, and the one
cache folder every cache uses.

Rules:

* Every ``RHYME_*`` environment variable the library honours is a field here, with its
  choices and default; nothing else in the library reads ``os.environ`` for a ``RHYME_*``
  name. A bad value is a ``ValueError`` naming the variable and the allowed values.
* :func:`settings` reads the environment on first use and logs the switches that differ from
  their defaults, once per process. :func:`reload` drops the cached copy: a forked child whose
  environment was replaced, or a test that changed a variable, calls it.
* :func:`cache_root` is the folder of every cache (models, probes, kernel choices, step costs):
  ``RHYME_CACHE_DIR``, else ``$XDG_CACHE_HOME/rhyme_sglang``, else ``~/.cache/rhyme_sglang``.
* :func:`prepare_cpu_env` is the one place that sets the variables a CPU process needs before
  torch or sglang is imported (``SGLANG_USE_CPU_ENGINE``, ``OMP_NUM_THREADS``,
  ``TOKENIZERS_PARALLELISM``), each only where unset.

Standard library only: importing this module does no work.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

logger = logging.getLogger(__name__)

# the choices of each switch (the first is the default unless the field says otherwise)
LEAN_MODES = ("on", "off", "check")
STEP_MODES = ("native", "python")
LINEAR_MODES = ("auto", "plain", "packed", "native")
ATTENTION_IMPLS = ("auto", "native", "torch")
SMALL_OPS_MODES = ("native", "torch")
SAMPLING_IMPLS = ("inverse_cdf", "torch")
MALLOC_MODES = ("keep", "glibc")
HUGEPAGE_MODES = ("on", "off")
START_METHODS = ("auto", "forkserver", "spawn")
BACKEND_SWITCH = ("1", "0")

CPU_ENV_DEFAULTS = {"SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "1",
                    "TOKENIZERS_PARALLELISM": "false"}


def _choice(env: Mapping[str, str], name: str, choices: tuple) -> str:
    text = env.get(name, "").strip().lower() or choices[0]
    if text not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {text!r}")
    return text


def _threads(env: Mapping[str, str], name: str) -> Optional[int]:
    """A thread count >= 1, None when unset, ``0`` or ``auto``."""
    text = env.get(name, "").strip()
    if text in ("", "0", "auto"):
        return None
    if not text.isdigit():
        raise ValueError(f"{name} must be a positive int or 'auto', got {text!r}")
    return int(text)


def _text(env: Mapping[str, str], name: str) -> Optional[str]:
    return env.get(name, "").strip() or None


@dataclass(frozen=True)
class Settings:
    """Every ``RHYME_*`` switch of the library (field -> variable in :data:`ENV_NAMES`)."""

    cpu_backend: str = "1"  # RHYME_CPU_BACKEND: "0" leaves sglang's CPU path unpatched
    cpu_lean: str = "on"  # RHYME_CPU_LEAN: the lean decode/verify forward (check: vs sglang's)
    cpu_step: str = "native"  # RHYME_CPU_STEP: the decoder layer loop as one native call
    cpu_linear: str = "auto"  # RHYME_CPU_LINEAR: linear kernel, measured per shape or forced
    cpu_attention: str = "auto"  # RHYME_CPU_ATTENTION
    cpu_small_ops: str = "native"  # RHYME_CPU_SMALL_OPS: native RMSNorm / rotary / SiLU
    cpu_sampling: str = "inverse_cdf"  # RHYME_CPU_SAMPLING
    cpu_malloc: str = "keep"  # RHYME_CPU_MALLOC: keep freed memory, or glibc's default
    cpu_hugepages: str = "on"  # RHYME_CPU_HUGEPAGES: weight panels on transparent huge pages
    cpu_threads: Optional[int] = None  # RHYME_CPU_THREADS: the scheduler's torch threads
    kernel_threads: Optional[int] = None  # RHYME_KERNEL_THREADS: the native kernels' threads
    gemm_probe: Optional[str] = None  # RHYME_GEMM_PROBE: "float32=50,bfloat16=6" GFLOP/s
    decode_probe: Optional[str] = None  # RHYME_DECODE_PROBE: "float32=3,bfloat16=4" ms
    step_costs: Optional[str] = None  # RHYME_STEP_COSTS: a step-cost table to load
    decision_log: Optional[str] = None  # RHYME_DECISION_LOG: JSON lines of every decision
    start_method: str = "auto"  # RHYME_START_METHOD: how sglang's children start
    cache_dir: Optional[str] = None  # RHYME_CACHE_DIR: see cache_root()

    @classmethod
    def read(cls, env: Optional[Mapping[str, str]] = None) -> "Settings":
        """The switches in ``env`` (the process environment by default), checked."""
        env = os.environ if env is None else env
        return cls(
            cpu_backend=_choice(env, "RHYME_CPU_BACKEND", BACKEND_SWITCH),
            cpu_lean=_choice(env, "RHYME_CPU_LEAN", LEAN_MODES),
            cpu_step=_choice(env, "RHYME_CPU_STEP", STEP_MODES),
            cpu_linear=_choice(env, "RHYME_CPU_LINEAR", LINEAR_MODES),
            cpu_attention=_choice(env, "RHYME_CPU_ATTENTION", ATTENTION_IMPLS),
            cpu_small_ops=_choice(env, "RHYME_CPU_SMALL_OPS", SMALL_OPS_MODES),
            cpu_sampling=_choice(env, "RHYME_CPU_SAMPLING", SAMPLING_IMPLS),
            cpu_malloc=_choice(env, "RHYME_CPU_MALLOC", MALLOC_MODES),
            cpu_hugepages=_choice(env, "RHYME_CPU_HUGEPAGES", HUGEPAGE_MODES),
            cpu_threads=_threads(env, "RHYME_CPU_THREADS"),
            kernel_threads=_threads(env, "RHYME_KERNEL_THREADS"),
            gemm_probe=_text(env, "RHYME_GEMM_PROBE"),
            decode_probe=_text(env, "RHYME_DECODE_PROBE"),
            step_costs=_text(env, "RHYME_STEP_COSTS"),
            decision_log=_text(env, "RHYME_DECISION_LOG"),
            start_method=_choice(env, "RHYME_START_METHOD", START_METHODS),
            cache_dir=_text(env, "RHYME_CACHE_DIR"),
        )

    def changed(self) -> dict:
        """The switches that differ from their defaults, by variable name."""
        default = Settings()
        return {ENV_NAMES[f.name]: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}


ENV_NAMES = {f.name: "RHYME_" + f.name.upper() for f in dataclasses.fields(Settings)}

_current: Optional[Settings] = None


def settings() -> Settings:
    """This process's switches (read and logged on first use)."""
    global _current
    if _current is None:
        _current = Settings.read()
        changed = _current.changed()
        if changed:
            logger.info("rhyme settings: %s", ", ".join(f"{k}={v}" for k, v in changed.items()))
    return _current


def reload() -> None:
    """Forget the cached switches: the next :func:`settings` reads the environment again."""
    global _current
    _current = None


def of(env: Optional[Mapping[str, str]]) -> Settings:
    """``env``'s switches when given (tests and probes pass one), else this process's."""
    return settings() if env is None else Settings.read(env)


def backend_enabled(env: Optional[Mapping[str, str]] = None) -> bool:
    """``RHYME_CPU_BACKEND`` alone: the interpreter-start hook reads it before anything else,
    so a bad value of another switch is reported where that switch is used, not at start."""
    return _choice(os.environ if env is None else env, "RHYME_CPU_BACKEND", BACKEND_SWITCH) == "1"


def cache_root(env: Optional[Mapping[str, str]] = None) -> Path:
    """The folder of every cache: ``RHYME_CACHE_DIR``, else ``$XDG_CACHE_HOME/rhyme_sglang``,
    else ``~/.cache/rhyme_sglang``."""
    explicit = of(env).cache_dir
    if explicit:
        return Path(explicit).expanduser()
    source = os.environ if env is None else env
    base = source.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rhyme_sglang"


def prepare_cpu_env(env: Optional[dict] = None, override: bool = False,
                    cpu_engine: bool = True) -> dict:
    """Set what a CPU process needs before torch or sglang is imported in ``env`` (the process
    environment by default), each only where unset unless ``override`` (a server process the
    library launches: its helper processes stay single-threaded whatever the caller set);
    ``cpu_engine=False`` (a process with a GPU) leaves sglang's engine choice alone. Returns
    ``env``."""
    env = os.environ if env is None else env
    for name, value in CPU_ENV_DEFAULTS.items():
        if name == "SGLANG_USE_CPU_ENGINE" and not cpu_engine:
            continue
        if override:
            env[name] = value
        else:
            env.setdefault(name, value)
    return env
