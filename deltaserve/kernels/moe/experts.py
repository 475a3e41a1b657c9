"""Routed expert compute on the CPU: tokens grouped by expert, one pair of matmuls per expert that was hit.

Contributions are summed in ascending expert order, the order the reference uses, so float32 results match it up to
the products' own rounding (kernels.cpu_gemv sums a row in its own order)."""

import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from deltaserve.kernels import cpu_gemv
from deltaserve.kernels.activation import silu_and_mul

_FEW_ASSIGNMENTS = 64  # up to this many (token, expert) pairs, group on the host: fewer ops for decode steps
FEW_ASSIGNMENTS_GPU = 32  # up to this many pairs, one GEMV per pair beats sorting for a grouped GEMM
# up to this many pairs (a decode batch of 256 tokens, 8 experts each), bf16 experts run in kernels.moe.triton_blocks'
# sorted blocks, which read each chosen expert once per block of 16 rows (BENCHMARKS.md: faster than
# torch._grouped_mm from 8 to 256 tokens); past it (prefill chunks), the grouped GEMMs
MOST_BLOCK_PAIRS_GPU = 2048


def fused_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    cpu_threads: int | None = None, pdl: bool = True,
) -> torch.Tensor:
    """x [T, D]; w13 [E, 2I, D] (gate rows, then up rows); w2 [E, D, I]; weights [T, k] float32; ids [T, k].
    cpu_threads: on the CPU, kernels.cpu_gemv's threads where it serves a product; None: PyTorch's products only.
    pdl: the GPU decode kernel's programmatic dependent launch (kernels.pdl).

    Returns sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) -> [T, D] in x's dtype."""
    if x.is_cuda and ids.numel() <= FEW_ASSIGNMENTS_GPU:
        from deltaserve.kernels.moe.triton_decode import decode_experts

        return decode_experts(x, w13, w2, weights, ids, pdl=pdl)
    if x.is_cuda and x.dtype == torch.bfloat16:
        if ids.numel() <= MOST_BLOCK_PAIRS_GPU:
            from deltaserve.kernels.moe.triton_blocks import block_experts

            return block_experts(x, w13, w2, weights, ids, pdl=pdl)
        return grouped_experts(x, w13, w2, weights, ids)
    if not x.is_cuda and torch.compiler.is_compiling():  # a traced CPU decode step (runner: compile_decode)
        return _gathered(x, w13, w2, weights, ids)
    if x.shape[0] == 1 and not x.is_cuda:
        return _one_token(x, w13, w2, weights, ids, cpu_threads)
    out = torch.zeros_like(x)
    flat_weights = weights.flatten()
    # _one_token's rule, so a token's bits match it
    ours = cpu_threads is not None and cpu_gemv.can_run(x[:1], w13[0], group=ids.shape[1])
    for expert, rows, positions in _group_by_expert(ids):
        if ours and len(rows) <= cpu_gemv.MAX_ROWS:
            product = functools.partial(cpu_gemv.cpu_gemv, threads=cpu_threads)
        else:
            product = F.linear
        gate, up = product(x[rows], w13[expert]).chunk(2, dim=-1)
        y = product(F.silu(gate) * up, w2[expert]) * flat_weights[positions, None]
        out.index_add_(0, rows, y.to(x.dtype))
    return out


def _one_token(x, w13, w2, weights, ids, cpu_threads: int | None) -> torch.Tensor:
    """fused_experts for one token on the CPU (a decode step at batch 1, bound by reading the experts' weights): its
    experts in ascending order, summed directly, with none of the grouping's index ops; the grouped path's sums where
    each expert it runs has at most cpu_gemv.MAX_ROWS tokens. Through kernels.cpu_gemv, each product for all k
    experts in one call (one parallel region, more bytes in flight)."""
    chosen = sorted(zip(ids[0].tolist(), range(ids.shape[1])))
    # all k experts in one call a product (fused_experts' rule)
    if cpu_threads is not None and cpu_gemv.can_run(x, w13[0], group=len(chosen)):
        act = silu_and_mul(cpu_gemv.cpu_gemv_grouped(x, [w13[e] for e, _ in chosen], cpu_threads))  # [k, 1, I]
        ys = cpu_gemv.cpu_gemv_grouped(act, [w2[e] for e, _ in chosen], cpu_threads)  # [k, 1, D]
    else:
        ys = []
        for expert, _ in chosen:
            ys.append(F.linear(silu_and_mul(F.linear(x, w13[expert])), w2[expert]))
    out = None
    for (_, slot), y in zip(chosen, ys):
        y = (y * weights[:, slot, None]).to(x.dtype)
        out = y if out is None else out + y
    return out


def _gathered(x, w13, w2, weights, ids) -> torch.Tensor:
    """fused_experts with no host reads (torch.compile captures it whole): each token's experts sorted ascending on
    the device, their weights gathered [T * k, ...] for two batched products, the k contributions summed in that
    order (the grouped path's order, as _one_token's). Gathers k weight copies a token: for decode steps only."""
    T, k = ids.shape
    ids, order = ids.sort(dim=-1)
    weights = weights.gather(1, order)
    flat = ids.flatten()
    rows = x[:, None, :].expand(T, k, x.shape[-1]).reshape(T * k, -1, 1)
    act = silu_and_mul(torch.bmm(w13[flat], rows)[..., 0])  # [T * k, I]
    y = torch.bmm(w2[flat], act[..., None])[..., 0].view(T, k, -1)
    y = (y * weights[..., None]).to(x.dtype)
    out = y[:, 0]
    for slot in range(1, k):
        out = out + y[:, slot]
    return out


def _group_by_expert(ids: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """For each expert hit, ascending: (expert, its token rows [n], their flat positions in ids [n])."""
    k, flat = ids.shape[1], ids.flatten()
    if flat.numel() <= _FEW_ASSIGNMENTS:
        by_expert: dict[int, list[int]] = {}
        for position, expert in enumerate(flat.tolist()):
            by_expert.setdefault(expert, []).append(position)
        for expert in sorted(by_expert):
            positions = torch.tensor(by_expert[expert], device=ids.device)
            yield expert, positions // k, positions
        return
    order = flat.argsort(stable=True)
    start = 0
    for expert, count in enumerate(torch.bincount(flat).tolist()):
        if count:
            positions = order[start: start + count]
            yield expert, positions // k, positions
            start += count


def grouped_experts(x, w13, w2, weights, ids) -> torch.Tensor:
    """The GPU path of fused_experts: tokens sorted by expert, two grouped GEMMs (bf16), no host sync, so it
    is CUDA-graph safe. Same contract as fused_experts."""
    order, token, ends = sort_by_expert(ids, w13.shape[0])
    y = _grouped_swiglu(_gather_rows(x, token), w13, w2, ends.to(torch.int32))  # [T*k, D]
    return _weighted_sum(y, order, weights, x.dtype)


def grouped_experts_in_chunks(x, weights, ids, num_experts: int, chunk: int, weights_of) -> torch.Tensor:
    """grouped_experts over `chunk` experts at a time, their weights made by weights_of(e0, e1) -> (w13, w2) of
    experts e0..e1-1 (FP8 dequantized on the fly: only a chunk's high-precision copy exists at once). The chunk
    bounds come to the host (one sync): for prefill steps, not CUDA graphs. Same contract as fused_experts."""
    order, token, ends = sort_by_expert(ids, num_experts)
    bounds = [0] + ends.tolist()
    rows = _gather_rows(x, token)
    y = torch.empty(rows.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    for e0 in range(0, num_experts, chunk):
        e1 = min(e0 + chunk, num_experts)
        lo, hi = bounds[e0], bounds[e1]
        if lo < hi:
            w13, w2 = weights_of(e0, e1)
            y[lo:hi] = _grouped_swiglu(rows[lo:hi], w13, w2, (ends[e0:e1] - lo).to(torch.int32))
    return _weighted_sum(y, order, weights, x.dtype)


def sort_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order: the flat (token, slot) pairs sorted by expert, stably; each sorted pair's token; ends [E]: where
    each expert's run of sorted pairs ends). The sort's keys in the narrowest integer type that holds every expert:
    a GPU radix sort makes a pass a byte of key, so 256 experts sort in one pass, not int64's eight."""
    flat = ids.flatten()
    order = flat.to(sort_key_dtype(num_experts)).argsort(stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    return order, order // ids.shape[1], counts.cumsum(0)


def _gather_rows(x: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """x[token]: each sorted pair's token row, [T*k, D]. On a GPU one Triton pass (kernels.triton_copy), whose twin is
    index_select."""
    if x.is_cuda:
        from deltaserve.kernels.triton_copy import triton_gather_rows

        return triton_gather_rows(x, token)
    return x.index_select(0, token)


def sort_key_dtype(num_experts: int) -> torch.dtype:
    """The narrowest integer type holding expert ids 0..num_experts-1 (sort_by_expert's keys)."""
    return torch.uint8 if num_experts <= 256 else torch.int16 if num_experts <= 32768 else torch.int64


def _grouped_swiglu(rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """rows sorted by expert, offsets [E] int32 (run ends) -> each row through its expert's SwiGLU MLP."""
    act = silu_and_mul(torch._grouped_mm(rows, w13.transpose(1, 2), offs=offsets))
    return torch._grouped_mm(act, w2.transpose(1, 2), offs=offsets)


def _weighted_sum(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Sorted expert outputs [T*k, D] -> sum over each token's k slots of weight x output, [T, D] in dtype: back to
    (token, slot) order with a permutation, then the sum, with no atomics, so deterministic. On a GPU one Triton
    kernel (kernels.moe.triton_combine), whose twin is the torch code here."""
    if y.is_cuda:
        from deltaserve.kernels.moe.triton_combine import weighted_sum

        return weighted_sum(y, order, weights, dtype)
    T, k = weights.shape
    y = y.float() * weights.flatten()[order, None]
    unsorted = torch.empty_like(y).index_copy_(0, order, y)
    return unsorted.view(T, k, -1).sum(1).to(dtype)
