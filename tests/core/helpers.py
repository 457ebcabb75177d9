"""Shared strategies and small helpers for the core tests."""

from hypothesis import strategies as st

from rhyme_sglang.core.native import native_available

BACKENDS = ["python"] + (["native"] if native_available() else [])
tokens = st.lists(st.integers(0, 5), min_size=0, max_size=24)
contexts = st.lists(st.integers(0, 5), min_size=0, max_size=10)


def occurs_after(history, context, path):
    """True when `path` follows some suffix (>= 1 token) of `context` inside a history sequence."""
    for seq in history:
        for m in range(1, len(context) + 1):
            pat = list(context[-m:]) + list(path)
            if any(seq[i:i + len(pat)] == pat for i in range(len(seq) - len(pat) + 1)):
                return True
    return False
