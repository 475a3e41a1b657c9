"""Shared helpers of the kernel tests: the relative error, FP8 test weights, a routed-experts case with its naive
expected output, a paged latent cache of ragged sequences, and the guard of the test modules that run Triton
kernels through the CPU interpreter."""

from __future__ import annotations

import os

import pytest
import torch

from deltaserve.kernels.cache_ops import write_latents
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


class PagedLatents:
    """A paged MLA cache [num_pages, page_size, latent_dim] holding random latents of sequences of `lengths`, their
    pages in a random order. Pages no sequence owns (page 0 among them, which pads the block tables, as the runner
    pads) hold huge finite garbage, so a read past a sequence's context shows in the output. A float8 dtype stores
    the latents as a float8 latent cache does (write_latents)."""

    def __init__(self, lengths: list[int], latent_dim: int, page_size: int, num_pages: int, gen: torch.Generator,
                 dtype: torch.dtype = torch.float32, device: str = "cpu"):
        garbage = 1e30 if dtype.itemsize > 1 else torch.finfo(dtype).max  # float8: its largest
        self.cache = torch.full((num_pages, page_size, latent_dim), garbage, dtype=dtype)
        free = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()  # page 0 stays garbage
        self.latents, self.tables = [], []
        for n in lengths:
            pages = [free.pop() for _ in range(-(-n // page_size))]
            latents = torch.randn(n, latent_dim, generator=gen).to(dtype)
            slots = torch.tensor([pages[p // page_size] * page_size + p % page_size for p in range(n)])
            write_latents(self.cache, slots, latents)
            self.latents.append(latents)
            self.tables.append(pages)
        self.cache = self.cache.to(device)

    def block_tables(self, width: int | None = None) -> torch.Tensor:
        """[B, width] int64 (default: the longest table), padded with page 0."""
        width = width or max(len(t) for t in self.tables)
        return torch.tensor([t + [0] * (width - len(t)) for t in self.tables], device=self.cache.device)


def norm_gemv_inputs(T: int, D: int, N: int, weight_dtype: torch.dtype, seed: int, device: str = "cpu",
                     gated_heads: int = 0) -> dict:
    """Random inputs of kernels.norm_gemv at ragged shapes, bf16 activations as strided views (a split leaves them
    so). Not gated: x, residual [T, D]; gated (gated_heads H, D the head dim): o [T, H, D], gate [T, H * D]."""
    gen = torch.Generator().manual_seed(seed)
    width = gated_heads * D if gated_heads else D
    case = {"norm_weight": (torch.rand(D, generator=gen) + 0.5).bfloat16(), "eps": 1e-6,
            "weight": (torch.randn(N, width, generator=gen) * 0.05).to(weight_dtype)}
    if gated_heads:
        case["o"] = torch.randn(T, gated_heads, D, generator=gen).bfloat16()
        case["gate"] = torch.randn(T, 3 * width, generator=gen).bfloat16()[:, width: 2 * width]
    else:
        case["x"] = (torch.randn(T, 2 * D, generator=gen) * 4).bfloat16()[:, :D]
        case["residual"] = (torch.randn(T, D, generator=gen) * 4).bfloat16()
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}


def within_ulps(a: torch.Tensor, b: torch.Tensor, ulps: int = 1) -> bool:
    """Whether two bf16 tensors differ by at most `ulps` units in the last place (bf16's 8 significant bits)."""
    a, b = a.float().cpu(), b.float().cpu()
    ulp = torch.maximum(a.abs(), b.abs()).clamp_min(1e-30) * 2.0 ** -7
    return bool(((a - b).abs() <= ulps * ulp).all())


def norm_inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int, device: str = "cpu") -> dict:
    """The norms' operands, as the layers hand them over: x a column slice of a wider tensor (MLA's latent norm reads
    ckv[:, :R]), a residual and a gate likewise strided, a weight in x's dtype, and a float32 weight that x's dtype
    could not hold exactly (a kernel that rounded it would show)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    D = shape[-1]

    def wide(scale=1.0):
        return (torch.randn(*shape[:-1], 2 * D, generator=gen, device=device) * scale).to(dtype)

    weight32 = 1 + torch.randn(D, generator=gen, device=device) / 4
    return {"x": wide(3)[..., :D], "residual": wide()[..., D:], "gate": wide()[..., :D], "weight": weight32.to(dtype),
            "weight32": weight32, "eps": 1e-6}


def mostly_equal(a: torch.Tensor, b: torch.Tensor, ulps: int = 2) -> bool:
    """Two half-precision results of one computation in another order: at most 1 in 1,000 elements (2 at least)
    rounded the other way, none by more than `ulps` (bf16's 8 significant bits). A missing or extra rounding of an
    intermediate changes far more of them."""
    differing = int((a != b).sum())
    return differing <= max(2, a.numel() // 1000) and within_ulps(a, b, ulps)
