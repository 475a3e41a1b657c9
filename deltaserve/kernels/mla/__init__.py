from deltaserve.kernels.mla.attention import gather_latents, mla_decode, mla_prefill

__all__ = ["gather_latents", "mla_decode", "mla_prefill"]
