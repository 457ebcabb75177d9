"""Server-argument defaults for a CPU-only machine, applied only where the user is silent."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from rhyme_sglang.settings import prepare_cpu_env

CPU_DEFAULTS = {
    "device": "cpu",
    "attention_backend": "intel_amx",
    "sampling_backend": "pytorch",
    "mem_fraction_static": 0.5,
    # max_total_tokens: sized per model and dtype (kv_pool_tokens), not a fixed count
    "disable_cuda_graph": True,
    "host": "127.0.0.1",
    # an idle scheduler blocks on its sockets instead of spinning: measured 47-94% of a core
    # spent by an idle vanilla scheduler while the trainer ran beside it (2-core CPU)
    "sleep_on_idle": True,
}


# The KV pool a CPU engine gets when the user gives no --max-total-tokens: this many bytes of K
# and V, within [KV_POOL_MIN_TOKENS, KV_POOL_MAX_TOKENS] tokens. SGLang reserves KV for a
# request's remaining max_new_tokens (times its new-token ratio) at admission, so the pool, not
# --max-running-requests, set the batch of long-capped RL rollouts: 16384 tokens (the earlier
# fixed default) ran 13-19 of 128 requests at 1024-token caps in bench_rollout.
# 2 GiB holds ~93k tokens of SmolLM2-135M in bf16 (23 KB a token), ~47k in fp32.
KV_POOL_BYTES = 2 << 30
KV_POOL_MIN_TOKENS = 16384
KV_POOL_MAX_TOKENS = 131072
_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def kv_bytes_per_token(model_path: str, dtype: str) -> int:
    """Bytes of K and V one token takes in every layer, from the model's ``config.json``."""
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"kv_bytes_per_token: unknown dtype {dtype!r} "
                         f"(one of {sorted(_DTYPE_BYTES)})")
    path = Path(model_path) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"kv_bytes_per_token: cannot read {path}: {exc}") from exc
    cfg = cfg.get("text_config", cfg)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = cfg.get("num_key_value_heads") or heads
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * _DTYPE_BYTES[dtype]


def kv_pool_tokens(model_path: str, dtype: str, budget_bytes: int = KV_POOL_BYTES) -> int:
    """The default ``max_total_tokens`` of a CPU engine: ``budget_bytes`` of KV, clamped to
    [KV_POOL_MIN_TOKENS, KV_POOL_MAX_TOKENS]; the minimum where the model's config is unreadable
    (e.g. a hub id not yet downloaded)."""
    try:
        per_token = kv_bytes_per_token(model_path, dtype)
    except (ValueError, KeyError):
        return KV_POOL_MIN_TOKENS
    return max(KV_POOL_MIN_TOKENS, min(KV_POOL_MAX_TOKENS, budget_bytes // per_token))


def on_cpu_only_machine() -> bool:
    return not torch.cuda.is_available()


def apply_cpu_defaults(kwargs: dict) -> dict:
    """Fill CPU settings into engine kwargs (user-given keys win); set the CPU env vars.

    ``cpu_threads`` and ``kernel_threads`` (ours, not sglang's) are the scheduler's torch
    and native-kernel threads, handed to the spawned scheduler through ``RHYME_CPU_THREADS``
    and ``RHYME_KERNEL_THREADS`` (None/absent: the machine's rules, see
    :func:`rhyme_sglang.machine.choose_scheduler_threads` and ``choose_kernel_threads``)."""
    kwargs = dict(kwargs)
    from rhyme_sglang.machine import export_scheduler_threads

    export_scheduler_threads(kwargs.pop("cpu_threads", None),
                             kernels=kwargs.pop("kernel_threads", None))
    if not on_cpu_only_machine():
        return kwargs
    from rhyme_sglang import cpu_backend

    prepare_cpu_env()
    cpu_backend.activate()
    out = dict(CPU_DEFAULTS)
    if "model_path" in kwargs and kwargs.get("max_total_tokens") is None:
        out["max_total_tokens"] = kv_pool_tokens(kwargs["model_path"],
                                                 str(kwargs.get("dtype", "float32")))
    out.update({k: v for k, v in kwargs.items() if not (k == "max_total_tokens" and v is None)})
    return out
