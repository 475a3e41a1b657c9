"""Shared helpers of the kernel tests: the relative error, FP8 test weights, a routed-experts case with its naive
expected output, and the guard of the test modules that run Triton kernels through the CPU interpreter."""

from __future__ import annotations

import os

import pytest
import torch

from deltaserve.kernels.moe.naive import naive_experts
from deltaserve.kernels.quant import dequantize_fp8, quantize_fp8


def require_triton_interpreter() -> None:
    """Skip the calling test module unless Triton kernels run through the interpreter here (no GPU; on a GPU,
    tests/gpu runs the same kernels compiled). Call at module level, before importing triton."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: tests/gpu runs these kernels compiled", allow_module_level=True)
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET=1 must be set before triton is imported (tests/conftest.py does)",
                    allow_module_level=True)
    pytest.importorskip("triton")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float32, on the CPU."""
    a, b = a.float().cpu(), b.float().cpu()
    return ((a - b).norm() / b.norm()).item()


def quantized(shape, block: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random weights of `shape` with a spread of column scales, quantized to FP8 in `block`s: (q, scale_inv)."""
    gen = torch.Generator().manual_seed(seed)
    return quantize_fp8(torch.randn(shape, generator=gen) * torch.rand(shape[-1], generator=gen) * 3, block)


def fp8_expert_case(T: int, E: int, k: int, D: int, I: int, block: tuple[int, int], seeds: tuple[int, int, int],
                    experts: list[int] | None = None) -> tuple[torch.Tensor, ...]:
    """A routed-experts problem on the CPU: (x [T, D], w13, s13, w2, s2, weights [T, k], ids [T, k], expected [T, D]),
    FP8 weights and their scales, each token routed to k distinct experts among `experts` (default: all), expected
    from naive_experts on the dequantized weights. seeds: of the inputs, of w13, of w2."""
    gen = torch.Generator().manual_seed(seeds[0])
    w13, s13 = quantized((E, 2 * I, D), block, seeds[1])
    w2, s2 = quantized((E, D, I), block, seeds[2])
    x = torch.randn(T, D, generator=gen) * 0.1
    pool = torch.tensor(experts) if experts else torch.arange(E)
    ids = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:k]] for _ in range(T)])
    weights = torch.rand(T, k, generator=gen)
    expected = naive_experts(x, dequantize_fp8(w13, s13, block), dequantize_fp8(w2, s2, block), weights, ids)
    return x, w13, s13, w2, s2, weights, ids, expected
