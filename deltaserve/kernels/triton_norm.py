"""The RMSNorms of kernels.norm on a GPU, one Triton launch a call, with their eager twins' order of operations and
roundings: rms_norm (normalised in float32, rounded to x's dtype, then scaled by the weight), add_rms_norm (the
residual add rounded to x's dtype first; the sum is returned too) and gated_rms_norm (per head, everything in
float32 times sigmoid(gate), one rounding at the end). A program normalises whole rows (a token, or a token's head
for the gated norm; several narrow rows at once), each read once. Last bits may differ from the twins': the mean
square is summed in another order and divided by D (torch multiplies by 1/D), and rsqrt and sigmoid are the GPU's
approximate ones; the tests allow a few elements in a thousand to round the other way. These stand where
torch.compile fused the same chains: a process that runs them imports neither Dynamo nor Inductor, and loads no
compiled graphs at start-up."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n_rows"])  # the rows only mask: one variant a BLOCK_ROWS, whatever the step's tokens
def _rms_norm_kernel(x_ptr, r_ptr, g_ptr, w_ptr, out_ptr, sum_ptr, n_rows, x_stride, r_stride, g_stride, eps,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_ROWS: tl.constexpr, ADD: tl.constexpr,
                     GATED: tl.constexpr):
    """BLOCK_ROWS rows of x [n_rows, D] (row stride x_stride) -> out [n_rows, D] contiguous. ADD: x + r first,
    rounded to x's dtype and stored to sum_ptr [n_rows, D]. GATED: w * normalised * sigmoid(g) in float32, rounded
    once."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)[:, None]  # [BLOCK_ROWS, 1]
    cols = tl.arange(0, BLOCK_D)[None, :]
    mask = (rows < n_rows) & (cols < D)
    x = tl.load(x_ptr + rows * x_stride + cols, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    if ADD:
        s = (xf + tl.load(r_ptr + rows * r_stride + cols, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + rows * D + cols, s, mask=mask)
        xf = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1)[:, None] / D + eps)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    if GATED:
        gate = tl.load(g_ptr + rows * g_stride + cols, mask=mask, other=0.0).to(tl.float32)
        y = w * (xf * rstd) * tl.sigmoid(gate)
    else:
        y = w * (xf * rstd).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + rows * D + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


TILE = 2048  # elements a program normalises: rows of a narrow norm (a head, the latent) share a program


def _rows(t: torch.Tensor, D: int) -> torch.Tensor:
    """t as [rows, D] with contiguous rows (a copy only where the view cannot be)."""
    t = t.reshape(-1, D)
    return t if t.stride(1) == 1 else t.contiguous()


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual=None, gate=None):
    """x [..., D] (rows of stride >= D, contiguous columns), weight [D], residual or gate shaped as x -> (out, the
    residual sum, or out again without a residual), both fresh [..., D] tensors in x's dtype."""
    D = x.shape[-1]
    rows = _rows(x, D)
    r, g = (rows if t is None else _rows(t, D) for t in (residual, gate))  # an absent one is never read
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    n_rows, block_d = rows.shape[0], triton.next_power_of_2(D)
    block_rows = max(1, min(TILE // block_d, triton.next_power_of_2(n_rows)))
    if n_rows:
        _rms_norm_kernel[(triton.cdiv(n_rows, block_rows),)](
            rows, r, g, weight.contiguous(), out, total, n_rows, rows.stride(0), r.stride(0), g.stride(0), eps, D=D,
            BLOCK_D=block_d, BLOCK_ROWS=block_rows, ADD=residual is not None, GATED=gate is not None,
            num_warps=4 if block_rows * block_d >= 1024 else 1)
    return out, total


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """kernels.norm.rms_norm for a weight of x's dtype."""
    assert weight.dtype == x.dtype and weight.shape == x.shape[-1:], "a weight of x's dtype and width"
    return _launch(x, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """kernels.norm.add_rms_norm for a residual and a weight of x's dtype: (normalised, x + residual)."""
    assert residual.dtype == weight.dtype == x.dtype and residual.shape == x.shape, "x, residual, weight: one dtype"
    return _launch(x, weight, eps, residual=residual)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """kernels.norm.gated_rms_norm: x, gate [..., D], weight [D] (any float dtypes) -> x's dtype."""
    assert gate.shape == x.shape and weight.shape == x.shape[-1:], "gate as x, weight as x's last dimension"
    return _launch(x, weight, eps, gate=gate)[0]
