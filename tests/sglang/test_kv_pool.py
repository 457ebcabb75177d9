"""The CPU KV pool is sized from the model's K/V bytes per token, not a fixed token count."""

from __future__ import annotations

import json

import pytest

from rhyme_sglang.launch_server import prepare_argv
from rhyme_sglang.sglang_ext import cpu_defaults as cd


def _model(tmp_path, **cfg):
    base = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
            "hidden_size": 576}
    base.update(cfg)
    (tmp_path / "config.json").write_text(json.dumps(base))
    return str(tmp_path)


def test_kv_bytes_per_token_follows_layers_kv_heads_and_dtype(tmp_path):
    path = _model(tmp_path)  # SmolLM2-135M's shape: 30 layers, 3 KV heads of 64
    assert cd.kv_bytes_per_token(path, "bfloat16") == 2 * 30 * 3 * 64 * 2 == 23040
    assert cd.kv_bytes_per_token(path, "float32") == 46080
    path = _model(tmp_path, head_dim=128, num_key_value_heads=None)  # MHA, explicit head_dim
    assert cd.kv_bytes_per_token(path, "float32") == 2 * 30 * 9 * 128 * 4
    with pytest.raises(ValueError, match="int8"):
        cd.kv_bytes_per_token(path, "int8")
    with pytest.raises(ValueError, match="config.json"):
        cd.kv_bytes_per_token(str(tmp_path / "missing"), "float32")


def test_pool_tokens_fill_the_budget_within_the_clamps(tmp_path):
    path = _model(tmp_path)
    assert cd.kv_pool_tokens(path, "bfloat16") == cd.KV_POOL_BYTES // 23040
    assert cd.kv_pool_tokens(path, "float32") == cd.KV_POOL_BYTES // 46080
    assert cd.kv_pool_tokens(path, "float32", budget_bytes=1 << 20) == cd.KV_POOL_MIN_TOKENS
    assert cd.kv_pool_tokens(path, "float32", budget_bytes=1 << 40) == cd.KV_POOL_MAX_TOKENS
    # a hub id not downloaded yet: the floor, not an error
    assert cd.kv_pool_tokens("HuggingFaceTB/not-here", "bfloat16") == cd.KV_POOL_MIN_TOKENS


def test_engine_and_server_defaults_use_it_and_a_given_size_wins(tmp_path):
    path = _model(tmp_path)
    expected = cd.kv_pool_tokens(path, "float32")
    assert expected > 16384  # SmolLM2 fp32 holds ~47k tokens in 2 GiB
    for silent in ({}, {"max_total_tokens": None}):
        out = cd.apply_cpu_defaults({"model_path": path, "dtype": "float32", **silent})
        assert out["max_total_tokens"] == expected
    out = cd.apply_cpu_defaults({"model_path": path, "dtype": "float32", "max_total_tokens": 4096})
    assert out["max_total_tokens"] == 4096

    argv = prepare_argv(["--model-path", path, "--dtype", "bfloat16"], cpu_only=True)
    assert argv[argv.index("--max-total-tokens") + 1] == str(cd.kv_pool_tokens(path, "bfloat16"))
    argv = prepare_argv(["--model-path", path, "--dtype", "float32", "--max-total-tokens=999"],
                        cpu_only=True)
    assert "--max-total-tokens" not in argv and "--max-total-tokens=999" in argv
    argv = prepare_argv(["--model-path", path, "--dtype", "float32"], cpu_only=False)
    assert not any(a.startswith("--max-total-tokens") for a in argv)  # GPU: sglang sizes it


def test_driver_engine_config_zero_means_sized_per_model():
    from rl_driver.config import EngineConfig

    assert EngineConfig().server_args("/m")["max_total_tokens"] is None
    assert EngineConfig(max_total_tokens=4096).server_args("/m")["max_total_tokens"] == 4096
    with pytest.raises(ValueError, match="max_total_tokens"):
        EngineConfig(max_total_tokens=-1)
