"""Weight panels on transparent huge pages: advised mappings, freed with their tensors, the
switch, and the same products as panels on small pages."""

from __future__ import annotations

import gc

import pytest
import torch

from rhyme_sglang import settings
from rhyme_sglang.cpu_backend import hugepages, linear, native_step

THP_ON = hugepages.enabled()
needs_thp = pytest.mark.skipif(not THP_ON, reason="transparent huge pages off on this kernel")


def _region(address: int) -> dict:
    """The /proc/self/smaps entry holding ``address``: its range and fields."""
    region = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                region = {"lo": lo, "hi": hi} if lo <= address < hi else None
            elif region is not None:
                key, _, value = line.partition(":")
                region[key] = value.strip()
                if key == "VmFlags":
                    return region
    raise AssertionError(f"no mapping holds {address:#x}")


def _mapped(address: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


@pytest.fixture
def fresh_chunk():
    hugepages.drop_chunk()
    yield
    hugepages.drop_chunk()


@needs_thp
def test_large_tensors_come_from_advised_aligned_chunks(fresh_chunk):
    a = hugepages.empty(3 << 20, torch.float32)  # 12 MB
    b = hugepages.empty((1 << 20) + 3, torch.int32)
    assert a.dtype == torch.float32 and a.numel() == 3 << 20
    assert b.dtype == torch.int32 and b.numel() == (1 << 20) + 3
    assert a.data_ptr() % hugepages.HUGE_PAGE == 0 and b.data_ptr() % hugepages.ALIGN == 0
    assert b.data_ptr() >= a.data_ptr() + a.numel() * 4  # carved after it, not over it
    a.fill_(1.5), b.fill_(7)
    assert float(a.sum()) == 1.5 * (3 << 20) and int(b[-1]) == 7
    region = _region(a.data_ptr())
    assert "hg" in region["VmFlags"].split()  # MADV_HUGEPAGE
    assert region["hi"] - region["lo"] >= hugepages.CHUNK_BYTES


def test_small_tensors_and_the_off_switch_use_torch_empty(monkeypatch, fresh_chunk):
    small = hugepages.empty(1000, torch.float32)
    assert "hg" not in _region(small.data_ptr())["VmFlags"].split()
    monkeypatch.setenv("RHYME_CPU_HUGEPAGES", "off")
    settings.reload()
    try:
        assert not hugepages.enabled() and hugepages.mode() == "4k"
        assert native_step.revisions() == "none" or native_step.revisions().endswith("-4k")
        big = hugepages.empty(4 << 20, torch.float32)
        assert "hg" not in _region(big.data_ptr())["VmFlags"].split()
    finally:
        monkeypatch.undo()
        settings.reload()


def test_bad_switch_and_count_are_value_errors():
    with pytest.raises(ValueError, match="RHYME_CPU_HUGEPAGES"):
        settings.Settings.read({"RHYME_CPU_HUGEPAGES": "sometimes"})
    with pytest.raises(ValueError, match="count"):
        hugepages.empty(-1, torch.float32)


@needs_thp
def test_a_chunk_is_unmapped_with_its_last_tensor(fresh_chunk):
    big = hugepages.empty((hugepages.CHUNK_BYTES // 4) + 1024, torch.float32)  # a mapping of its own
    parts = [hugepages.empty(1 << 20, torch.float32) for _ in range(3)]
    addresses = [big.data_ptr(), parts[0].data_ptr()]
    assert all(_mapped(a) for a in addresses)
    del big, parts
    hugepages.drop_chunk()
    gc.collect()
    assert not any(_mapped(a) for a in addresses)


def test_kernel_mode_reads_the_bracketed_choice(tmp_path):
    switch = tmp_path / "enabled"
    switch.write_text("always [madvise] never\n")
    assert hugepages.kernel_mode(switch) == "madvise"
    assert hugepages.kernel_mode(tmp_path / "missing") == "unknown"


@pytest.mark.skipif(linear._native is None, reason="native GEMM not built")
def test_panels_on_huge_pages_give_the_same_products(monkeypatch, fresh_chunk):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(1000, 576, generator=gen)
    x = torch.randn(5, 576, generator=gen)
    dtypes = [torch.float32] + ([torch.bfloat16] if linear.native_bf16() else [])
    for dtype in dtypes:
        huge = linear.native_pack(w.to(dtype))
        monkeypatch.setattr(hugepages, "enabled", lambda env=None: False)
        small = linear.native_pack(w.to(dtype))
        monkeypatch.undo()
        assert torch.equal(huge, small)
        assert torch.equal(linear.native_linear(x.to(dtype), huge, 1000, None),
                           linear.native_linear(x.to(dtype), small, 1000, None))
