"""NoPE MLA attention over the paged latent cache.

The cache holds, per token, the normalised latent c_kv [R] and the shared key k_rot [Dr] (never rotated).
Prefill expands the latents into per-head keys and values (the reference's order of operations); decode attends
in the latent space with kv_b_proj folded into the query and the output ("weight absorption"), so a decode step
reads R + Dr values per cached token instead of expanding the whole history again."""

from typing import Callable

import torch
import torch.nn.functional as F

from deltaserve.kernels.mla.prefill import attention_lse

# cached keys shorter than this attend with the chunk's own in one causal call (mla_prefill_fused): a prefix of up to
# 2,047 keys costs no call of its own, and the zero queries in front cost at most ~2M scores a head
PREFIX_TAIL_BLOCK = 2048


def gather_latents(cache: torch.Tensor, block_table: torch.Tensor, end: int, start: int = 0,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """cache [P, bs, R+Dr], block_table [num_blocks] -> the latents of one sequence at positions start..end-1
    [end - start, R+Dr] in dtype (default the cache's: a float8 cache's are widened), only the pages holding them
    copied."""
    block_size = cache.shape[1]
    first, last = start // block_size, (end + block_size - 1) // block_size
    offset = start - first * block_size
    pages = select_pages(cache, block_table[first:last])
    return pages.flatten(0, 1)[offset: offset + end - start].to(dtype or cache.dtype)


def select_pages(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """cache.index_select(0, pages); a float8 cache's as bytes (not every torch build has a float8 index_select)."""
    if cache.dtype == torch.float8_e4m3fn:
        return cache.view(torch.uint8).index_select(0, pages).view(cache.dtype)
    return cache.index_select(0, pages)


def mla_prefill(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    k_nope: torch.Tensor,
    k_rope: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    start_pos: int,
) -> torch.Tensor:
    """Causal attention of T new queries at positions start_pos.. over L = start_pos + T keys.

    q_nope [T, H, Dn], q_rope [T, H, Dr], k_nope [L, H, Dn], k_rope [L, Dr], v [L, H, Dv] -> [T, H, Dv]
    (scores in float32, probabilities cast back to v's dtype as the reference does)."""
    if q_nope.is_cuda:
        return _sdpa_prefill(q_nope, q_rope, k_nope, k_rope, v, scale, start_pos)
    probs = torch.softmax(_causal_scores(q_nope, q_rope, k_nope, k_rope, scale, start_pos, 0), dim=-1)
    return torch.einsum("htl,lhd->thd", probs.to(v.dtype), v)


def mla_prefill_block(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    k_nope: torch.Tensor,
    k_rope: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    start_pos: int,
    key_pos: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """mla_prefill's attention over one block of the keys, at positions key_pos.. of the sequence: (out [T, H, Dv]
    float32, normalised within the block; lse [T, H] float32, the log-sum-exp of the block's scaled scores, -inf
    where a query sees none of its keys). merge_blocks combines the blocks into mla_prefill's result, so a long
    context is attended with memory for one block (its [H, T, block] scores) instead of the whole context."""
    scores = _causal_scores(q_nope, q_rope, k_nope, k_rope, scale, start_pos, key_pos)  # its own: worked in place
    top = scores.amax(-1, keepdim=True)
    top = torch.where(top == float("-inf"), 0.0, top)  # a query that sees no key here: p is 0, lse -inf
    p = scores.sub_(top).exp_()
    total = p.sum(-1)  # [H, T]
    out = torch.einsum("htl,lhd->thd", p.to(v.dtype), v).float() / total.clamp_min(1e-30).t()[..., None]
    return out, (top[..., 0] + total.log()).t()


def _causal_scores(q_nope, q_rope, k_nope, k_rope, scale: float, start_pos: int, key_pos: int) -> torch.Tensor:
    """Scaled scores [H, T, L] in float32 (a new tensor) of T queries at positions start_pos.. against L keys at
    positions key_pos.., -inf where a key lies past its query (the reference's order: sums in the inputs' dtype,
    scaled, then widened)."""
    T, L = q_nope.shape[0], k_nope.shape[0]
    scores = torch.einsum("thd,lhd->htl", q_nope, k_nope) + torch.einsum("thd,ld->htl", q_rope, k_rope)
    scores = (scores * scale).float()
    if key_pos + L - 1 > start_pos:  # some key lies past the first query
        keys = torch.arange(key_pos, key_pos + L, device=scores.device)
        queries = torch.arange(start_pos, start_pos + T, device=scores.device)
        scores.masked_fill_(keys[None, :] > queries[:, None], float("-inf"))
    return scores


def mla_prefill_fused(
    q: torch.Tensor,
    expand: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
    scale: float,
    start_pos: int,
    key_block: int,
    attend: Callable = attention_lse,
    tail_block: int = PREFIX_TAIL_BLOCK,
) -> torch.Tensor:
    """mla_prefill through fused attention kernels, for any context length: the T new queries attend to their own
    keys and the last cached ones (causal), then to the earlier cached ones a block at a time (all visible), merged
    by log-sum-exp.

    q [T, H, Dn+Dr] (each head's q_nope, then its q_rope; a strided view is fine), expand(lo, hi): the keys [hi -
    lo, H, Dn+Dr] and values [hi - lo, H, Dv] of the sequence's positions lo..hi-1 (expanded from their latents on
    demand, so no more than key_block of the context, or the tail and the chunk, is ever expanded or copied at once)
    -> [T, H, Dv] (with no earlier blocks a view of the kernel's output: rows may be strided, so reshape it, not
    view). attend: prefill.attention_lse or its naive twin.

    The blocks come from prefix_blocks, so the kernels see few distinct shapes (cuDNN builds a plan for each new
    one, tens of milliseconds): the cached tail shorter than tail_block joins the causal call behind zero queries
    in front of the chunk's (a query at row tail + t of a top-left causal mask sees the whole tail and its own
    first t + 1 keys: exactly its attention; the zero rows' outputs are dropped). With no earlier blocks the causal
    call's output is returned as the kernel wrote it (no float32 round trip: the merge's only)."""
    blocks, tail_start = prefix_blocks(start_pos, key_block, tail_block)
    tail = start_pos - tail_start  # cached keys in the causal call, each with a zero query in front of the chunk's
    queries = F.pad(q, (0, 0, 0, 0, tail, 0)) if tail else q
    out, lse = attend(queries, *expand(tail_start, start_pos + q.shape[0]), scale, causal=True)
    if not blocks:
        return out[tail:]
    out, lse = out[tail:].float(), lse[tail:]
    for lo, hi in blocks:
        part, part_lse = attend(q, *expand(lo, hi), scale, causal=False)
        out, lse = merge_blocks(out, lse, part.float(), part_lse)
    return out.to(q.dtype)


def prefix_blocks(start_pos: int, key_block: int, tail_block: int) -> tuple[list[tuple[int, int]], int]:
    """The cached positions 0..start_pos as (blocks attended apart, start of the tail attended with the chunk):
    whole blocks of key_block, then blocks of tail_block times a power of two, largest first, while tail_block
    fits; the tail is what is left (shorter than tail_block). So a block has one of a few lengths whatever the
    context, and the tail's extra causal work (its own zero queries) is bounded by tail_block^2 / 2."""
    if key_block < 1 or tail_block < 1:
        raise ValueError(f"prefix_blocks needs key_block and tail_block >= 1, got {key_block} and {tail_block}")
    tail_block = min(tail_block, key_block)
    blocks, lo = [], 0
    while start_pos - lo >= tail_block:
        left = start_pos - lo
        size = key_block if left >= key_block else tail_block << ((left // tail_block).bit_length() - 1)
        blocks.append((lo, lo + size))
        lo += size
    return blocks, lo


def merge_blocks(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                 lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two blocks' (out [T, H, Dv], lse [T, H]) -> the attention over both: each block's output weighted by its
    share of the total softmax mass. lse_a must be finite (a block in which every query sees a key)."""
    lse = torch.logaddexp(lse_a, lse_b)
    return out_a * (lse_a - lse).exp()[..., None] + out_b * (lse_b - lse).exp()[..., None], lse


def mla_decode(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    pdl: bool = True,
) -> torch.Tensor:
    """One query per sequence against its cached latents, in the latent space.

    q_latent [B, H, R] (q_nope already multiplied by the key half of kv_b_proj), q_rope [B, H, Dr],
    cache [P, bs, R+Dr] (in q_latent's dtype, or float8: widened to it as read), block_tables [B, max_blocks] int64,
    context_lens [B] int64 (tokens cached, this one included). Returns the attention-weighted latent [B, H, R]; the
    caller applies the value half of kv_b_proj.
    On a GPU in half precision, the paged Triton kernel (reads only each sequence's context); float32 keeps
    torch_mla_decode (the exact regime), which gathers the table's whole width and masks past each context. pdl:
    the GPU kernels' programmatic dependent launch (kernels.pdl)."""
    if q_latent.is_cuda and q_latent.dtype != torch.float32:
        from deltaserve.kernels.mla.triton_decode import triton_mla_decode

        return triton_mla_decode(q_latent, q_rope, cache, block_tables, context_lens, scale, pdl=pdl)
    return torch_mla_decode(q_latent, q_rope, cache, block_tables, context_lens, scale)


def torch_mla_decode(q_latent, q_rope, cache, block_tables, context_lens, scale: float) -> torch.Tensor:
    """mla_decode in torch ops on any device (the Triton kernel's twin): every page of the table gathered, then a
    softmax masked past each context."""
    B, _, R = q_latent.shape
    # [B, L, R+Dr], L = max_blocks * block_size: no host sync; index_select, not cache[block_tables] (on the CPU
    # the advanced index is several times slower)
    latents = select_pages(cache, block_tables.flatten()).view(B, -1, cache.shape[-1]).to(q_latent.dtype)
    max_len = latents.shape[1]
    c_kv, k_rope = latents[..., :R], latents[..., R:]  # [B, L, R], [B, L, Dr]
    scores = q_latent @ c_kv.transpose(1, 2) + q_rope @ k_rope.transpose(1, 2)  # [B, H, L]
    beyond = torch.arange(max_len, device=cache.device)[None, :] >= context_lens[:, None]  # [B, L]
    probs = torch.softmax((scores * scale).float().masked_fill(beyond[:, None, :], float("-inf")), dim=-1)
    return probs.to(c_kv.dtype) @ c_kv


def _sdpa_prefill(q_nope, q_rope, k_nope, k_rope, v, scale: float, start_pos: int) -> torch.Tensor:
    """mla_prefill through PyTorch's fused attention (GPU): never materialises the [H, T, L] scores."""
    T, H, _ = q_nope.shape
    L = k_nope.shape[0]
    q = torch.cat([q_nope, q_rope], dim=-1).transpose(0, 1)[None]  # [1, H, T, Dn+Dr]
    k = torch.cat([k_nope, k_rope[:, None, :].expand(L, H, -1)], dim=-1).transpose(0, 1)[None]
    # a chunk after start_pos cached tokens: causal aligned to the bottom right (query t sees keys <= start_pos + t)
    # as a bias object, not a [T, L] mask (2 GB for a chunk of 8k at a 256k context), so the fused kernels run
    mask = None
    if start_pos:
        from torch.nn.attention.bias import causal_lower_right  # imports torch._dynamo (~1 s): only where it is used

        mask = causal_lower_right(T, L)
    out = F.scaled_dot_product_attention(q, k, v.transpose(0, 1)[None], attn_mask=mask, is_causal=not start_pos,
                                         scale=scale)
    return out[0].transpose(0, 1)  # [T, H, Dv]
