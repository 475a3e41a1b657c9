"""A dense projection for one token on the GPU: y = x W^T in one GEMV kernel, autotuned per weight shape.

At batch 1 cuBLAS splits some projections over two kernels (a split-K GEMM and its reduce) and streams others
below the card's bandwidth. Each program takes BLOCK_N output rows of a token (grid: row blocks x tokens, so
batch-1 decode) and sums over the input in BLOCK_K steps in float32, rounding once to x's dtype like cuBLAS. Used by
layers.linear.Linear for bf16/fp16 weights of at least GEMV_MIN_WEIGHT elements and at most GEMV_MAX_TOKENS
tokens; lm_head (and KDA's in_proj) stay on cuBLAS, which streams them faster. Twin: F.linear.

With groups, one launch serves several projections of their own inputs (KDA's two gate up-projections). Tiles are
autotuned per (N, K, rows per group) at first use; a CUDA graph's sizes are each run eagerly before capture.

FP8 weights (float8_e4m3fn with block scales) run the same kernel with SCALED: a tile whose rows lie in one scale
block folds its column blocks' scales into x; any other tile scales each weight. Used by kernels.quant.fp8_linear
for one token. Twin: kernels.quant.naive.naive_fp8_linear."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.kernels.autotune import tile_configs, with_tile
from deltaserve.kernels.pdl import pdl_args, pdl_enter

# one token only: a token's programs re-read the weights, so at a few tokens cuBLAS is faster
GEMV_MAX_TOKENS = 1
GEMV_MIN_WEIGHT = 1 << 22  # elements (8 MB in bf16): smaller projections stay on cuBLAS (launch-bound either way)
# (rows, columns) of a program's tile: fewer rows give more programs, more columns more bytes in flight per load
GEMV_TILES = ((4, 1024), (8, 256), (8, 512), (16, 256), (16, 512), (32, 128), (32, 256), (64, 128))
GEMV_NAMES = ("BLOCK_N", "BLOCK_K")  # a tile: (rows, columns)
_MAX_BLOCK_N = max(n for n, _ in GEMV_TILES)  # a group's rows are whole tiles
NO_SCALES = {"s_ptr": None, "SCALED": False, "S_COLS": 1, "BN": 1, "BK": 1}  # gemv_jit's arguments for unscaled weights


@triton.jit
def tile_dot(x, w, rows, cols, w_mask, pid_n, K: tl.constexpr, s_ptr, SCALED: tl.constexpr, S_COLS: tl.constexpr,
             BN: tl.constexpr, BK: tl.constexpr, BLOCK_N: tl.constexpr):
    """A tile's row sums of w * x (float32; w [BLOCK_N, BLOCK_K] at rows x cols, x [BLOCK_K]). SCALED: w's element
    [n, k] times s[n // BN, k // BK] (FP8 block scales, S_COLS to a row): folded into x where the tile's rows share
    one row of scale blocks, else one per weight. Serves gemv_jit and kernels.norm_gemv's kernel."""
    if SCALED:
        if BN % BLOCK_N == 0:  # the tile's rows share one row of scale blocks: fold its scales into x
            x = x * tl.load(s_ptr + (pid_n * BLOCK_N // BN) * S_COLS + cols // BK, mask=cols < K, other=0.0)
        else:
            w = w * tl.load(s_ptr + (rows[:, None] // BN) * S_COLS + cols[None, :] // BK, mask=w_mask, other=0.0)
    return tl.sum(w * x[None, :], axis=1)


@triton.jit
def gemv_jit(x_ptr, w_ptr, y_ptr, x_stride, y_stride, T_BUCKET, N: tl.constexpr, K: tl.constexpr,
             GROUP_N: tl.constexpr, s_ptr, SCALED: tl.constexpr, S_COLS: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """y[t, rows] = x[t] . w[rows] in float32, stored in y's dtype; x and w read in their own dtypes. T_BUCKET (the
    token count rounded up to a power of two) is for an autotuner's key only. The router's logits
    (kernels.moe.triton_routing) run this same kernel under tiles of their own. SCALED: w's element [n, k] is multiplied
    by s[n // BN, k // BK] (FP8 block scales, S_COLS to a row); without, s_ptr is None (NO_SCALES). PDL: kernels.pdl."""
    pdl_enter(PDL)
    pid_n, token = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    x_base = x_ptr + token * x_stride + (pid_n * BLOCK_N // GROUP_N) * K  # this block's group of rows reads its x
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_base + cols, mask=cols < K, other=0.0).to(tl.float32)
        w_mask = (rows[:, None] < N) & (cols[None, :] < K)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], mask=w_mask, other=0.0).to(tl.float32)
        acc += tile_dot(x, w, rows, cols, w_mask, pid_n, K, s_ptr, SCALED, S_COLS, BN, BK, BLOCK_N)
    tl.store(y_ptr + token * y_stride + rows, acc.to(y_ptr.dtype.element_ty), mask=rows < N)


_gemv_kernel = triton.autotune(configs=tile_configs(GEMV_NAMES, GEMV_TILES, (16, 256), warps=(4, 8)),
                               key=["N", "K", "GROUP_N"])(gemv_jit)
# FP8 weights are half the bytes a row: the bf16 tiles, and three with twice their columns (a load of as many bytes)
FP8_GEMV_TILES = GEMV_TILES + ((8, 1024), (16, 1024), (32, 512))
_fp8_gemv_kernel = triton.autotune(configs=tile_configs(GEMV_NAMES, FP8_GEMV_TILES, (16, 512), warps=(4, 8)),
                                   key=["N", "K", "BN", "BK"])(gemv_jit)


def gemv(x: torch.Tensor, weight: torch.Tensor, tile: tuple[int, int] | None = None, groups: int = 1,
         pdl: bool = True) -> torch.Tensor:
    """x [T, K], weight [N, K] (contiguous, x's dtype) -> x @ weight^T [T, N] in x's dtype, summed in float32.
    x's rows may be strided (a split's view); its columns must be contiguous. tile: (BLOCK_N, BLOCK_K) instead of
    the autotuned choice (tests check every candidate's values; benchmarks time them).
    groups: several projections of their own inputs in one launch: x [T, groups * K] and weight's rows in groups of
    N / groups, group g's output columns computed from x[:, g*K:(g+1)*K] (KDA's two gate up-projections)."""
    T, N = x.shape[0], weight.shape[0]
    K = weight.shape[1]
    group_n = N // groups
    assert x.shape[1] == groups * K and N % groups == 0 and (groups == 1 or groups_fit(group_n))
    assert weight.dtype == x.dtype and weight.is_contiguous() and x.stride(1) == 1
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T:
        kernel, chosen = with_tile(_gemv_kernel, GEMV_NAMES, tile)
        kernel[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), T)](x, weight, y, x.stride(0), y.stride(0),
                                                                  triton.next_power_of_2(T), N=N, K=K, GROUP_N=group_n,
                                                                  **NO_SCALES, **pdl_args(x.device, pdl), **chosen)
    return y


def fp8_gemv(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
             tile: tuple[int, int] | None = None, pdl: bool = True) -> torch.Tensor:
    """x [T, K] (float32, bfloat16 or float16; columns contiguous), q [N, K] float8_e4m3fn, scale_inv [ceil(N/bn),
    ceil(K/bk)] -> x W^T [T, N] in x's dtype, W the dequantized weight, summed in float32 (kernels.quant's
    fp8_linear contract). One token's programs read the weights once: for one token."""
    T, K = x.shape
    N = q.shape[0]
    assert q.shape[1] == K and q.is_contiguous() and x.stride(1) == 1
    assert scale_inv.shape == (triton.cdiv(N, block[0]), triton.cdiv(K, block[1])) and scale_inv.is_contiguous(), \
        f"scales {tuple(scale_inv.shape)} do not fit a [{N}, {K}] weight in blocks of {block}"
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T:
        kernel, chosen = with_tile(_fp8_gemv_kernel, GEMV_NAMES, tile)
        kernel[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), T)](
            x, q, y, x.stride(0), y.stride(0), triton.next_power_of_2(T), N=N, K=K, GROUP_N=N, s_ptr=scale_inv,
            SCALED=True, S_COLS=scale_inv.shape[1], BN=block[0], BK=block[1], **pdl_args(x.device, pdl), **chosen)
    return y


def groups_fit(rows_per_group: int) -> bool:
    """Whether gemv(groups=...) takes groups of this many rows: whole tiles of every candidate tile shape."""
    return rows_per_group % _MAX_BLOCK_N == 0


def use_gemv(x: torch.Tensor, weight: torch.Tensor, min_weight: int = GEMV_MIN_WEIGHT) -> bool:
    """Whether gemv() serves y = x W^T here: a GPU, half-precision weights of x's dtype and at least min_weight
    elements, at most GEMV_MAX_TOKENS tokens, contiguous columns."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and weight.numel() >= min_weight and x.numel() <= GEMV_MAX_TOKENS * x.shape[-1]
            and x.stride(-1) == 1 and weight.is_contiguous())
