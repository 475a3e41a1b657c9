"""kernels.mla.keys.expand_keys on the GPU: one pass that reads each token's k_nope of every head and its shared
k_rope once and writes the token's keys once (twin: kernels.mla.keys' torch.cat)."""

import torch
import triton
import triton.language as tl


@triton.jit
def _expand_keys_kernel(nope_ptr, rope_ptr, k_ptr, nope_row, nope_head, rope_row, H: tl.constexpr, DN: tl.constexpr,
                        DR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DN: tl.constexpr, BLOCK_DR: tl.constexpr):
    """keys[row, h, :DN] = k_nope[row, h], keys[row, h, DN:] = k_rope[row] for token program_id(0) (the axis of
    2**31 - 1 programs: a long prefill expands 65,536 cached keys a block) and BLOCK_H heads program_id(1)."""
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dn, dr = tl.arange(0, BLOCK_DN), tl.arange(0, BLOCK_DR)
    head_ok = heads[:, None] < H
    nope_mask = head_ok & (dn[None, :] < DN)
    nope = tl.load(nope_ptr + row * nope_row + heads[:, None] * nope_head + dn[None, :], mask=nope_mask)
    rope = tl.load(rope_ptr + row * rope_row + dr, mask=dr < DR)
    keys = k_ptr + row * H * (DN + DR) + heads[:, None] * (DN + DR)
    tl.store(keys + dn[None, :], nope, mask=nope_mask)
    tl.store(keys + DN + dr[None, :], tl.broadcast_to(rope[None, :], (BLOCK_H, BLOCK_DR)),
             mask=head_ok & (dr[None, :] < DR))


def triton_expand_keys(k_nope: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
    """k_nope [L, H, Dn] and k_rope [L, Dr], each with a unit last stride, one dtype -> keys [L, H, Dn+Dr]."""
    L, H, DN = k_nope.shape
    DR = k_rope.shape[-1]
    if k_rope.shape[0] != L or k_nope.stride(-1) != 1 or k_rope.stride(-1) != 1 or k_rope.dtype != k_nope.dtype:
        raise ValueError(f"expand_keys: k_nope {tuple(k_nope.shape)} {k_nope.dtype} strides {k_nope.stride()} and "
                         f"k_rope {tuple(k_rope.shape)} {k_rope.dtype} strides {k_rope.stride()} need one token count, "
                         "one dtype and unit last strides")
    keys = torch.empty(L, H, DN + DR, dtype=k_nope.dtype, device=k_nope.device)
    if L:
        block_h = min(triton.next_power_of_2(H), 16)  # 16 heads x 192 columns: 6 KB of keys a program
        _expand_keys_kernel[(L, triton.cdiv(H, block_h))](
            k_nope, k_rope, keys, k_nope.stride(0), k_nope.stride(1), k_rope.stride(0), H=H, DN=DN, DR=DR,
            BLOCK_H=block_h, BLOCK_DN=triton.next_power_of_2(DN), BLOCK_DR=triton.next_power_of_2(DR), num_warps=4)
    return keys
