"""Build script for the optional native suffix trie (rhyme_sglang.core._rhyme_native).

Metadata lives in pyproject.toml. The extension is optional: if it cannot be compiled the package
still installs and `rhyme_sglang.core.native` falls back to the pure-Python trie with a warning.
"""

from setuptools import setup

try:
    from pybind11.setup_helpers import Pybind11Extension
except ImportError:  # pybind11 missing outside an isolated build: ship pure Python only
    ext_modules = []
else:
    ext_modules = [
        Pybind11Extension(
            "rhyme_sglang.core._rhyme_native",
            ["rhyme_sglang/core/_native/suffix_trie.cpp"],
            cxx_std=17,
            extra_compile_args=["-O3", "-ffp-contract=off"],
            optional=True,
        )
    ]

setup(ext_modules=ext_modules)
