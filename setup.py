"""Build script for the optional native modules: the suffix trie (rhyme_sglang.core._rhyme_native),
the paged CPU attention (rhyme_sglang.cpu_backend._rhyme_attention), the few-row CPU products
(rhyme_sglang.cpu_backend._rhyme_gemm), the CPU norms, rotary and SiLU (..._rhyme_ops) and the
decoder step that calls them all from one loop (..._rhyme_step).

Metadata lives in pyproject.toml. The extension is optional: if it cannot be compiled the package
still installs: `rhyme_sglang.core.native` falls back to the pure-Python trie with a warning, and the
CPU attention to its batched PyTorch ops, the CPU linears to oneDNN / ``F.linear``, the norms
and rotary to sglang's own PyTorch ops.
"""

import glob
import os

from setuptools import setup

try:
    from pybind11.setup_helpers import Pybind11Extension
except ImportError:  # pybind11 missing outside an isolated build: ship pure Python only
    ext_modules = []
else:
    def _native(name: str, source: str, contract: str = "off") -> Pybind11Extension:
        # no fast-math. FMA contraction off for the attention kernel (it writes its fused
        # multiply-adds out, the same in every ISA build; its bit-identity across builds relies
        # on nothing else being fused); on for the GEMM, whose AVX2 and AVX-512 builds both fuse
        # (depends: a changed shared header rebuilds the module that includes it)
        return Pybind11Extension(name, [source], cxx_std=17, optional=True,
                                 depends=sorted(glob.glob(os.path.join(os.path.dirname(source), "*.h"))),
                                 extra_compile_args=["-O3", f"-ffp-contract={contract}"])

    ext_modules = [
        _native("rhyme_sglang.core._rhyme_native", "rhyme_sglang/core/_native/suffix_trie.cpp"),
        _native("rhyme_sglang.cpu_backend._rhyme_attention",
                "rhyme_sglang/cpu_backend/_native/paged_attention.cpp"),
        _native("rhyme_sglang.cpu_backend._rhyme_gemm",
                "rhyme_sglang/cpu_backend/_native/skinny_gemm.cpp", contract="fast"),
        _native("rhyme_sglang.cpu_backend._rhyme_ops",
                "rhyme_sglang/cpu_backend/_native/small_ops.cpp"),
        _native("rhyme_sglang.cpu_backend._rhyme_step",
                "rhyme_sglang/cpu_backend/_native/decoder_step.cpp"),
    ]

setup(ext_modules=ext_modules)
