"""NoPE MLA over the paged latent cache against naive_mla (expand every latent, plain causal softmax).

Sequences of ragged lengths get pages in a random order; pages no sequence owns (page 0 among them, which pads
the block tables) hold huge finite garbage, so a read past a sequence's context shows in the output.
"""

from __future__ import annotations

import pytest
import torch
from helpers.kernels import PagedLatents

from deltaserve.kernels.mla import (
    gather_latents,
    merge_blocks,
    mla_decode,
    mla_prefill,
    mla_prefill_block,
    mla_prefill_fused,
    prefill,
)
from deltaserve.kernels.mla.attention import prefix_blocks
from deltaserve.kernels.mla.naive import naive_mla
from deltaserve.kernels.mla.prefill import attention_lse, attention_lse_naive, padded, padded_length

H, DN, DR, DV, R = 3, 8, 4, 6, 16
BLOCK_SIZE, NUM_PAGES = 4, 40
SCALE = (DN + DR) ** -0.5
TOL = dict(rtol=1e-5, atol=1e-5)


def test_gather_returns_exactly_what_was_written():
    gen = torch.Generator().manual_seed(0)
    paged = PagedLatents([1, 4, 5, 13], R + DR, BLOCK_SIZE, NUM_PAGES, gen)
    tables = paged.block_tables()
    for b, latents in enumerate(paged.latents):
        assert torch.equal(gather_latents(paged.cache, tables[b], len(latents)), latents)
        for start in range(len(latents)):  # a range from inside a page, to the end of one or inside one
            for end in range(start + 1, len(latents) + 1):
                assert torch.equal(gather_latents(paged.cache, tables[b], end, start), latents[start:end])


@pytest.mark.parametrize("lengths", [[1], [BLOCK_SIZE], [1, 3, BLOCK_SIZE, BLOCK_SIZE + 1, 3 * BLOCK_SIZE + 2]])
def test_absorbed_decode_matches_naive(lengths):
    """Each sequence's newest token attends over its whole context, in the latent space (kv_b_proj folded into
    the query and the output), against the expanded naive attention."""
    gen = torch.Generator().manual_seed(len(lengths))
    paged = PagedLatents(lengths, R + DR, BLOCK_SIZE, NUM_PAGES, gen)
    w_kv_b = torch.randn(H * (DN + DV), R, generator=gen) * 0.3
    q_nope = torch.randn(len(lengths), H, DN, generator=gen)
    q_rope = torch.randn(len(lengths), H, DR, generator=gen)
    w = w_kv_b.view(H, DN + DV, R)
    q_latent = torch.einsum("bhd,hdr->bhr", q_nope, w[:, :DN])
    o_latent = mla_decode(q_latent, q_rope, paged.cache, paged.block_tables(), torch.tensor(lengths), SCALE)
    out = torch.einsum("bhr,hdr->bhd", o_latent, w[:, DN:])
    for b, n in enumerate(lengths):
        expected = naive_mla(q_nope[b: b + 1], q_rope[b: b + 1], paged.latents[b], w_kv_b, SCALE, start_pos=n - 1)
        torch.testing.assert_close(out[b], expected[0], **TOL, msg=lambda m: f"sequence of {n}: {m}")


@pytest.mark.parametrize("start_pos,num_new", [(0, 1), (0, 7), (5, 3), (12, 1), (3, 10)])
def test_prefill_matches_naive(start_pos, num_new):
    """num_new queries at positions start_pos.. over the first start_pos + num_new latents (a prefill chunk
    after start_pos cached tokens), keys and values expanded from the paged latents."""
    gen = torch.Generator().manual_seed(start_pos * 31 + num_new)
    length = start_pos + num_new
    # the sequence has later latents the chunk must not see
    paged = PagedLatents([length + 3], R + DR, BLOCK_SIZE, NUM_PAGES, gen)
    latents = gather_latents(paged.cache, paged.block_tables()[0], length)
    w_kv_b = torch.randn(H * (DN + DV), R, generator=gen) * 0.3
    kv = (latents[:, :R] @ w_kv_b.t()).view(length, H, DN + DV)
    q_nope = torch.randn(num_new, H, DN, generator=gen)
    q_rope = torch.randn(num_new, H, DR, generator=gen)
    out = mla_prefill(q_nope, q_rope, kv[..., :DN], latents[:, R:], kv[..., DN:], SCALE, start_pos)
    expected = naive_mla(q_nope, q_rope, latents, w_kv_b, SCALE, start_pos)
    torch.testing.assert_close(out, expected, **TOL)


@pytest.mark.parametrize("start_pos,num_new,block", [(0, 7, 3), (50, 37, 16), (50, 37, 5), (16, 16, 16), (3, 1, 1)])
def test_blockwise_prefill_matches_naive(start_pos, num_new, block):
    """A long context's prefill: the keys in blocks (some wholly before the chunk, one straddling its start, some
    inside it, a ragged last one), each block's softmax apart, merged by log-sum-exp, against the whole at once."""
    gen = torch.Generator().manual_seed(start_pos * 7 + num_new + block)
    length = start_pos + num_new
    latents = torch.randn(length, R + DR, generator=gen)
    w_kv_b = torch.randn(H * (DN + DV), R, generator=gen) * 0.3
    kv = (latents[:, :R] @ w_kv_b.t()).view(length, H, DN + DV)
    q_nope = torch.randn(num_new, H, DN, generator=gen) * 3  # sharp softmaxes: blocks of very different mass
    q_rope = torch.randn(num_new, H, DR, generator=gen)
    out = lse = None
    for key_pos in range(0, length, block):
        keys = slice(key_pos, key_pos + block)
        part = mla_prefill_block(q_nope, q_rope, kv[keys, :, :DN], latents[keys, R:], kv[keys, :, DN:], SCALE,
                                 start_pos, key_pos)
        out, lse = part if out is None else merge_blocks(out, lse, *part)
    torch.testing.assert_close(out, naive_mla(q_nope, q_rope, latents, w_kv_b, SCALE, start_pos), **TOL)
    assert torch.isfinite(lse).all()


@pytest.mark.parametrize("start_pos,num_new,block,tail", [
    (0, 1, 4, 4), (0, 9, 4, 4), (1, 1, 1, 1), (37, 5, 16, 16), (50, 37, 7, 7), (16, 16, 16, 16), (17, 3, 16, 16),
    (15, 2, 16, 16), (15, 2, 16, 32), (3, 4, 64, 4), (61, 6, 64, 4), (200, 3, 64, 4), (71, 1, 32, 8)])
def test_fused_prefill_matches_naive(start_pos, num_new, block, tail):
    """The fused path's plan (the cached tail and the chunk's own keys in one causal call behind zero queries, then
    the earlier cached keys in blocks, all visible, merged by log-sum-exp) with the attention twin in place of the
    GPU kernels: blocks ragged at both ends, a prefix of one key, prefixes one short of and one past a block, and
    power-of-two blocks between whole ones and the tail."""
    gen = torch.Generator().manual_seed(start_pos * 11 + num_new + block + tail)
    length = start_pos + num_new
    latents = torch.randn(length, R + DR, generator=gen)
    w_kv_b = torch.randn(H * (DN + DV), R, generator=gen) * 0.3
    q_nope = torch.randn(num_new, H, DN, generator=gen) * 3
    q_rope = torch.randn(num_new, H, DR, generator=gen)
    seen = []

    def expand(lo, hi):
        seen.append((lo, hi))
        part = latents[lo:hi]
        kv = (part[:, :R] @ w_kv_b.t()).view(part.shape[0], H, DN + DV)
        return torch.cat([kv[..., :DN], part[:, None, R:].expand(-1, H, -1)], dim=-1), kv[..., DN:]

    q = torch.zeros(num_new, H * (DN + DR) + 7)[:, : H * (DN + DR)].view(num_new, H, DN + DR)  # as the layer's
    q.copy_(torch.cat([q_nope, q_rope], dim=-1))  # a view of in_proj's wider rows
    out = mla_prefill_fused(q, expand, SCALE, start_pos, block, attend=attention_lse_naive, tail_block=tail)
    torch.testing.assert_close(out, naive_mla(q_nope, q_rope, latents, w_kv_b, SCALE, start_pos), **TOL)
    blocks, tail_start = prefix_blocks(start_pos, block, tail)
    assert seen == [(tail_start, length), *blocks]  # the causal call first, then each earlier block once, in order


def test_the_backend_probe_keeps_a_backend_that_refuses_only_strides(monkeypatch):
    """The first backend refusing strided inputs (the layer's q and v are views) is kept, fed contiguous copies from
    then on, rather than dropped for a slower one; a backend refusing the shapes is dropped."""
    calls = []

    def strict(q, k, v, scale, causal):  # runs contiguous inputs only
        calls.append(("strict", q.is_contiguous()))
        if not q.is_contiguous():
            raise RuntimeError("strides")
        return attention_lse_naive(q, k, v, scale, causal)

    def missing(*args):
        raise RuntimeError("no kernel")

    monkeypatch.setattr(prefill, "_RUN", {"cudnn": missing, "flash": strict, "efficient": attention_lse_naive})
    monkeypatch.setattr(prefill, "_chosen", {})
    monkeypatch.setattr(prefill, "_contiguous", set())
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(6, H, DN + DR + 5, generator=gen)
    q, k, v = wide[..., : DN + DR], torch.randn(6, H, DN + DR, generator=gen), torch.randn(6, H, DV, generator=gen)
    expected = attention_lse_naive(q, k, v, SCALE, True)
    for _ in range(2):  # the probe, then a call on the choice
        out, lse = attention_lse(q, k, v, SCALE, True)
        torch.testing.assert_close(out, expected[0], **TOL)
        torch.testing.assert_close(lse, expected[1], **TOL)
    assert prefill._chosen == {("cpu", torch.float32): "flash"} and prefill._contiguous == {("cpu", torch.float32)}
    assert calls == [("strict", False), ("strict", True), ("strict", True)]


@pytest.mark.parametrize("key_block,tail", [(4, 4), (16, 4), (64, 4), (65, 8), (65536, 2048), (7, 16)])
def test_prefix_blocks_cover_the_prefix_in_few_lengths(key_block, tail):
    """prefix_blocks tiles 0..start exactly, in order; a block is key_block long or tail (capped at key_block)
    times a power of two, never longer than key_block, and the tail left is shorter than tail."""
    tail = min(tail, key_block)
    sizes = {key_block} | {tail << j for j in range(20) if tail << j < key_block}
    ragged = torch.randint(0, 10 * key_block, (20,), generator=torch.Generator().manual_seed(key_block)).tolist()
    for start in [0, 1, tail - 1, tail, key_block - 1, key_block, key_block + 1, 3 * key_block + 2 * tail + 1, *ragged]:
        blocks, tail_start = prefix_blocks(start, key_block, tail)
        assert [lo for lo, _ in blocks] == [0, *(hi for _, hi in blocks[:-1])][:len(blocks)]
        assert (blocks[-1][1] if blocks else 0) == tail_start and 0 <= start - tail_start < tail
        assert all(hi - lo in sizes for lo, hi in blocks), (start, blocks)


@pytest.mark.parametrize("key_block,tail", [(0, 4), (4, 0), (-1, 4), (4, -2)])
def test_prefix_blocks_refuses_blocks_shorter_than_one_key(key_block, tail):
    with pytest.raises(ValueError, match="key_block and tail_block >= 1"):
        prefix_blocks(100, key_block, tail)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T", [1, 5, 63, 64, 65, 100, 129, 300])
def test_padded_attention_is_the_attention_of_the_real_queries(causal, T):
    """prefill.padded (how the cuDNN backend rounds its shapes up) around the twin: the real queries' outputs and
    log-sum-exps as without padding, causal (zero keys appended) and not (only queries appended)."""
    gen = torch.Generator().manual_seed(T + causal)
    L = T if causal else T + 37
    q, k = torch.randn(T, H, 24, generator=gen), torch.randn(L, H, 24, generator=gen)
    v = torch.randn(L, H, 8, generator=gen)
    out, lse = padded(attention_lse_naive, q, k, v, 0.3, causal)
    ref, ref_lse = attention_lse_naive(q, k, v, 0.3, causal)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)
    assert padded_length(T) >= max(T, 64) and padded_length(padded_length(T)) == padded_length(T)


@pytest.mark.parametrize("causal", [True, False])
def test_attention_lse_twin_is_softmax_and_its_normaliser(causal):
    """The twin's output is softmax attention and its lse the log of the softmax's denominator, per query."""
    gen = torch.Generator().manual_seed(int(causal))
    T, L = (6, 6) if causal else (4, 9)
    q, k = torch.randn(T, H, 5, generator=gen), torch.randn(L, H, 5, generator=gen)
    v = torch.randn(L, H, 3, generator=gen)
    out, lse = attention_lse_naive(q, k, v, 0.7, causal)
    for t in range(T):
        visible = t + 1 if causal else L
        scores = torch.einsum("hd,lhd->hl", q[t], k[:visible]) * 0.7
        torch.testing.assert_close(lse[t], scores.logsumexp(-1), **TOL)
        torch.testing.assert_close(out[t], torch.einsum("hl,lhd->hd", scores.softmax(-1), v[:visible]), **TOL)


def test_naive_matches_softmax_attention_written_out():
    """The oracle: one query, keys [k_nope_h ; k_rot] per head, softmax(q.k * scale) over the causal prefix."""
    gen = torch.Generator().manual_seed(9)
    latents = torch.randn(5, R + DR, generator=gen)
    w_kv_b = torch.randn(H * (DN + DV), R, generator=gen) * 0.3
    q_nope, q_rope = torch.randn(1, H, DN, generator=gen), torch.randn(1, H, DR, generator=gen)
    start = 3  # the query sits at position 3: it sees latents 0..3, not 4
    kv = (latents[:, :R] @ w_kv_b.t()).view(5, H, DN + DV)
    expected = []
    for h in range(H):
        keys = torch.cat([kv[: start + 1, h, :DN], latents[: start + 1, R:]], dim=-1)
        probs = torch.softmax(keys @ torch.cat([q_nope[0, h], q_rope[0, h]]) * SCALE, dim=0)
        expected.append(probs @ kv[: start + 1, h, DN:])
    torch.testing.assert_close(naive_mla(q_nope, q_rope, latents, w_kv_b, SCALE, start)[0], torch.stack(expected),
                               **TOL)


@pytest.mark.parametrize("start,num_new,lo,hi", [(0, 5, 0, 5), (37, 5, 0, 37), (37, 5, 30, 42), (37, 5, 37, 42),
                                                 (37, 5, 36, 38), (37, 5, 39, 42), (16, 16, 0, 32),
                                                 (64, 3, 17, 33)])
def test_mla_layer_expands_cached_and_new_positions(start, num_new, lo, hi):
    """The fused prefill's expand (layers/mla.py): keys and values of positions lo..hi-1 from the cache's pages
    before start and from the chunk's own latents after, at ragged edges, as expanding the whole sequence's latents."""
    from helpers.checkpoints import small_model

    from deltaserve.layers.mla import MultiheadLatentAttention

    _, cfg, model = small_model(seed=start + num_new)
    layer = next(m for m in model.modules() if isinstance(m, MultiheadLatentAttention))
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    paged = PagedLatents([start + num_new], width, BLOCK_SIZE, NUM_PAGES, torch.Generator().manual_seed(hi))
    table = paged.block_tables()[0]
    latents = paged.latents[0]
    keys, values = layer._expand_positions(latents[start:], paged.cache, table, start, lo, hi)
    ref_keys, ref_values = layer._expand_keys(latents[lo:hi])
    assert keys.shape[0] == values.shape[0] == hi - lo
    torch.testing.assert_close(keys, ref_keys, rtol=0, atol=0)
    torch.testing.assert_close(values, ref_values, rtol=0, atol=0)
