"""``sgl_kernel.speculative`` stand-in."""

from rhyme_sglang.cpu_backend.tree_ops import reconstruct_indices_from_tree_mask  # noqa: F401
