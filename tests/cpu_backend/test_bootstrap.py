"""The CPU backend hook: cheap at start-up, never shadows a real sgl_kernel, fails loudly."""

from __future__ import annotations

import pytest

from tests.cpu_backend.helpers import run_python


def test_hook_imports_nothing_heavy():
    r = run_python("""
        import sys
        import rhyme_sglang.cpu_backend.bootstrap as b
        b.install()
        heavy = [m for m in ("torch", "sglang", "numpy", "ray") if m in sys.modules]
        assert not heavy, heavy
        print("ok")
    """)
    assert r.returncode == 0, r.stderr
    assert "ok" in r.stdout


def test_standin_resolves_when_no_real_sgl_kernel():
    r = run_python("""
        import rhyme_sglang.cpu_backend.bootstrap as b
        b.install()
        import sgl_kernel, torch
        assert sgl_kernel.__rhyme_cpu_standin__
        assert hasattr(torch.ops.sgl_kernel, "extend_attention_cpu")
        assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed")
        from sgl_kernel.speculative import reconstruct_indices_from_tree_mask
        try:
            from sgl_kernel.scalar_type import scalar_types
        except ImportError:
            print("scalar_type absent")
        try:
            from sgl_kernel import no_such_op
        except ImportError:
            print("unknown absent")
        try:
            sgl_kernel.rotate_input_ids_cpu()
        except NotImplementedError as e:
            assert "rotate_input_ids_cpu" in str(e)
            print("named")
    """)
    assert r.returncode == 0, r.stderr
    assert "scalar_type absent" in r.stdout and "unknown absent" in r.stdout and "named" in r.stdout


def test_real_sgl_kernel_wins(tmp_path):
    fake = tmp_path / "sgl_kernel"
    fake.mkdir()
    (fake / "__init__.py").write_text("REAL = True\n")
    r = run_python("""
        import rhyme_sglang.cpu_backend.bootstrap as b
        b.install()
        assert not b.standin_active()
        import sgl_kernel
        assert sgl_kernel.REAL and not hasattr(sgl_kernel, "__rhyme_cpu_standin__")
        print("ok")
    """, env_extra={"PYTHONPATH": str(tmp_path)})
    assert r.returncode == 0, r.stderr


def test_disable_switch():
    r = run_python("""
        import sys
        sys.meta_path[:] = [f for f in sys.meta_path if type(f).__module__ != "rhyme_sglang.cpu_backend.bootstrap"]
        import rhyme_sglang.cpu_backend.bootstrap as b
        b.install()
        assert not any(isinstance(f, b.StandinFinder) for f in sys.meta_path)
        print("ok")
    """, env_extra={"RHYME_CPU_BACKEND": "0"})
    assert r.returncode == 0, r.stderr


def test_every_patch_has_its_module_hooked():
    from rhyme_sglang.cpu_backend import bootstrap, patches

    assert set(bootstrap._PATCHED_MODULES) == set(patches._BY_MODULE)


@pytest.mark.sglang
def test_patches_apply_in_a_fresh_process():
    r = run_python("""
        import os
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
        from rhyme_sglang import cpu_backend
        cpu_backend.activate()
        from sglang.srt.speculative import eagle_utils
        from sglang.srt.arg_groups import overrides
        from sglang.srt.layers.quantization import unquant
        from sglang.srt.layers import logits_processor, sampler
        from sglang.srt.model_executor.model_runner_components import weight_updater
        from sglang.srt.layers import layernorm
        from sglang.srt.layers.rotary_embedding import base
        from sglang.srt.layers import activation
        from sglang.srt.models import llama
        from rhyme_sglang.cpu_backend import linear, patches
        assert patches.APPLIED == {"keep_intel_amx_attention", "lossless_sampling_verify",
                                   "fast_cpu_sampling", "seeded_cpu_sampling",
                                   "packed_cpu_linear", "packed_cpu_lm_head",
                                   "repack_after_weight_updates", "native_cpu_rmsnorm",
                                   "native_cpu_rotary", "native_cpu_silu_mul",
                                   "lean_cpu_forward"}, patches.APPLIED
        # every weight-update entry point marks the packs stale, even when it fails
        for name in patches._UPDATE_METHODS:
            before = linear.generation()
            try:
                getattr(weight_updater.WeightUpdater, name)(None)
            except Exception:
                pass
            assert linear.generation() == before + 1, name
        assert eagle_utils.tree_speculative_sampling_target_only is not None
        import torch
        probs = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]])
        assert sampler.sampling_from_probs_torch(probs).tolist() == [1, 2]
        assert sampler.sampling_from_probs_torch(probs).dtype == torch.int32
        # seeded rows draw with their seeds, the filtered draw too
        from rhyme_sglang.cpu_backend.seeded import seeded_sample_rows
        flat = torch.softmax(torch.randn(3, 40), -1)
        seeds, positions = torch.tensor([1, 2, 1]), torch.tensor([5, 5, 6])
        want = seeded_sample_rows(flat, seeds, positions).view(-1).tolist()
        assert sampler.sampling_from_probs_torch(flat, seeds, positions).tolist() == want
        got = sampler.top_k_top_p_min_p_sampling_from_probs_torch(
            flat, torch.tensor([40] * 3), torch.tensor([1.0] * 3), torch.zeros(3), False, seeds,
            positions)
        assert got.tolist() == want
        assert not eagle_utils._verify_uses_greedy(is_all_greedy=False, is_cpu=True, is_hip=False,
                                                   is_xpu=False, use_rejection_sampling=False)
        print("ok")
    """)
    assert r.returncode == 0, r.stderr[-3000:]
