"""kernels.activation.silu_and_mul on the GPU: one pass over the projection's output, reading the gate and up
halves of each row once and writing the product once (twin: kernels.activation's torch path)."""

import torch
import triton
import triton.language as tl

_BLOCK = 1024  # columns a program computes


@triton.jit
def _silu_and_mul_kernel(x_ptr, y_ptr, I, x_stride, BLOCK: tl.constexpr):
    """y[row, cols] = silu(x[row, cols]) * x[row, I + cols], in float32, for row program_id(0) (the axis of 2**31 - 1
    programs: a grouped MoE step has tokens x experts rows) and BLOCK columns program_id(1)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + I + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * I + cols, (gate * tl.sigmoid(gate) * up).to(y_ptr.dtype.element_ty), mask=mask)


def triton_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] with unit column stride (rows may be strided) -> [..., I] contiguous, x's dtype."""
    if x.shape[-1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"silu_and_mul: x {tuple(x.shape)} with strides {x.stride()} needs an even last dim of unit "
                         "stride (the gate columns, then the up columns)")
    rows = x.reshape(-1, x.shape[-1])  # a view for the 2-D [tokens, 2I] inputs it gets
    M, I = rows.shape[0], x.shape[-1] // 2
    y = torch.empty(*x.shape[:-1], I, dtype=x.dtype, device=x.device)
    if M and I:
        _silu_and_mul_kernel[(M, triton.cdiv(I, _BLOCK))](rows, y, I, rows.stride(0), BLOCK=_BLOCK, num_warps=4)
    return y
