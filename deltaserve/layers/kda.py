"""Kimi Delta Attention layer: projections, short conv, gates, the delta rule, gated RMSNorm, output projection."""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.config import ModelConfig
from deltaserve.distributed import SINGLE, ParallelConfig, all_reduce
from deltaserve.forward_batch import ForwardBatch
from deltaserve.kernel_options import KernelOptions
from deltaserve.kernels import cpu_gemv
from deltaserve.kernels.conv1d import causal_conv1d_update, causal_conv1d_varlen, conv_states_at
from deltaserve.kernels.kda import kda_decode, kda_prefill
from deltaserve.kernels.norm import gated_rms_norm
from deltaserve.layers import linear
from deltaserve.layers.linear import Linear


class KimiDeltaAttention(nn.Module):
    kernels = KernelOptions()  # the engine's choice, set on the built model (KimiLinearForCausalLM.set_kernel_options)

    def __init__(self, cfg: ModelConfig, parallel: ParallelConfig = SINGLE):
        super().__init__()
        # tensor parallel: this rank's H of the heads (every per-head tensor sharded); f_a, g_a and o_norm
        # replicated; o_proj row-parallel, its partial sums all-reduced
        H, K, D = cfg.kda_num_heads // parallel.world_size, cfg.kda_head_dim, cfg.hidden_size
        self.num_heads, self.head_dim, self.eps, self.parallel = H, K, cfg.rms_norm_eps, parallel
        self.split = [3 * H * K, 2 * K, H]  # in_proj's outputs: q, k, v (the conv's channel order), f_a and g_a, b
        # cuBLAS for one token too, as fast as our GEMV at this shape (but the decoder layer runs it with the input
        # norm inside, kernels.norm_gemv, where that serves)
        self.in_proj = Linear(D, sum(self.split), gemv=False)
        self.conv_weight = nn.Parameter(torch.empty(3 * H * K, cfg.conv_kernel_size))
        self.fg_b_proj = Linear(K, 2 * H * K)  # f_b_proj's rows, then g_b_proj's: both up-projections, one launch
        self.dt_bias = nn.Parameter(torch.empty(H * K, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(H, dtype=torch.float32))
        self.o_norm_weight = nn.Parameter(torch.ones(K))
        self.o_proj = Linear(H * K, D)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: dict[str, torch.Tensor]) -> torch.Tensor:
        """x [N, D] -> [N, D]; reads and updates the conv and recurrent states of batch.state_slots."""
        return self.forward_projected(self.in_proj(x), batch, cache)

    def forward_projected(self, projected: torch.Tensor, batch: ForwardBatch,
                          cache: dict[str, torch.Tensor]) -> torch.Tensor:
        """forward() from in_proj's output [N, sum(split)] (the decoder layer may fuse its norm into in_proj)."""
        N, nd, H, K = projected.shape[0], batch.num_decodes, self.num_heads, self.head_dim
        qkv, fg_a, b = projected.split(self.split, dim=-1)  # [N, 3HK], [N, 2K], [N, H]
        decodes = prefills = None  # (q, k, v) [n, H, K] each, after the conv
        if nd:
            decodes = causal_conv1d_update(qkv[:nd], self.conv_weight, cache["conv"], batch.state_slots[:nd],
                                           self.kernels.pdl).view(nd, 3, H, K).unbind(1)
        if N > nd:
            prefills = self._prefill_conv(qkv[nd:], batch, cache).unflatten(-1, (H, K)).unbind(1)
        g_raw, gate = self._gate_up_projections(fg_a, batched=projected.is_cuda and nd == N)
        o = self._delta_rule(decodes, prefills, g_raw, b, batch, cache)
        return all_reduce(self._gated_norm_out(o, gate), self.parallel)

    def _prefill_conv(self, qkv: torch.Tensor, batch: ForwardBatch, cache: dict[str, torch.Tensor]) -> torch.Tensor:
        """The prefill tokens' short conv, [Np, 3, HK]: q, k and v each contiguous on a GPU (conv1d's groups), as
        fla-core's kernel takes them without a copy. A snapshot split's conv states at its save positions go to
        their snapshot slots first: the conv itself runs the step whole."""
        split = batch.snapshot_split
        if split is not None:
            conv_states_at(qkv, cache["conv"], cache["conv_snapshots"], split.state_slots, split.snapshot_slots,
                           split.starts, split.cuts)
        return causal_conv1d_varlen(qkv, self.conv_weight, cache["conv"], batch.state_slot_list[batch.num_decodes:],
                                    batch.prefill_cu_seqlens(), batch.prefill, groups=3)

    def _gated_norm_out(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """o [N, H, K], gate [N, H*K] -> o_proj(gated_rms_norm(o, gate)); for one token on a GPU in one kernel
        (kernels.norm_gemv: the norm inside o_proj's GEMV, one launch less a layer)."""
        N, H, K = o.shape
        fused = linear.norm_gemv_kernels(o, self.kernels)
        weight = linear.gemv_weight(self.o_proj, o)
        if fused is not None and weight is not None and fused.MAX_HEAD % K == 0 \
                and fused.fits(o, self.o_norm_weight, weight["weight"], fused.NORM_GEMV_MAX_TOKENS, gate):
            return fused.gated_norm_gemv(o, gate, self.o_norm_weight, self.eps, **weight, pdl=self.kernels.pdl)
        return self.o_proj(gated_rms_norm(o, gate.view(N, H, K), self.o_norm_weight, self.eps).view(N, H * K))

    def _gate_up_projections(self, fg_a: torch.Tensor, batched: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, 2K] (f_a, g_a) -> (f_b_proj(f_a), g_b_proj(g_a)), each [N, HK]. batched (GPU decode steps, bound by
        launches): one launch, our GEMV with two groups for one half-precision token (faster than cuBLAS's batched
        matmul), else one batched matmul. Otherwise two products (kernels.cpu_gemv's for a few float32 tokens on the
        CPU, else F.linear, the reference's), which steps with prefill take too (BENCHMARKS.md)."""
        N, K = fg_a.shape[0], self.head_dim
        w = self.fg_b_proj.weight.view(2, -1, K)
        if batched:
            from deltaserve.kernels.gemv import gemv, groups_fit, use_gemv  # batched: on a GPU (Triton)

            if use_gemv(fg_a, self.fg_b_proj.weight, min_weight=0) and groups_fit(w.shape[1]):
                out = gemv(fg_a, self.fg_b_proj.weight, groups=2, pdl=self.kernels.pdl)  # [N, 2HK]
                return out[:, : w.shape[1]], out[:, w.shape[1]:]
            out = torch.bmm(fg_a.view(N, 2, K).transpose(0, 1), w.transpose(1, 2))  # [2, N, HK]
            return out[0], out[1]
        threads = linear.cpu_gemv_threads(self.kernels)
        return cpu_gemv.linear(fg_a[:, :K], w[0], threads), cpu_gemv.linear(fg_a[:, K:], w[1], threads)

    def _delta_rule(self, decodes, prefills, g_raw, b_raw, batch: ForwardBatch,
                    cache: dict[str, torch.Tensor]) -> torch.Tensor:
        """decodes, prefills: (q, k, v) [n, H, K] raw, of the decode tokens and of the prefill tokens (None where the
        step has none); g_raw [N, H*K]; b_raw [N, H] -> o [N, H, V] in the layer's dtype (each part rounded once
        from what its kernel returns)."""
        nd, scale = batch.num_decodes, self.head_dim ** -0.5
        params, state = (self.dt_bias, self.A_log), cache["recurrent"]
        dtype = (decodes or prefills)[2].dtype
        if prefills is None:
            o = kda_decode(*decodes, g_raw, b_raw, *params, state, batch.state_slots, scale, self.kernels.pdl)
            return o.to(dtype)

        def prefill_pass(seqs, *qkvgb):  # seqs: (state slots, cu_seqlens, packed)
            return kda_prefill(*qkvgb, *params, state, seqs[0], seqs[1], scale, seqs[2], self.kernels.pdl)

        prefill = _prefill_passes(prefill_pass, (*prefills, g_raw[nd:], b_raw[nd:]), batch, cache, "recurrent")
        if decodes is None:
            return prefill.to(dtype)
        o = torch.empty(g_raw.shape[0], *prefill.shape[1:], dtype=dtype, device=prefill.device)
        o[nd:] = prefill  # the decodes' and the prefills' state slots are disjoint: either may run first
        o[:nd] = kda_decode(*decodes, g_raw[:nd], b_raw[:nd], *params, state, batch.state_slots[:nd], scale,
                            self.kernels.pdl)
        return o


def _prefill_passes(run, inputs: tuple[torch.Tensor, ...], batch: ForwardBatch, cache: dict[str, torch.Tensor],
                    name: str) -> torch.Tensor:
    """run((state slots, cu_seqlens, packed), *inputs) over the step's prefill tokens (inputs: per-token tensors of
    those), updating the state `name` of their slots. With a snapshot split, in its two passes, each split
    sequence's state copied into its snapshot slot (cache[name + "_snapshots"]) between them (the two passes'
    packed sequences are the split's own, not batch.prefill)."""
    split = batch.snapshot_split
    if split is None:
        return run((batch.state_slot_list[batch.num_decodes:], batch.prefill_cu_seqlens(), batch.prefill), *inputs)
    outs = []
    for part in (split.heads, split.tails):
        if outs:  # the heads have run: the split sequences' states stand at their save positions
            cache[name + "_snapshots"][split.snapshot_slots] = cache[name][split.state_slots]
        outs.append(run((part.state_slots, part.cu_seqlens, part.packed), *(x[part.rows] for x in inputs)))
    out = torch.cat(outs)
    return out if split.inverse is None else out[split.inverse]
