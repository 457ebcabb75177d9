"""``sgl_kernel.mamba`` stand-in: linear-attention kernels are not implemented on CPU."""

from rhyme_sglang.cpu_backend.unimplemented import not_implemented

causal_conv1d_fn_cpu = not_implemented("mamba.causal_conv1d_fn_cpu")
causal_conv1d_update_cpu = not_implemented("mamba.causal_conv1d_update_cpu")
chunk_gated_delta_rule_cpu = not_implemented("mamba.chunk_gated_delta_rule_cpu")
