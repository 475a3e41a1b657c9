from deltaserve.kernels.mla.attention import gather_latents, mla_decode, mla_prefill, torch_mla_decode

__all__ = ["gather_latents", "mla_decode", "mla_prefill", "torch_mla_decode"]
