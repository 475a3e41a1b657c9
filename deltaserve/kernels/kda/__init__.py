from deltaserve.kernels.kda.chunk import chunk_kda
from deltaserve.kernels.kda.fused_recurrent import fused_recurrent_kda

__all__ = ["chunk_kda", "fused_recurrent_kda"]
