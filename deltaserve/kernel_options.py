"""KernelOptions: which of our own kernels a model's layers call, chosen once and passed down (never read from the
environment or a module global below the CLI).

The engine makes it from EngineConfig (cpu_gemv, norm_gemv, pdl) and the run's CPU threads, and sets it on the
model's layers once their weights are loaded (models.kimi_linear.KimiLinearForCausalLM.set_kernel_options, which also
has each MoE layer choose its router's GEMM from its weights). A choice changes
which kernel takes a sum, so it may change the last bits of a result, never its meaning."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelOptions:
    # CPU float32 products of up to 4 rows through kernels.cpu_gemv (where it is built); off: F.linear
    cpu_gemv: bool = True
    cpu_threads: int = 1  # threads a large cpu_gemv product splits over (the run's CPU threads)
    # GPU, bf16/FP8: the norms inside the GEMVs that read them (kernels.norm_gemv); off: norm and projection apart
    norm_gemv: bool = True
    # GPU, Hopper and later: programmatic dependent launch of our decode-step kernels (kernels.pdl); timing only
    pdl: bool = True
