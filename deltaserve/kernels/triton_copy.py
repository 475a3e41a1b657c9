"""Row copies on the GPU. cache_ops.copy_rows: whole rows of [L, S, ...] tensors (a request's KDA states in every
layer) copied from one slot to another in one pass, where torch's gather-then-scatter reads and writes them twice
(twin: its torch path, tested against it). triton_gather_rows: x[index] for the grouped experts' rows sorted by
expert (twin: index_select)."""

import torch
import triton
import triton.language as tl

_BLOCK = 4096  # elements a program copies


@triton.jit
def _copy_rows_kernel(src_ptr, dst_ptr, src_idx_ptr, dst_idx_ptr, row, src_layer, src_slot, dst_layer, dst_slot,
                      BLOCK: tl.constexpr):
    """One BLOCK of one row: block program_id(0) (the axis of 2**31 - 1 programs: a row may be long), pair
    program_id(1), layer program_id(2). Row length and strides are runtime values (one compiled variant for every
    state shape)."""
    c, i, layer = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    s = tl.load(src_idx_ptr + i)
    d = tl.load(dst_idx_ptr + i)
    offs = c.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row
    x = tl.load(src_ptr + layer * src_layer + s * src_slot + offs, mask=mask)
    tl.store(dst_ptr + layer * dst_layer + d * dst_slot + offs, x, mask=mask)


def triton_copy_rows(source: torch.Tensor, target: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """cache_ops.copy_rows' contract, on the GPU: rows contiguous, one dtype, src and dst int64 (a slot's offset
    is an int64 product: 20 layers of 256 KDA states pass 2**31 elements)."""
    L, row = source.shape[0], source[0, 0].numel()
    if (target.shape[0] != L or target[0, 0].numel() != row or source.dtype != target.dtype
            or not (source[0, 0].is_contiguous() and target[0, 0].is_contiguous())
            or src.dtype != torch.int64 or dst.dtype != torch.int64 or src.numel() != dst.numel()):
        raise ValueError(f"copy_rows: rows of {tuple(source.shape)} {source.dtype} into {tuple(target.shape)} "
                         f"{target.dtype} with indices {src.dtype} x{src.numel()}, {dst.dtype} x{dst.numel()}: needs "
                         "as many layers, equal contiguous rows, one dtype and int64 indices of one length")
    if not src.numel() or not row:
        return
    _copy_rows_kernel[(triton.cdiv(row, _BLOCK), src.numel(), L)](
        source, target, src, dst, row, source.stride(0), source.stride(1), target.stride(0), target.stride(1),
        BLOCK=_BLOCK, num_warps=4)


_GATHER_ROWS, _GATHER_COLS = 8, 256  # a program's tile: rows of the output, columns of each


@triton.jit(do_not_specialize=["M"])  # M (tokens x experts) only masks: any chunk length, one compiled variant
def _gather_rows_kernel(x_ptr, index_ptr, y_ptr, M, D, x_stride, ROWS: tl.constexpr, COLS: tl.constexpr):
    """y[i, cols] = x[index[i], cols] for ROWS output rows program_id(0) (the axis of 2**31 - 1 programs: a prefill
    chunk's tokens x experts rows) and COLS columns program_id(1)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    row_ok = rows < M
    src = tl.load(index_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    mask = row_ok[:, None] & (cols < D)[None, :]
    values = tl.load(x_ptr + src[:, None] * x_stride + cols[None, :], mask=mask)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], values, mask=mask)


def triton_gather_rows(x: torch.Tensor, index: torch.Tensor, *, rows: int = _GATHER_ROWS, cols: int = _GATHER_COLS,
                       num_warps: int = 4) -> torch.Tensor:
    """x [T, D] with unit column stride (rows may be strided), index [M] int64 of rows of x -> x[index] [M, D]
    contiguous. rows, cols (powers of two) and num_warps: the launch (kernels_bench's comparisons)."""
    if x.dim() != 2 or x.stride(1) != 1 or index.dim() != 1 or index.dtype != torch.int64:
        raise ValueError(f"gather_rows: x {tuple(x.shape)} strides {x.stride()}, index {tuple(index.shape)} "
                         f"{index.dtype}: needs 2-D x of unit column stride and a 1-D int64 index")
    M, D = index.shape[0], x.shape[1]
    y = torch.empty(M, D, dtype=x.dtype, device=x.device)
    if M and D:
        _gather_rows_kernel[(triton.cdiv(M, rows), triton.cdiv(D, cols))](
            x, index, y, M, D, x.stride(0), ROWS=rows, COLS=cols, num_warps=num_warps)
    return y
