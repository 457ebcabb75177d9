"""Server-argument defaults for a CPU-only machine, applied only where the user is silent."""

from __future__ import annotations

import os

import torch

CPU_DEFAULTS = {
    "device": "cpu",
    "attention_backend": "intel_amx",
    "sampling_backend": "pytorch",
    "mem_fraction_static": 0.5,
    "max_total_tokens": 16384,
    "disable_cuda_graph": True,
    "host": "127.0.0.1",
    # an idle scheduler blocks on its sockets instead of spinning: measured 47-94% of a core
    # spent by an idle vanilla scheduler while the trainer ran beside it (2-core CPU)
    "sleep_on_idle": True,
}


def on_cpu_only_machine() -> bool:
    return not torch.cuda.is_available()


def apply_cpu_defaults(kwargs: dict) -> dict:
    """Fill CPU settings into engine kwargs (user-given keys win); set the CPU env vars.

    ``cpu_threads`` (ours, not sglang's) is the scheduler's compute threads, handed to the
    spawned scheduler through ``RHYME_CPU_THREADS`` (None/absent: the machine's rule, see
    :func:`rhyme_sglang.machine.choose_scheduler_threads`)."""
    kwargs = dict(kwargs)
    from rhyme_sglang.machine import export_scheduler_threads

    export_scheduler_threads(kwargs.pop("cpu_threads", None))
    if not on_cpu_only_machine():
        return kwargs
    from rhyme_sglang import cpu_backend

    cpu_backend.configure_environment()
    cpu_backend.activate()
    out = dict(CPU_DEFAULTS)
    out.update(kwargs)
    return out


def cpu_env_ready() -> bool:
    return os.environ.get("SGLANG_USE_CPU_ENGINE") == "1"
