"""rhyme-sglang: an SGLang rollout engine for RL with history-drafted lossless speculation.

Importing this package is cheap (no torch/sglang); ``rhyme_sglang.Engine`` loads sglang
lazily on first access.
"""

__version__ = "0.1.0"
__all__ = ["Engine", "__version__"]


def __getattr__(name):
    if name == "Engine":
        from rhyme_sglang.sglang_ext.engine import Engine

        return Engine
    raise AttributeError(f"module 'rhyme_sglang' has no attribute {name!r}")
