"""Block-wise FP8 (e4m3) weights: quantize, dequantize, and the matmuls that read them (README, "FP8 weights")."""

from deltaserve.kernels.quant.experts import fp8_fused_experts
from deltaserve.kernels.quant.fp8 import FP8, FP8_MAX, dequantize_fp8, fp8_linear, quantize_fp8, scale_shape

__all__ = ["FP8", "FP8_MAX", "dequantize_fp8", "fp8_fused_experts", "fp8_linear", "quantize_fp8", "scale_shape"]
