"""Build script for the optional native modules: the suffix trie (rhyme_sglang.core._rhyme_native)
and the paged CPU attention (rhyme_sglang.cpu_backend._rhyme_attention).

Metadata lives in pyproject.toml. The extension is optional: if it cannot be compiled the package
still installs: `rhyme_sglang.core.native` falls back to the pure-Python trie with a warning, and the
CPU attention to its batched PyTorch ops.
"""

from setuptools import setup

try:
    from pybind11.setup_helpers import Pybind11Extension
except ImportError:  # pybind11 missing outside an isolated build: ship pure Python only
    ext_modules = []
else:
    def _native(name: str, source: str) -> Pybind11Extension:
        # no fast-math, no FMA contraction: the attention kernel's bit-identity relies on it
        return Pybind11Extension(name, [source], cxx_std=17, optional=True,
                                 extra_compile_args=["-O3", "-ffp-contract=off"])

    ext_modules = [
        _native("rhyme_sglang.core._rhyme_native", "rhyme_sglang/core/_native/suffix_trie.cpp"),
        _native("rhyme_sglang.cpu_backend._rhyme_attention",
                "rhyme_sglang/cpu_backend/_native/paged_attention.cpp"),
    ]

setup(ext_modules=ext_modules)
