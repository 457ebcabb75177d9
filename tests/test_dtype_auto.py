"""``dtype: auto`` and the thread rules: the engines' choice by the decode probe, the trainer's by
the GEMM probe, injected probes, explicit wins."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from rhyme_sglang import dtypes, machine
from rhyme_sglang.launch_server import pop_cpu_threads, prepare_argv
from rhyme_sglang.dtypes import DecodeProbe, GemmProbe, choose_dtype, choose_train_dtype

SLOW_BF16 = GemmProbe(float32=50.0, bfloat16=5.5, source="injected")  # AVX2 only
FAST_BF16 = GemmProbe(float32=50.0, bfloat16=400.0, source="injected")  # AMX
# the machine class (avx512_bf16, no AMX): large bf16 products 2.5x faster...
WIDE_BF16 = GemmProbe(float32=76.8, bfloat16=189.1, source="injected")
# ...and its decode steps without a native bf16 step, or with one that streams half the bytes
NO_NATIVE_BF16 = DecodeProbe((1e-3, 1.4e-3, 1.6e-3), (), "injected")
SLOWER_BF16_STEPS = DecodeProbe((1e-3, 1.4e-3, 1.6e-3), (0.9e-3, 1.6e-3, 2.0e-3), "injected")
FASTER_BF16_STEPS = DecodeProbe((1e-3, 1.4e-3, 1.6e-3), (0.5e-3, 0.8e-3, 1.7e-3), "injected")


def test_engines_follow_the_decode_probe_and_explicit_wins():
    assert choose_dtype("auto", NO_NATIVE_BF16, cuda=False) == "float32"
    assert choose_dtype(None, NO_NATIVE_BF16, cuda=False) == "float32"
    # faster at batch 1, slower at 8 and verify: the geometric mean decides
    assert SLOWER_BF16_STEPS.bf16_over_fp32() == pytest.approx((0.9 * 1.6 / 1.4 * 2.0 / 1.6) ** (1 / 3))
    assert choose_dtype("auto", SLOWER_BF16_STEPS, cuda=False) == "float32"
    assert choose_dtype("auto", FASTER_BF16_STEPS, cuda=False) == "bfloat16"
    assert math.isinf(NO_NATIVE_BF16.bf16_over_fp32())
    assert choose_dtype("auto", None, cuda=True) == "bfloat16"
    for explicit in ("float32", "bfloat16", "float16"):
        assert choose_dtype(explicit, FASTER_BF16_STEPS, cuda=False) == explicit
        assert choose_dtype(explicit, NO_NATIVE_BF16, cuda=True) == explicit
    with pytest.raises(ValueError, match="int8"):
        choose_dtype("int8", NO_NATIVE_BF16, cuda=False)
    with pytest.raises(ValueError, match="decode probe"):
        choose_dtype("auto", None, cuda=False)


def test_trainer_follows_the_gemm_probe():
    """Training is compute-bound: large products decide, whatever the decode steps say."""
    assert choose_train_dtype("auto", SLOW_BF16, cuda=False) == "float32"
    assert choose_train_dtype("auto", FAST_BF16, cuda=False) == "bfloat16"
    assert choose_train_dtype("auto", WIDE_BF16, cuda=False) == "bfloat16"
    assert choose_train_dtype(None, None, cuda=True) == "bfloat16"
    assert choose_train_dtype("float32", FAST_BF16, cuda=False) == "float32"
    with pytest.raises(ValueError, match="GEMM probe"):
        choose_train_dtype("auto", None, cuda=False)


def test_probe_injection_and_its_errors():
    probe = dtypes.gemm_probe(env={dtypes.PROBE_ENV: "float32=40,bfloat16=4.5"})
    assert probe == GemmProbe(40.0, 4.5, "injected")
    for bad in ("float32=40", "fp32=40,bfloat16=4", "float32=x,bfloat16=4", "float32=-1,bfloat16=4"):
        with pytest.raises(ValueError, match="RHYME_GEMM_PROBE"):
            dtypes.parse_probe(bad)
    decode = dtypes.decode_probe(env={dtypes.DECODE_PROBE_ENV: "float32=2,bfloat16=1"})
    steps = len(dtypes.STEP_ROWS)
    assert decode == DecodeProbe((2e-3,) * steps, (1e-3,) * steps, "injected")
    with pytest.raises(ValueError, match="RHYME_DECODE_PROBE"):
        dtypes.parse_decode_probe("float32=2")


def test_gemm_probe_is_measured_once_then_cached(tmp_path):
    cache = tmp_path / "probe.json"
    measured = dtypes.gemm_probe(cache=cache, env={})
    assert measured.source == "measured" and measured.float32 > 0 and measured.bfloat16 > 0
    table = json.loads(cache.read_text())
    assert table[machine.machine_key()]["float32"] == measured.float32
    cached = dtypes.gemm_probe(cache=cache, env={})
    assert cached.source == "cached" and cached.float32 == measured.float32
    table[machine.machine_key()] = {"float32": 9.0, "bfloat16": 90.0}
    cache.write_text(json.dumps(table))
    assert dtypes.gemm_probe(cache=cache, env={}) == GemmProbe(9.0, 90.0, "cached")


def test_decode_probe_is_cached_under_the_kernels_revision(monkeypatch, tmp_path):
    """Measured once per machine, thread setting and kernel revision: a new revision (a kernel
    change) measures again; a malformed entry too."""
    from rhyme_sglang.cpu_backend import dtype_probe

    calls = []

    def fake_measure():
        calls.append(dtype_probe.revision())
        return DecodeProbe((1e-3, 2e-3, 3e-3), (5e-4, 1e-3, 4e-3), "measured")

    monkeypatch.setattr(dtypes, "measure_decode_probe", fake_measure)
    cache = tmp_path / "decode.json"
    first = dtypes.decode_probe(cache=cache, env={})
    assert first.source == "measured" and len(calls) == 1
    assert dtypes.decode_probe(cache=cache, env={}) == first._replace(source="cached")
    assert len(calls) == 1
    key = dtypes.decode_probe_key()
    assert dtype_probe.revision() in key and f"v{dtypes.DECODE_PROBE_VERSION}" in key
    monkeypatch.setattr(dtype_probe, "revision", lambda: "native-r999")
    assert dtypes.decode_probe(cache=cache, env={}).source == "measured" and len(calls) == 2
    table = json.loads(cache.read_text())
    table[dtypes.decode_probe_key()]["bfloat16"] = [1.0]  # another number of steps
    cache.write_text(json.dumps(table))
    assert dtypes.decode_probe(cache=cache, env={}).source == "measured" and len(calls) == 3
    table = json.loads(cache.read_text())
    table[dtypes.decode_probe_key()]["bfloat16"] = []  # no native bf16 step: kept as such
    cache.write_text(json.dumps(table))
    cached = dtypes.decode_probe(cache=cache, env={})
    assert cached.bfloat16 == () and choose_dtype("auto", cached, cuda=False) == "float32"


def test_decode_probe_measures_each_native_dtype(monkeypatch):
    """A real (small) measurement: fp32 always; bf16 only where it decodes natively."""
    from rhyme_sglang.cpu_backend import dtype_probe, linear

    monkeypatch.setattr(linear, "_largest_cache_bytes", lambda: 1 << 20)
    probe = dtypes.measure_decode_probe()
    assert len(probe.float32) == len(dtypes.STEP_ROWS) and min(probe.float32) > 0
    if dtype_probe.decodes_natively("bfloat16"):
        assert len(probe.bfloat16) == len(dtypes.STEP_ROWS) and min(probe.bfloat16) > 0
    else:
        assert probe.bfloat16 == () and "no native bf16" in probe.describe()


def _cpu_only():
    if torch.cuda.is_available():
        pytest.skip("auto is bf16 with CUDA; the probes decide on CPU-only machines")


@pytest.mark.parametrize("probe, expected", [("float32=1,bfloat16=2", "float32"),
                                             ("float32=2,bfloat16=1", "bfloat16")])
def test_resolve_dtype_and_launch_server_argv(monkeypatch, probe, expected):
    _cpu_only()
    monkeypatch.setenv(dtypes.DECODE_PROBE_ENV, probe)
    monkeypatch.setenv(dtypes.PROBE_ENV, "float32=50,bfloat16=400")  # the trainer's: not the engines'
    assert dtypes.resolve_dtype("auto") == expected
    assert dtypes.resolve_dtype(None) == expected
    assert dtypes.resolve_dtype("float16") == "float16"
    argv = prepare_argv(["--model-path", "/m"], cpu_only=True)
    assert argv[argv.index("--dtype") + 1] == expected
    argv = prepare_argv(["--model-path", "/m", "--dtype", "auto"], cpu_only=True)
    assert argv.count("--dtype") == 1 and argv[argv.index("--dtype") + 1] == expected
    for given in (["--dtype", "float16"], ["--dtype=float16"]):
        argv = prepare_argv(["--model-path", "/m", *given], cpu_only=True)
        assert argv[argv.index("--dtype") + 1] == "float16" and "--dtype=float16" not in argv


def test_both_decisions_are_logged_with_their_figures(monkeypatch, caplog):
    _cpu_only()
    monkeypatch.setenv(dtypes.DECODE_PROBE_ENV, "float32=1,bfloat16=2")
    monkeypatch.setenv(dtypes.PROBE_ENV, "float32=76.8,bfloat16=189.1")
    monkeypatch.setattr(dtypes, "_logged", set())
    with caplog.at_level(logging.INFO, logger="rhyme_sglang.dtypes"):
        assert dtypes.resolve_dtype() == "float32"
        assert dtypes.resolve_train_dtype() == "bfloat16"
        dtypes.resolve_dtype()  # logged once
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0].startswith("engine dtype auto -> float32 (decode probe:") and "x2.00" in lines[0]
    assert lines[1].startswith("trainer dtype auto -> bfloat16 (GEMM probe: fp32 76.8 GFLOP/s, bf16 189.1")


def test_cpu_threads_flag_and_rules():
    assert pop_cpu_threads(["--port", "1", "--cpu-threads", "3"]) == (3, ["--port", "1"])
    assert pop_cpu_threads(["--cpu-threads=auto"]) == (None, [])
    with pytest.raises(ValueError, match="two"):
        pop_cpu_threads(["--cpu-threads", "two"])
    assert machine.choose_scheduler_threads(None, cores=2) == 1
    assert machine.choose_scheduler_threads(None, cores=16, engines=2) == 7
    assert machine.choose_scheduler_threads(4, cores=2) == 4
    assert machine.choose_trainer_threads(0, cores=2) == 2
    assert machine.choose_trainer_threads(1, cores=16) == 1
    assert machine.threads_from_env({machine.THREADS_ENV: "2"}) == 2
    assert machine.threads_from_env({machine.THREADS_ENV: "auto"}) is None
    with pytest.raises(ValueError, match="RHYME_CPU_THREADS"):
        machine.threads_from_env({machine.THREADS_ENV: "-1"})


def test_engine_cpu_threads_kwarg_reaches_the_scheduler_env(monkeypatch):
    from rhyme_sglang.sglang_ext.cpu_defaults import apply_cpu_defaults

    monkeypatch.delenv(machine.THREADS_ENV, raising=False)
    out = apply_cpu_defaults({"model_path": "/m", "cpu_threads": 3})
    assert "cpu_threads" not in out and out["model_path"] == "/m"
    assert machine.threads_from_env() == 3


def test_kernel_threads_rules_flag_and_kwarg(monkeypatch):
    """The native kernels' threads: all usable cores per engine unless asked (their workers
    claim parts one at a time, so none is held back for the tokenizer/detokenizer)."""
    from rhyme_sglang.sglang_ext.cpu_defaults import apply_cpu_defaults

    assert machine.choose_kernel_threads(None, cores=2) == 2
    assert machine.choose_kernel_threads(None, cores=2, engines=2) == 1
    assert machine.choose_kernel_threads(None, cores=16, engines=3) == 5
    assert machine.choose_kernel_threads(3, cores=2) == 3
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="kernel threads"):
            machine.choose_kernel_threads(bad, cores=2)
    assert pop_cpu_threads(["--kernel-threads", "2", "--cpu-threads", "1"], "--kernel-threads") \
        == (2, ["--cpu-threads", "1"])
    with pytest.raises(ValueError, match="--kernel-threads"):
        pop_cpu_threads(["--kernel-threads", "x"], "--kernel-threads")
    monkeypatch.delenv(machine.KERNEL_THREADS_ENV, raising=False)
    out = apply_cpu_defaults({"model_path": "/m", "kernel_threads": 2})
    assert "kernel_threads" not in out and machine.kernel_threads_from_env() == 2
    # the scheduler process: torch's threads by one rule, the kernels' by the other
    monkeypatch.setattr(machine, "usable_cores", lambda: 2)
    monkeypatch.setattr(machine, "_kernel_threads", None)
    threads = torch.get_num_threads()
    try:
        assert machine.set_scheduler_threads({}) == 1 and machine.kernel_threads() == 2
        machine.set_scheduler_threads({machine.KERNEL_THREADS_ENV: "1"})
        assert machine.kernel_threads() == 1
    finally:
        torch.set_num_threads(threads)
        machine.set_kernel_threads(None)



def test_cpu_schedulers_sleep_when_idle():
    """An idle scheduler blocks on its sockets on CPU (it spun at up to a core beside the
    trainer): the Engine defaults and launch_server's argv both ask for it, once."""
    from rhyme_sglang.sglang_ext.cpu_defaults import CPU_DEFAULTS

    assert CPU_DEFAULTS["sleep_on_idle"] is True
    argv = prepare_argv(["--model-path", "/m", "--dtype", "float32"], cpu_only=True)
    assert argv.count("--sleep-on-idle") == 1
    argv = prepare_argv(["--model-path", "/m", "--dtype", "float32", "--sleep-on-idle"], cpu_only=True)
    assert argv.count("--sleep-on-idle") == 1
    assert "--sleep-on-idle" not in prepare_argv(["--model-path", "/m", "--dtype", "float32"],
                                                 cpu_only=False)
