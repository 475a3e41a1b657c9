"""A norm and the projection that reads it, in one GEMV kernel: a batch-1 decode step saves the norm's launch.

A norm's output feeds one projection, read whole by each of the projection's programs: each program can as well
normalise its input itself (a few KB from L2) and sum its rows against it. Two norms, with the reference's order of
operations and roundings (kernels.norm's eager functions):

- add_norm_gemv: (x + residual) rounded to x's dtype is the new residual stream s; h = weight * (s * rsqrt(mean(s^2)
  + eps)) rounded like add_rms_norm; y = h W^T. The first row block's program of each token stores s (and h, for
  the MoE's experts, which read the h their router was given). Serves the attention's in_proj after the input norm
  (one token) and the router's logits after the post-attention norm (float32 weights: y in float32, up to 16 tokens).
- gated_norm_gemv: KDA's output o [T, H, K] normalised per head, scaled by the norm weight and sigmoid(gate),
  rounded to o's dtype, then o_proj. A program's column tile holds whole heads.

FP8 weights (block scales) take the scales as kernels.gemv's FP8 GEMV does. Twins: kernels.norm's add_rms_norm /
gated_rms_norm followed by F.linear (FP8: kernels.quant.naive.naive_fp8_linear). Used where
KernelOptions.norm_gemv allows (the CLI's --no-norm-gemv keeps the norms and projections apart)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from deltaserve.kernels.autotune import tile_configs, with_tile
from deltaserve.kernels.gemv import FP8_GEMV_TILES, GEMV_NAMES, GEMV_TILES, NO_SCALES, tile_dot
from deltaserve.kernels.moe.triton_routing import _ROUTER_TILES, ROUTER_GEMV_MAX_TOKENS
from deltaserve.kernels.pdl import pdl_args, pdl_enter

NORM_GEMV_MAX_TOKENS = 1  # bf16 weights: a token's programs re-read them (kernels.gemv's GEMV_MAX_TOKENS)
ROUTER_NORM_MAX_TOKENS = ROUTER_GEMV_MAX_TOKENS  # the router's 2.4 MB of float32 weights: re-read from L2
FP8 = torch.float8_e4m3fn  # kernels.quant's weight dtype
MAX_HEAD = 128  # gated: a tile's columns (every BLOCK_K candidate is a multiple of 128) hold whole heads


@triton.jit
def _stream(x_row, r_row, cols, K: tl.constexpr):
    """(x + residual) over cols, rounded to x's dtype (the residual add of the reference), as float32."""
    x = tl.load(x_row + cols, mask=cols < K, other=0.0)
    r = tl.load(r_row + cols, mask=cols < K, other=0.0)
    return (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype).to(tl.float32)


@triton.jit
def _norm_gemv_jit(x_ptr, r_ptr, nw_ptr, w_ptr, y_ptr, h_ptr, stream_ptr, x_stride, r_stride, y_stride, eps, T_BUCKET,
                   N: tl.constexpr, K: tl.constexpr, GATED: tl.constexpr, HEAD: tl.constexpr, STORE_H: tl.constexpr,
                   s_ptr, SCALED: tl.constexpr, S_COLS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """y[t, rows] = norm(x[t]) . w[rows] in float32, stored in y's dtype. Not GATED: the norm of x + r (r the
    residual), the stream x + r stored [T, K] and, with STORE_H, the normalised h, by the first row block's programs.
    GATED: x is KDA's output [T, K = heads * HEAD], r its gate, each head normalised apart. T_BUCKET: the autotuner's
    key. SCALED: FP8 weights, w[n, k] times s[n // BN, k // BK] (kernels.gemv.tile_dot)."""
    pdl_enter(PDL)
    pid_n, token = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    x_row, r_row = x_ptr + token * x_stride, r_ptr + token * r_stride
    dtype = x_ptr.dtype.element_ty
    rstd = 0.0
    if not GATED:  # the whole row's mean square first: a program sums its rows over the normalised row
        squares = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            s = _stream(x_row, r_row, k0 + tl.arange(0, BLOCK_K), K)
            squares += s * s
        rstd = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        if GATED:
            o = tl.reshape(tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32), (BLOCK_K // HEAD, HEAD))
            head_rstd = tl.rsqrt(tl.sum(o * o, axis=1) / HEAD + eps)
            normed = tl.reshape(o * head_rstd[:, None], (BLOCK_K,))
            gate = tl.load(r_row + cols, mask=cols < K, other=0.0).to(tl.float32)
            h = (tl.load(nw_ptr + cols % HEAD).to(tl.float32) * normed * tl.sigmoid(gate)).to(dtype).to(tl.float32)
        else:
            s = _stream(x_row, r_row, cols, K)
            normed = (s * rstd).to(dtype).to(tl.float32)
            h = (tl.load(nw_ptr + cols, mask=cols < K, other=0.0).to(tl.float32) * normed).to(dtype).to(tl.float32)
            if pid_n == 0:
                tl.store(stream_ptr + token * K + cols, s.to(dtype), mask=cols < K)
                if STORE_H:
                    tl.store(h_ptr + token * K + cols, h.to(dtype), mask=cols < K)
        w_mask = (rows[:, None] < N) & (cols[None, :] < K)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], mask=w_mask, other=0.0).to(tl.float32)
        acc += tile_dot(h, w, rows, cols, w_mask, pid_n, K, s_ptr, SCALED, S_COLS, BN, BK, BLOCK_N)
    tl.store(y_ptr + token * y_stride + rows, acc.to(y_ptr.dtype.element_ty), mask=rows < N)


_KEY = ["N", "K", "GATED", "STORE_H", "T_BUCKET"]
_half_kernel = triton.autotune(configs=tile_configs(GEMV_NAMES, GEMV_TILES, (16, 256), warps=(4, 8)),
                               key=_KEY)(_norm_gemv_jit)
_fp8_kernel = triton.autotune(configs=tile_configs(GEMV_NAMES, FP8_GEMV_TILES, (16, 512), warps=(4, 8)),
                              key=_KEY + ["BN", "BK"])(_norm_gemv_jit)
# float32 weights (the router): the router logits' own tiles
_router_kernel = triton.autotune(configs=tile_configs(GEMV_NAMES, _ROUTER_TILES, (2, 512), warps=(2, 4)),
                                 key=_KEY)(_norm_gemv_jit)


def add_norm_gemv(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, store_normed: bool = False, tile: tuple[int, int] | None = None,
                  scale_inv: torch.Tensor | None = None, block: tuple[int, int] | None = None, pdl: bool = True,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x, residual [T, D] (half precision, columns contiguous), norm_weight [D] in x's dtype, weight [N, D] (x's dtype,
    float32 for the router, or float8_e4m3fn with scale_inv and block as kernels.quant.fp8_linear takes them) ->
    (y [T, N], s = x + residual [T, D], h [T, D] or None): y = add_rms_norm(x, residual)[0] @ weight^T, summed in
    float32, in float32 for float32 weights, else in x's dtype; h the normalised input when store_normed.
    tile: (BLOCK_N, BLOCK_K) instead of the autotuned choice."""
    T, D = x.shape
    N = weight.shape[0]
    assert residual.shape == x.shape and weight.shape[1] == D and norm_weight.shape == (D,)
    assert residual.dtype == norm_weight.dtype == x.dtype, "x, residual and the norm weight share one dtype"
    assert x.stride(1) == 1 and residual.stride(1) == 1 and weight.is_contiguous() and norm_weight.is_contiguous()
    kernel, scales = _kernel_for(weight, x.dtype, scale_inv, block)
    y = torch.empty(T, N, dtype=torch.float32 if weight.dtype == torch.float32 else x.dtype, device=x.device)
    s = torch.empty(T, D, dtype=x.dtype, device=x.device)
    h = torch.empty(T, D, dtype=x.dtype, device=x.device) if store_normed else None
    if T:
        kernel, chosen = with_tile(kernel, GEMV_NAMES, tile)
        kernel[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), T)](
            x, residual, norm_weight, weight, y, h, s, x.stride(0), residual.stride(0), y.stride(0), float(eps),
            triton.next_power_of_2(T), N=N, K=D, GATED=False, HEAD=1, STORE_H=store_normed, **scales,
            **pdl_args(x.device, pdl), **chosen)
    return y, s, h


def gated_norm_gemv(o: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, tile: tuple[int, int] | None = None, scale_inv: torch.Tensor | None = None,
                    block: tuple[int, int] | None = None, pdl: bool = True) -> torch.Tensor:
    """o [T, H, Kh] (contiguous), gate [T, H * Kh] (columns contiguous), norm_weight [Kh], weight [N, H * Kh] (all in
    o's dtype, or an FP8 weight with scale_inv and block) -> gated_rms_norm(o, gate, norm_weight, eps) @ weight^T
    [T, N] in o's dtype, summed in float32."""
    T, H, head = o.shape
    N = weight.shape[0]
    assert o.is_contiguous() and gate.shape == (T, H * head) and gate.stride(1) == 1 and MAX_HEAD % head == 0
    assert gate.dtype == norm_weight.dtype == o.dtype, "o, gate and the norm weight share one dtype"
    assert weight.dtype in (o.dtype, FP8), f"weight {weight.dtype}: o's dtype {o.dtype} or FP8"
    assert weight.shape[1] == H * head and weight.is_contiguous() and norm_weight.shape == (head,)
    kernel, scales = _kernel_for(weight, o.dtype, scale_inv, block)
    y = torch.empty(T, N, dtype=o.dtype, device=o.device)
    if T:
        kernel, chosen = with_tile(kernel, GEMV_NAMES, tile)
        kernel[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), T)](
            o, gate, norm_weight.contiguous(), weight, y, None, None, H * head, gate.stride(0), y.stride(0),
            float(eps), triton.next_power_of_2(T), N=N, K=H * head, GATED=True, HEAD=head, STORE_H=False, **scales,
            **pdl_args(o.device, pdl), **chosen)
    return y


def _kernel_for(weight: torch.Tensor, dtype: torch.dtype, scale_inv: torch.Tensor | None,
                block: tuple[int, int] | None):
    """(autotuned kernel, its scale arguments) for a weight: FP8 (block scales given), float32 (the router's) or the
    activations' own dtype."""
    if weight.dtype != FP8:
        assert scale_inv is None, "block scales go with FP8 weights only"
        assert weight.dtype in (dtype, torch.float32), f"weight {weight.dtype}: the activations' {dtype} or float32"
        return (_router_kernel if weight.dtype == torch.float32 else _half_kernel), NO_SCALES
    N, K = weight.shape
    assert scale_inv is not None and block is not None, "FP8 weights need their block scales (scale_inv, block)"
    assert scale_inv.shape == (triton.cdiv(N, block[0]), triton.cdiv(K, block[1])) and scale_inv.is_contiguous(), \
        f"scales {tuple(scale_inv.shape)} do not fit a [{N}, {K}] weight in blocks of {block}"
    return _fp8_kernel, {"s_ptr": scale_inv.float(), "SCALED": True, "S_COLS": scale_inv.shape[1], "BN": block[0],
                         "BK": block[1]}


def fits(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, max_tokens: int,
         other: torch.Tensor) -> bool:
    """Whether the fused kernels serve this step: a GPU, at most max_tokens tokens of half-precision activations x
    and `other` (the residual, or the gate) of one dtype with contiguous columns (x contiguous: KDA's o is read as
    [T, H * K]), a norm weight of their dtype, a plain contiguous weight of their dtype, float32 (the router) or FP8
    (with its block scales)."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.shape[0] <= max_tokens
            and x.is_contiguous() and other.dtype == norm_weight.dtype == x.dtype and other.stride(-1) == 1
            and weight.dtype in (x.dtype, torch.float32, FP8) and weight.dim() == 2 and weight.is_contiguous())


def _naive_linear(h, weight, scale_inv, block):
    """F.linear, or for FP8 weights the dequantizing twin (float32, rounded to h's dtype like fp8_linear)."""
    if scale_inv is None:
        return F.linear(h.to(weight.dtype), weight)
    from deltaserve.kernels.quant.naive import naive_fp8_linear

    return naive_fp8_linear(h, weight, scale_inv, block).to(h.dtype)


def naive_add_norm_linear(x, residual, norm_weight, eps, weight, scale_inv=None, block=None):
    """Twin of add_norm_gemv: (y, s, h)."""
    from deltaserve.kernels.norm import add_rms_norm

    h, s = add_rms_norm.eager(x, residual, norm_weight, eps)
    return _naive_linear(h, weight, scale_inv, block), s, h


def naive_gated_norm_linear(o, gate, norm_weight, eps, weight, scale_inv=None, block=None):
    """Twin of gated_norm_gemv."""
    from deltaserve.kernels.norm import gated_rms_norm

    T = o.shape[0]
    return _naive_linear(gated_rms_norm.eager(o, gate.view(o.shape), norm_weight, eps).view(T, -1), weight, scale_inv,
                         block)
