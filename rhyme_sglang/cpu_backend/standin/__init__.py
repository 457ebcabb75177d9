"""Pure-PyTorch stand-in for the ``sgl_kernel`` ops that sglang's CPU path imports.

Loaded under the name ``sgl_kernel`` by :mod:`rhyme_sglang.cpu_backend.bootstrap`, only
when no real ``sgl_kernel`` is installed. Names that sglang imports on CPU but that this
project does not implement raise ``NotImplementedError`` naming the op when called.
Unknown names raise ``AttributeError`` (so ``from sgl_kernel import x`` fails loudly).
``torch.ops.sgl_kernel.convert_weight_packed`` is deliberately absent: its presence would
switch sglang to AMX GEMM paths.
"""

from rhyme_sglang.cpu_backend.attention import register_torch_ops as _register
from rhyme_sglang.cpu_backend.cache_ops import (  # noqa: F401
    assign_draft_cache_locs_contiguous_cpu,
    assign_extend_cache_locs_cpu,
    assign_req_to_token_pool_cpu,
    copy_all_layer_kv_cache_cpu,
    fill_accept_out_cache_loc_cpu,
    fill_bonus_tokens_cpu,
)
from rhyme_sglang.cpu_backend.sampling import (  # noqa: F401
    tree_speculative_sampling_target_only,
)
from rhyme_sglang.cpu_backend.tree_ops import verify_tree_greedy_cpu  # noqa: F401
from rhyme_sglang.cpu_backend.unimplemented import not_implemented as _not_implemented

__rhyme_cpu_standin__ = True
__version__ = "0.0.0+rhyme.cpu.standin"

_register()

build_tree_kernel_efficient_cpu = _not_implemented("build_tree_kernel_efficient_cpu")
build_draft_decode_metadata_cpu = _not_implemented("build_draft_decode_metadata_cpu")
rotate_input_ids_cpu = _not_implemented("rotate_input_ids_cpu")
moe_sum_reduce = _not_implemented("moe_sum_reduce")
# imported by sglang's sampler and verify; on CPU the sampler's torch path filters instead, and
# the verify's rows are filtered as plain decoding filters them (sampling.verify_renorm)
top_k_renorm_prob = _not_implemented("top_k_renorm_prob")
top_p_renorm_prob = _not_implemented("top_p_renorm_prob")
