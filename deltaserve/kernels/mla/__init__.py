from deltaserve.kernels.mla.attention import (
    gather_latents,
    merge_blocks,
    mla_decode,
    mla_prefill,
    mla_prefill_block,
    mla_prefill_fused,
    torch_mla_decode,
)
from deltaserve.kernels.mla.keys import expand_keys

__all__ = ["expand_keys", "gather_latents", "merge_blocks", "mla_decode", "mla_prefill", "mla_prefill_block",
           "mla_prefill_fused", "torch_mla_decode"]
