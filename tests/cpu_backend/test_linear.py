"""The CPU linear kernel choice: packed oneDNN and native products equal F.linear, a native row's
bits do not depend on the other rows of the call, packs follow weight updates, the per-machine
choice is measured once and cached, bad modes are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rhyme_sglang.cpu_backend import linear

CAN_PACK = linear.pack(torch.randn(8, 4)) is not None
HAS_NATIVE = linear.native_pack(torch.randn(8, 4)) is not None


def _layer():
    return torch.nn.Module()


@pytest.fixture(autouse=True)
def _fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(linear, "_choices", {})


@pytest.mark.skipif(not CAN_PACK, reason="oneDNN cannot pack fp32 weights here")
@pytest.mark.parametrize("rows", [1, 2, 3, 9, 17, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_matches_f_linear(monkeypatch, rows, with_bias):
    monkeypatch.setenv(linear.MODE_ENV, "packed")
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=gen)
    bias = torch.randn(96, generator=gen) if with_bias else None
    x = torch.randn(rows, 40, generator=gen)
    layer = _layer()
    out = linear.linear(layer, x, weight, bias)
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert layer._rhyme_cpu_linear.packs.get("onednn") is not None  # the packed kernel ran
    x3 = x.reshape(1, rows, 40)  # leading dims are kept
    assert linear.linear(layer, x3, weight, bias).shape == (1, rows, 96)


@pytest.mark.skipif(not CAN_PACK, reason="oneDNN cannot pack fp32 weights here")
@pytest.mark.parametrize("mode", ["packed", "native"])
def test_pack_follows_weight_updates(monkeypatch, mode):
    if mode == "native" and not HAS_NATIVE:
        pytest.skip("the native GEMM module is not built")
    monkeypatch.setenv(linear.MODE_ENV, mode)
    weight = torch.nn.Parameter(torch.randn(32, 16), requires_grad=False)
    x = torch.randn(4, 16)
    layer = _layer()
    linear.linear(layer, x, weight)
    new = torch.randn(32, 16)
    weight.data.copy_(new)  # what sglang's weight loaders do: invisible to the version counter
    linear.weights_changed()
    torch.testing.assert_close(linear.linear(layer, x, weight), F.linear(x, new), rtol=1e-5, atol=1e-5)
    weight.data = torch.randn(32, 16)  # a replaced tensor is noticed without a generation bump
    torch.testing.assert_close(linear.linear(layer, x, weight), F.linear(x, weight), rtol=1e-5,
                               atol=1e-5)


def test_plain_mode_never_packs(monkeypatch):
    monkeypatch.setenv(linear.MODE_ENV, "plain")
    layer, weight, x = _layer(), torch.randn(32, 16), torch.randn(8, 16)
    torch.testing.assert_close(linear.linear(layer, x, weight), F.linear(x, weight))
    assert not layer._rhyme_cpu_linear.packs


@pytest.mark.skipif(not HAS_NATIVE, reason="the native GEMM module is not built")
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 9, 13, 17, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_native_matches_f_linear(monkeypatch, rows, with_bias):
    monkeypatch.setenv(linear.MODE_ENV, "native")
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(100, 37, generator=gen)  # neither size a multiple of the panel width
    bias = torch.randn(100, generator=gen) if with_bias else None
    x = torch.randn(rows, 37, generator=gen)
    layer = _layer()
    out = linear.linear(layer, x, weight, bias)
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert layer._rhyme_cpu_linear.packs.get("native") is not None  # the native kernel ran
    x3 = x.reshape(1, rows, 37)
    assert linear.linear(layer, x3, weight, bias).shape == (1, rows, 100)
    strided = torch.randn(rows, 74, generator=gen)[:, ::2]  # a non-contiguous input
    torch.testing.assert_close(linear.linear(layer, strided, weight, bias),
                               F.linear(strided, weight, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not HAS_NATIVE, reason="the native GEMM module is not built")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("in_features", [96, 77, 20])  # whole k blocks of the kernel, a part, less than one
def test_native_row_does_not_depend_on_other_rows(monkeypatch, threads, in_features):
    """What makes a verify tree's rows bit-identical to decoding them one at a time."""
    from rhyme_sglang import machine

    monkeypatch.setenv(linear.MODE_ENV, "native")
    monkeypatch.setattr(machine, "_kernel_threads", threads)
    gen = torch.Generator().manual_seed(7)
    weight, bias = torch.randn(200, in_features, generator=gen), torch.randn(200, generator=gen)
    layer = _layer()
    batch = torch.randn(33, in_features, generator=gen)
    together = linear.linear(layer, batch, weight, bias)
    for rows in (1, 2, 3, 4, 5, 9, 17):  # 1-4: two panels a tile (AVX-512; AVX2 1-2)
        part = linear.linear(layer, batch[-rows:].contiguous(), weight, bias)
        assert torch.equal(part, together[-rows:]), rows
    for i in (0, 5, 32):
        assert torch.equal(linear.linear(layer, batch[i:i + 1], weight, bias)[0], together[i])


HAS_NATIVE_BF16 = linear.native_bf16()
needs_bf16 = pytest.mark.skipif(not HAS_NATIVE_BF16, reason="the native bf16 product needs avx512_bf16")


@needs_bf16
@pytest.mark.parametrize("rows", [1, 2, 7, 9, 13, 17, 25, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_native_bf16_matches_its_twin(monkeypatch, rows, with_bias):
    """bf16 weights and rows, fp32 sums rounded once to bf16: the pure-PyTorch twin's numbers
    within bf16 rounding (the kernel adds in another order), as F.linear's own are."""
    monkeypatch.setenv(linear.MODE_ENV, "native")
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(100, 38, generator=gen).bfloat16()  # 100: not a whole panel
    bias = torch.randn(100, generator=gen).bfloat16() if with_bias else None
    x = torch.randn(rows, 38, generator=gen).bfloat16()
    layer = _layer()
    out = linear.linear(layer, x, weight, bias)
    assert out.dtype == torch.bfloat16 and layer._rhyme_cpu_linear.packs.get("native") is not None
    twin = linear.bf16_twin(x, weight, bias)
    torch.testing.assert_close(out, twin)
    torch.testing.assert_close(twin, F.linear(x, weight, bias))
    # with small integers every sum is exact: the same bits as the twin
    ints = torch.randint(-4, 5, (rows, 38), generator=gen).bfloat16()
    assert torch.equal(linear.linear(layer, ints, weight.round(), None),
                       linear.bf16_twin(ints, weight.round()))
    strided = torch.randn(rows, 76, generator=gen).bfloat16()[:, ::2]
    torch.testing.assert_close(linear.linear(layer, strided, weight, bias),
                               linear.bf16_twin(strided, weight, bias))


@needs_bf16
@pytest.mark.parametrize("threads", [1, 2])
def test_native_bf16_row_does_not_depend_on_other_rows(monkeypatch, threads):
    from rhyme_sglang import machine

    monkeypatch.setenv(linear.MODE_ENV, "native")
    monkeypatch.setattr(machine, "_kernel_threads", threads)
    gen = torch.Generator().manual_seed(8)
    weight = torch.randn(200, 96, generator=gen).bfloat16()
    bias = torch.randn(200, generator=gen).bfloat16()
    layer = _layer()
    batch = torch.randn(33, 96, generator=gen).bfloat16()
    together = linear.linear(layer, batch, weight, bias)
    for rows in (1, 2, 3, 4, 5, 9, 17):  # 1-4: two panels a tile (AVX-512; AVX2 1-2)
        assert torch.equal(linear.linear(layer, batch[-rows:].contiguous(), weight, bias),
                           together[-rows:]), rows


def test_native_bf16_needs_an_even_width_and_the_cpu():
    odd = torch.randn(16, 7).bfloat16()
    assert linear.native_pack(odd) is None  # two inputs a 32-bit lane: oneDNN / F.linear run it
    even = linear.native_pack(torch.randn(16, 8).bfloat16())
    assert (even is not None) == HAS_NATIVE_BF16
    if HAS_NATIVE_BF16:
        assert even.dtype == torch.int32 and even.numel() == linear._native.panel_width() * 4


def test_bf16_twin_rounds_the_fp32_sum_once():
    """1 + 3 * 2^-9 rounds up to 1 + 2^-7 once; rounded after every add it would stay 1."""
    x = torch.tensor([[1.0, 2.0 ** -9, 2.0 ** -9, 0.0]]).bfloat16()
    w = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]]).bfloat16()
    bias = torch.tensor([2.0 ** -9, 0.0]).bfloat16()
    assert linear.bf16_twin(x, w, bias).tolist() == [[1.0 + 2.0 ** -7, 2.0 ** -8]]
    if HAS_NATIVE_BF16:
        panels = linear.native_pack(w)
        assert linear.native_linear(x, panels, 2, bias).tolist() == [[1.0 + 2.0 ** -7, 2.0 ** -8]]


def _gemm_in_parts(threads):
    gen = torch.Generator().manual_seed(9)
    weight, x = torch.randn(300, 64, generator=gen), torch.randn(5, 64, generator=gen)
    panels = linear.native_pack(weight)
    out = torch.empty(5, 300)
    linear._native.gemm(x.data_ptr(), panels.data_ptr(), 0, out.data_ptr(), 5, 300, 64, threads)
    return out


def _forked_gemm(queue):
    queue.put(_gemm_in_parts(3).tolist())


@pytest.mark.skipif(not HAS_NATIVE, reason="the native GEMM module is not built")
def test_thread_pool_repeats_and_survives_a_fork():
    """The kernels' persistent worker pool: many calls at 1-4 threads give the same bits, and a
    process forked after the pool started (its workers are not copied) makes its own."""
    import multiprocessing

    first = _gemm_in_parts(1)
    for threads in (2, 3, 4, 2) * 25:
        assert torch.equal(_gemm_in_parts(threads), first), threads
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_forked_gemm, args=(queue,))
    child.start()
    result = queue.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0
    assert torch.equal(torch.tensor(result), first)


def test_unpackable_dtype_falls_back(monkeypatch):
    monkeypatch.setenv(linear.MODE_ENV, "packed")
    weight, x = torch.randn(32, 16, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64)
    assert not linear.applies(x, weight)
    assert linear.pack(weight) is None


def test_auto_measures_once_and_caches(monkeypatch, tmp_path):
    monkeypatch.setenv(linear.MODE_ENV, "auto")
    calls = []

    def fake_measure(n, k, dtype):
        calls.append((n, k))
        return tuple(linear.KERNELS[i % 3] for i in range(len(linear.BUCKETS)))

    monkeypatch.setattr(linear, "measure_choice", fake_measure)
    cache = tmp_path / "rhyme_sglang" / "linear_kernels.json"
    first = linear.kernel_choice(64, 32, torch.float32)
    assert calls == [(64, 32)] and cache.exists()
    measured = list(json.loads(cache.read_text()).values())  # the cache keeps the measurement
    assert measured == [[linear.KERNELS[i % 3] for i in range(len(linear.BUCKETS))]]
    assert first == ("native",) * len(linear.BUCKETS)  # native won a bucket: it takes them all
    assert linear.row_independent(("plain", "onednn")) == ("plain", "onednn")
    monkeypatch.setattr(linear, "_choices", {})  # a new process: read from disk, no measuring
    assert linear.kernel_choice(64, 32, torch.float32) == first and calls == [(64, 32)]
    linear.kernel_choice(64, 48, torch.float32)  # another shape is measured on its own
    assert calls == [(64, 32), (64, 48)]


def test_measured_choice_has_a_verdict_per_bucket(monkeypatch):
    monkeypatch.setattr(linear, "_largest_cache_bytes", lambda: 4096)
    choice = linear.measure_choice(48, 32, torch.float32, repeats=1, budget_s=0.2)
    assert len(choice) == len(linear.BUCKETS) and set(choice) <= set(linear.KERNELS)


def test_buckets_past_the_budget_are_measured_not_copied(monkeypatch):
    """A large weight's streamed copies can use up the budget in the first bucket; the later
    buckets must still be measured (the kernels' rank changes with the rows)."""
    import time as _time

    def fake_kernels(weights):
        def native(x):
            _time.sleep(1e-4 * x.shape[0])  # grows with the rows

        def onednn(x):
            _time.sleep(2e-3)  # flat
        return {"plain": lambda x: None, "native": native, "onednn": onednn}

    monkeypatch.setattr(linear, "streamed_kernels", fake_kernels)
    monkeypatch.setattr(linear, "streamed_copies", lambda o, i, dtype, gen: [None] * 8)
    monkeypatch.setattr(linear, "best_times", lambda kernels, repeats, deadline: {
        name: (0.05 if name == "plain" else _timed(fn)) for name, fn in kernels.items()})
    choice = linear.measure_choice(48, 32, torch.float32, repeats=1, budget_s=0.0)
    assert choice[0] == "native" and choice[-1] == "onednn", choice


def _timed(fn) -> float:
    import time as _time

    start = _time.perf_counter()
    fn()
    return _time.perf_counter() - start


def test_a_stale_cache_entry_is_measured_again(monkeypatch, tmp_path):
    """A cache written by an older release (booleans) is not misread as kernel names."""
    monkeypatch.setenv(linear.MODE_ENV, "auto")
    monkeypatch.setattr(linear, "measure_choice", lambda n, k, dtype: ("native",) * len(linear.BUCKETS))
    cache = tmp_path / "linear_kernels.json"
    choice = linear.kernel_choice(64, 32, torch.float32, cache=cache)
    key = next(iter(json.loads(cache.read_text())))
    cache.write_text(json.dumps({key: [True] * len(linear.BUCKETS)}))
    monkeypatch.setattr(linear, "_choices", {})
    assert linear.kernel_choice(64, 32, torch.float32, cache=cache) == choice


def test_native_is_kept_unless_another_kernel_is_clearly_faster():
    """A bucket whose linears are all native runs the decoder step as one native call."""
    margin = linear.NATIVE_MARGIN
    assert linear.pick_kernel({"plain": 3.0, "onednn": 1.0, "native": 1.0 * margin}) == "native"
    assert linear.pick_kernel({"plain": 3.0, "onednn": 1.0, "native": 1.01 * margin}) == "onednn"
    assert linear.pick_kernel({"plain": 1.0, "onednn": 2.0}) == "plain"


def test_bucket_index():
    assert [linear.bucket_index(r) for r in (1, 2, 3, 4, 5, 256, 10_000)] == [0, 1, 2, 2, 3, 8, 8]


def test_bad_mode_names_the_value(monkeypatch):
    monkeypatch.setenv(linear.MODE_ENV, "fast")
    with pytest.raises(ValueError, match="'fast'"):
        linear.kernel_choice(8, 8, torch.float32)


_SHARED_POOL_SCRIPT = """
import os, torch
from rhyme_sglang.cpu_backend import attention, linear
from tests.cpu_backend.helpers import attention_impl, paged_cache
from rhyme_sglang.machine import set_kernel_threads

def tasks():
    return len(os.listdir("/proc/self/task"))

gen = torch.Generator().manual_seed(3)
weight, x = torch.randn(300, 64, generator=gen), torch.randn(2, 64, generator=gen)
panels = linear.native_pack(weight)
out = torch.empty(2, 300)
seq = [40, 7, 19, 33, 12, 25, 9, 30]
k_buffer, v_buffer, req_to_token, rows = paged_cache(gen, seq, 2, 64, 64, torch.float32)
q = torch.randn(len(seq), 6, 64, generator=gen)
o = torch.zeros(len(seq), 6, 64)
before = tasks()
linear._native.gemm(x.data_ptr(), panels.data_ptr(), 0, out.data_ptr(), 2, 300, 64, 4)
after_gemm = tasks()
set_kernel_threads(4)
with attention_impl("native"):
    attention.decode_attention_cpu(q, k_buffer, v_buffer, 1.0, 1.0, o, None, None, None, None,
                                   req_to_token, rows, torch.tensor(seq), 0.125, 0.0, False, 0,
                                   None, None)
print(after_gemm - before, tasks() - after_gemm)
"""


@pytest.mark.skipif(not HAS_NATIVE, reason="the native GEMM module is not built")
def test_the_native_modules_share_one_worker_pool():
    """The GEMM and the attention module run their parts on one pool: 4 threads start 3
    workers once, not 3 per module (two sets spinning on the same cores)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", _SHARED_POOL_SCRIPT], cwd=root,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-2:] == ["3", "0"]


def test_kernel_threads_setting(monkeypatch):
    from rhyme_sglang import machine

    monkeypatch.setattr(machine, "_kernel_threads", None)
    monkeypatch.setenv(machine.KERNEL_THREADS_ENV, "auto")
    assert machine.kernel_threads() == torch.get_num_threads()
    monkeypatch.setenv(machine.KERNEL_THREADS_ENV, "3")
    assert machine.kernel_threads() == 3
    monkeypatch.setenv(machine.KERNEL_THREADS_ENV, "2")
    assert machine.kernel_threads() == 3  # read once per process
    machine.set_kernel_threads(None)
    monkeypatch.setenv(machine.KERNEL_THREADS_ENV, "two")
    with pytest.raises(ValueError, match="RHYME_KERNEL_THREADS"):
        machine.kernel_threads()
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="kernel threads"):
            machine.set_kernel_threads(bad)
