from deltaserve.kernels.mla.attention import (
    gather_latents,
    merge_blocks,
    mla_decode,
    mla_prefill,
    mla_prefill_block,
    mla_prefill_fused,
    torch_mla_decode,
)

__all__ = ["gather_latents", "merge_blocks", "mla_decode", "mla_prefill", "mla_prefill_block", "mla_prefill_fused",
           "torch_mla_decode"]
