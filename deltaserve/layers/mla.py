"""NoPE Multi-head Latent Attention: caches the normalised latent c_kv and the shared key k_rot per token."""

from __future__ import annotations

import functools

import torch
from torch import nn

from deltaserve.config import ModelConfig
from deltaserve.distributed import SINGLE, ParallelConfig, all_reduce
from deltaserve.forward_batch import ForwardBatch
from deltaserve.kernel_options import KernelOptions
from deltaserve.kernels.cache_ops import to_latent_cache, write_latents
from deltaserve.kernels.mla import (
    expand_keys,
    gather_latents,
    merge_blocks,
    mla_decode,
    mla_prefill,
    mla_prefill_block,
    mla_prefill_fused,
)
from deltaserve.kernels.norm import rms_norm
from deltaserve.layers.linear import Linear

# Prefill expands the context's latents into per-head keys and values: ~28 KB a token a layer at the 48B shape in
# bf16, so 256k keys fit beside the weights and the cache, 1M would not. Longer contexts go a block of keys at a time.
EXPANDED_PREFILL_MAX_KEYS = 262_144
PREFILL_KEY_BLOCK = 2048  # keys a block: its float32 scores are [H, T, block], 2 GB for a chunk of 8k at 32 heads
# Half precision on a GPU runs fused kernels that keep no scores: a block of cached keys is then bounded by its
# expanded keys and values (~40 KB a token at the 48B shape with the values padded for flash: ~2.6 GB a block).
FUSED_PREFILL_KEY_BLOCK = 65_536


class MultiheadLatentAttention(nn.Module):
    kernels = KernelOptions()  # the engine's choice, set on the built model (KimiLinearForCausalLM.set_kernel_options)

    def __init__(self, cfg: ModelConfig, parallel: ParallelConfig = SINGLE):
        super().__init__()
        # tensor parallel: this rank's H of the heads (q, kv_b_proj); the latent (kv_a, its norm, the cache)
        # replicated; o_proj row-parallel, its partial sums all-reduced
        H, D, R = cfg.num_attention_heads // parallel.world_size, cfg.hidden_size, cfg.kv_lora_rank
        self.num_heads, self.kv_lora_rank, self.parallel = H, R, parallel
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.scale = cfg.qk_head_dim ** -0.5
        self.kv_norm_eps = cfg.kv_a_layernorm_eps
        self.split = [H * cfg.qk_head_dim, R + self.rope_dim]  # in_proj's outputs: q, then c_kv and k_rot
        self.in_proj = Linear(D, sum(self.split))
        self.kv_a_norm_weight = nn.Parameter(torch.ones(R))
        self.kv_b_proj = Linear(R, H * (self.nope_dim + self.v_dim))
        self.o_proj = Linear(H * self.v_dim, D)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: dict[str, torch.Tensor]) -> torch.Tensor:
        """x [N, D] -> [N, D]; writes this step's latents, then attends over each sequence's cached ones."""
        return self.forward_projected(self.in_proj(x), batch, cache)

    def forward_projected(self, projected: torch.Tensor, batch: ForwardBatch,
                          cache: dict[str, torch.Tensor]) -> torch.Tensor:
        """forward() from in_proj's output [N, sum(split)] (the decoder layer may fuse its norm into in_proj)."""
        N, nd, H, R = projected.shape[0], batch.num_decodes, self.num_heads, self.kv_lora_rank
        q, ckv = projected.split(self.split, dim=-1)  # [N, H*(Dn+Dr)], [N, R+Dr]
        q = q.view(N, H, self.nope_dim + self.rope_dim)
        latents = torch.cat([rms_norm(ckv[:, :R], self.kv_a_norm_weight, self.kv_norm_eps), ckv[:, R:]], dim=-1)
        write_latents(cache["latent"], batch.slot_mapping, latents)
        if nd == 0 and batch.num_seqs == 1:  # one prompt's chunk: its attention output is the layer's, no copy
            out = self._prefill(q, latents, cache["latent"], batch.block_tables[0], batch.start_positions[0])
        else:
            out = projected.new_empty(N, H, self.v_dim)
            if nd:
                out[:nd] = self._decode(q[:nd], batch, cache["latent"])
            row = nd
            for i in range(nd, batch.num_seqs):
                n, start = batch.query_lens[i], batch.start_positions[i]
                out[row: row + n] = self._prefill(q[row: row + n], latents[row: row + n], cache["latent"],
                                                  batch.block_tables[i], start)
                row += n
        return all_reduce(self.o_proj(out.reshape(N, H * self.v_dim)), self.parallel)

    def _decode(self, q: torch.Tensor, batch: ForwardBatch, cache: torch.Tensor) -> torch.Tensor:
        """Absorbed: q [B, H, Dn+Dr]: q_nope -> latent query [B, H, R]; attended latent -> values [B, H, Dv]."""
        nd = q.shape[0]
        q_nope, q_rope = q[..., : self.nope_dim], q[..., self.nope_dim:]
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        q_latent = (q_nope.transpose(0, 1) @ w[:, : self.nope_dim]).transpose(0, 1)  # per head: [B, Dn] @ [Dn, R]
        o_latent = mla_decode(q_latent, q_rope, cache, batch.block_tables[:nd], batch.context_lens[:nd], self.scale,
                              self.kernels.pdl)
        return (o_latent.transpose(0, 1) @ w[:, self.nope_dim:].transpose(1, 2)).transpose(0, 1)  # [B, H, Dv]

    def _prefill(self, q: torch.Tensor, new_latents: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                 start: int) -> torch.Tensor:
        """Expanded: the chunk's queries q [T, H, Dn+Dr] (a view of in_proj's output), its latents [T, R+Dr] and the
        start cached ones -> per-head keys and values, causal attention from position start. Half precision on a
        GPU: fused kernels, taking q as it lies, the cached keys gathered and expanded FUSED_PREFILL_KEY_BLOCK at a
        time. Otherwise (the exact regime: the reference's order of operations) one softmax over all keys, or past
        EXPANDED_PREFILL_MAX_KEYS of context, the keys expanded and attended PREFILL_KEY_BLOCK at a time."""
        if q.is_cuda and q.dtype != torch.float32:
            if cache.dtype == torch.float8_e4m3fn:  # the chunk's own keys as the cache keeps them, as every later
                new_latents = to_latent_cache(new_latents).to(q.dtype)  # step and the CPU path read them
            expand = functools.partial(self._expand_positions, new_latents, cache, block_table, start)
            return mla_prefill_fused(q, expand, self.scale, start, FUSED_PREFILL_KEY_BLOCK)
        q_nope, q_rope = q[..., : self.nope_dim], q[..., self.nope_dim:]
        latents = gather_latents(cache, block_table, start + q_nope.shape[0], dtype=q_nope.dtype)
        if latents.shape[0] > EXPANDED_PREFILL_MAX_KEYS:
            return self._prefill_blockwise(q_nope, q_rope, latents, start)
        k_nope, k_rope, v = self._expand(latents)
        return mla_prefill(q_nope, q_rope, k_nope, k_rope, v, self.scale, start)

    def _expand_positions(self, new_latents: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, start: int,
                          lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """_expand_keys of the sequence's positions lo..hi-1: those before start gathered from the cache's pages, the
        chunk's own (start onwards) from new_latents [T, R+Dr]."""
        parts = [gather_latents(cache, block_table, min(hi, start), lo, new_latents.dtype)] if lo < start else []
        if hi > start:
            parts.append(new_latents[max(lo - start, 0): hi - start])
        return self._expand_keys(parts[0] if len(parts) == 1 else torch.cat(parts))

    def _prefill_blockwise(self, q_nope, q_rope, latents: torch.Tensor, start: int) -> torch.Tensor:
        """_prefill with memory for one block of keys: each block's softmax apart, merged by log-sum-exp."""
        out = lse = None
        for key_pos in range(0, latents.shape[0], PREFILL_KEY_BLOCK):
            block = mla_prefill_block(q_nope, q_rope, *self._expand(latents[key_pos: key_pos + PREFILL_KEY_BLOCK]),
                                      self.scale, start, key_pos)
            out, lse = block if out is None else merge_blocks(out, lse, *block)
        return out.to(q_nope.dtype)

    def _expand_keys(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latents [L, R+Dr] -> (keys [L, H, Dn+Dr]: k_nope beside the shared k_rope, values [L, H, Dv])."""
        k_nope, k_rope, v = self._expand(latents)
        return expand_keys(k_nope, k_rope), v

    def _expand(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """latents [L, R+Dr] -> (k_nope [L, H, Dn], k_rope [L, Dr], v [L, H, Dv])."""
        kv = self.kv_b_proj(latents[:, : self.kv_lora_rank]).view(latents.shape[0], self.num_heads, -1)
        return kv[..., : self.nope_dim], latents[:, self.kv_lora_rank:], kv[..., self.nope_dim:]
