"""Chunked (WY) KDA for prefill: variable-length sequences, states read from and written to pooled slots.

Inside a chunk of C tokens the delta rule's corrections u solve one unit lower-triangular system

    (I + L) u = beta*v - (beta*k*exp(gc)) S0,   L[i, j] = beta_i * sum_k k_i k_j exp(gc_i - gc_j)   (j < i)

with gc the in-chunk cumulative log decay; outputs and the next state then follow from matmuls. The pairwise
decay exp(gc_i - gc_j) (j <= i, so <= 1) is formed exactly rather than factored as exp(gc_i) * exp(-gc_j),
which overflows float32 when a chunk's total decay passes ~88. That tensor is [H, C, C, K]: its cost per token
grows with C, so CPU chunks are short (16; BENCHMARKS.md has the measurement against 64)."""

import torch


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state: torch.Tensor,
    state_slots: list[int],
    cu_seqlens: list[int],
    chunk_size: int = 16,
) -> torch.Tensor:
    """KDA over packed sequences; sequence b starts from state[state_slots[b]] and leaves its final state there.

    q, k, g: [N, H, K] float32 (q, k l2-normalised); v: [N, H, V] float32; beta: [N, H] float32
    state: [S, H, K, V] float32, updated in place; cu_seqlens: B+1 host offsets into N.
    Returns o [N, H, V] float32."""
    o = torch.empty_like(v)
    for b, slot in enumerate(state_slots):
        S = state[slot]
        for start in range(cu_seqlens[b], cu_seqlens[b + 1], chunk_size):
            end = min(start + chunk_size, cu_seqlens[b + 1])
            o[start:end], S = _chunk(q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end], scale, S)
        state[slot] = S
    return o


def _chunk(q, k, v, g, beta, scale, S):
    """One chunk: q, k, g [C, H, K], v [C, H, V], beta [C, H], S [H, K, V] -> o [C, H, V], next S."""
    q, k, v, g = (t.transpose(0, 1) for t in (q * scale, k, v, g))  # [H, C, *]
    beta = beta.t()[..., None]  # [H, C, 1]
    H, C, K = k.shape
    gc = g.cumsum(1)
    lower = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
    decay = (gc[:, :, None, :] - gc[:, None, :, :]).masked_fill_(~lower[..., None], float("-inf")).exp_()
    k_decayed = decay.mul_(k[:, None, :, :])  # [H, C(i), C(j), K]: k_j exp(gc_i - gc_j), zero for j > i
    k_beta = k * beta
    # L[h, i, j] = k_beta_i . k_decayed[i, j] and attn[h, i, j] = q_i . k_decayed[i, j], in one batched matmul
    # that reads the [H, C, C, K] tensor once
    both = torch.bmm(k_decayed.view(H * C, C, K), torch.stack([k_beta, q], dim=-1).view(H * C, K, 2))
    both = both.view(H, C, C, 2)
    L, attn = both[..., 0].tril(-1), both[..., 1]  # attn: lower triangle incl. the diagonal
    rhs = torch.cat([v * beta, k_beta * gc.exp()], dim=-1)
    solved = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)
    u = solved[..., : v.shape[-1]] - solved[..., v.shape[-1]:] @ S  # [H, C, V]
    o = (q * gc.exp()) @ S + attn @ u
    last = gc[:, -1:, :]  # [H, 1, K]
    S = S * last.transpose(1, 2).exp() + (k * (last - gc).exp()).transpose(1, 2) @ u
    return o.transpose(0, 1), S
