"""Token bitmasks (structured outputs): the tokens a grammar allows next, 32 to an int32 word, applied to logits.

A device op made of tensor ops (shift, and, masked_fill), so it runs where the logits are, with no host sync;
xgrammar's apply_token_bitmask_inplace is its oracle in the tests."""

from __future__ import annotations

import torch


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """logits with the disallowed tokens of some rows set to -inf (a copy; logits is left unchanged).

    logits: [B, V] float; bitmask: [R, W] int32 on logits' device, W >= ceil(V / 32), bit j of word w set when token
    32 * w + j is allowed (xgrammar's layout); rows: [R] int64, the row of logits each bitmask row masks."""
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32 or bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(f"apply_token_bitmask: bitmask is {bitmask.dtype} {tuple(bitmask.shape)}, expected int32 "
                         f"[rows, >= {-(-logits.shape[1] // 32)}] for logits {tuple(logits.shape)}")
    allowed = unpack_bitmask(bitmask, logits.shape[1])  # [R, V]
    masked = logits.index_select(0, rows).masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, rows, masked)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 -> [R, vocab_size] bool, True where the token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]; an arithmetic shift, so mask the low bit
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
