"""Kimi Delta Attention layer: projections, short conv, gates, the delta rule, gated RMSNorm, output projection."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.config import ModelConfig
from deltaserve.distributed import SINGLE, ParallelConfig, all_reduce
from deltaserve.kernels.conv1d import causal_conv1d_varlen
from deltaserve.kernels.kda import kda_decode_step, kda_prefill
from deltaserve.kernels.norm import gated_rms_norm
from deltaserve.layers.linear import Linear

if TYPE_CHECKING:
    from deltaserve.runner.forward_batch import ForwardBatch


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, parallel: ParallelConfig = SINGLE):
        super().__init__()
        # tensor parallel: this rank's H of the heads (every per-head tensor sharded); f_a, g_a and o_norm
        # replicated; o_proj row-parallel, its partial sums all-reduced
        H, K, D = cfg.kda_num_heads // parallel.world_size, cfg.kda_head_dim, cfg.hidden_size
        self.num_heads, self.head_dim, self.eps, self.parallel = H, K, cfg.rms_norm_eps, parallel
        self.split = [3 * H * K, 2 * K, H]  # in_proj's outputs: q, k, v (the conv's channel order), f_a and g_a, b
        # cuBLAS for one token too: at the 48B shape it took 17.2 us against our GEMV's 17.7 on an H200
        self.in_proj = Linear(D, sum(self.split), gemv=False)
        self.conv_weight = nn.Parameter(torch.empty(3 * H * K, cfg.conv_kernel_size))
        self.fg_b_proj = Linear(K, 2 * H * K)  # f_b_proj's rows, then g_b_proj's: both up-projections, one launch
        self.dt_bias = nn.Parameter(torch.empty(H * K, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(H, dtype=torch.float32))
        self.o_norm_weight = nn.Parameter(torch.ones(K))
        self.o_proj = Linear(H * K, D)

    def cache_shapes(self, cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
        """Per state slot: the last W-1 conv inputs (run dtype) and the recurrent state (float32)."""
        H, K = self.num_heads, self.head_dim
        return {"conv": ((3 * H * K, cfg.conv_kernel_size - 1), "model"), "recurrent": ((H, K, K), "float32")}

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: dict[str, torch.Tensor]) -> torch.Tensor:
        """x [N, D] -> [N, D]; reads and updates the conv and recurrent states of batch.state_slots. The decodes
        come first in the batch: one fused op for them (one kernel on a GPU), the chunked path for the prefills."""
        N, nd = x.shape[0], batch.num_decodes
        qkv, fg_a, b = self.in_proj(x).split(self.split, dim=-1)  # [N, 3HK], [N, 2K], [N, H]
        g_raw, gate = self._gate_up_projections(fg_a, batched=x.is_cuda and nd == N)  # [N, HK] each
        parts = []
        if nd:
            parts.append(kda_decode_step(
                qkv[:nd], self.conv_weight, cache["conv"], g_raw[:nd], b[:nd], gate[:nd], self.dt_bias, self.A_log,
                self.o_norm_weight, self.eps, cache["recurrent"], batch.state_slots[:nd], self.head_dim ** -0.5))
        if N > nd:
            parts.append(self._prefill(qkv[nd:], g_raw[nd:], b[nd:], gate[nd:], batch, cache))
        o = parts[0] if len(parts) == 1 else torch.cat(parts)  # [N, HK], gated and normalised
        return all_reduce(self.o_proj(o), self.parallel)

    def _prefill(self, qkv, g_raw, b_raw, gate, batch: ForwardBatch, cache: dict[str, torch.Tensor]) -> torch.Tensor:
        """The prefill chunks of the step (packed after the decodes) -> gated_rms_norm(o) [n, HK]."""
        n, nd, H, K = qkv.shape[0], batch.num_decodes, self.num_heads, self.head_dim
        slots, cu_seqlens = batch.state_slot_list[nd:], batch.prefill_cu_seqlens()
        qkv = causal_conv1d_varlen(qkv, self.conv_weight, cache["conv"], slots, cu_seqlens).view(n, 3, H, K)
        o = kda_prefill(qkv[:, 0], qkv[:, 1], qkv[:, 2], g_raw, b_raw, self.dt_bias, self.A_log, cache["recurrent"],
                        slots, cu_seqlens, self.head_dim ** -0.5)
        return gated_rms_norm(o.to(qkv.dtype), gate.view(n, H, K), self.o_norm_weight, self.eps).view(n, H * K)

    def _gate_up_projections(self, fg_a: torch.Tensor, batched: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, 2K] (f_a, g_a) -> (f_b_proj(f_a), g_b_proj(g_a)), each [N, HK]. batched (GPU decode steps, bound by
        launches): one launch, our GEMV with two groups for one half-precision token (cuBLAS's batched matmul took
        3.4 us for these 2 MB on an H200), else one batched matmul. Otherwise two products: on the CPU they give the
        reference's bits in float32; steps with prefill keep them as measured (BENCHMARKS.md: an A/B on the H200
        left prefill's slowdown with the decode-step changes unexplained, so prefill runs the code it ran before)."""
        N, K = fg_a.shape[0], self.head_dim
        w = self.fg_b_proj.weight.view(2, -1, K)
        if batched:
            from deltaserve.kernels.gemv import gemv, groups_fit, use_gemv  # batched: on a GPU (Triton)

            if use_gemv(fg_a, self.fg_b_proj.weight, min_weight=0) and groups_fit(w.shape[1]):
                out = gemv(fg_a, self.fg_b_proj.weight, groups=2)  # [N, 2HK]
                return out[:, : w.shape[1]], out[:, w.shape[1]:]
            out = torch.bmm(fg_a.view(N, 2, K).transpose(0, 1), w.transpose(1, 2))  # [2, N, HK]
            return out[0], out[1]
        return F.linear(fg_a[:, :K], w[0]), F.linear(fg_a[:, K:], w[1])
