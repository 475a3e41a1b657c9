"""The feed-forward blocks: dense SwiGLU and the routed MoE with its shared expert."""

from collections.abc import Callable

import torch
from torch import nn

from deltaserve.config import ModelConfig
from deltaserve.distributed import SINGLE, ParallelConfig, all_reduce
from deltaserve.kernel_options import KernelOptions
from deltaserve.kernels import cpu_gemv
from deltaserve.kernels.activation import silu_and_mul
from deltaserve.kernels.moe import fused_experts, select_experts
from deltaserve.kernels.moe.experts import FEW_ASSIGNMENTS_GPU
from deltaserve.kernels.quant import FP8, fp8_fused_experts
from deltaserve.kernels.quant.experts import MAX_PAIRS_PER_PAIR_GEMV
from deltaserve.layers import linear
from deltaserve.layers.linear import Linear
from deltaserve.layers.norm import RMSNorm


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up stacked in one projection [2I, D]. Tensor parallel: this rank's
    I / world_size of the intermediate dim (gate_up column-parallel, down row-parallel); the partial sums are
    all-reduced unless reduce is False (the shared expert, reduced with the routed experts in one go)."""

    def __init__(self, hidden_size: int, intermediate_size: int, parallel: ParallelConfig = SINGLE,
                 reduce: bool = True):
        super().__init__()
        intermediate_size //= parallel.world_size
        self.parallel, self.reduce = parallel, reduce
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size)
        self.down_proj = Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(silu_and_mul(self.gate_up_proj(x)))
        return all_reduce(out, self.parallel) if self.reduce else out

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm,
                       in_graph: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(h), s) for (h, s) = norm(x, residual): the decoder layer's post-attention norm, then this block
        (in_graph: MoE's; the same kernels here either way)."""
        h, residual = norm(x, residual)
        return self(h), residual


class MoE(nn.Module):
    kernels = KernelOptions()  # the engine's choice, set on the built model (KimiLinearForCausalLM.set_kernel_options)

    def __init__(self, cfg: ModelConfig, parallel: ParallelConfig = SINGLE):
        super().__init__()
        E, D, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        # tensor parallel: every expert's intermediate dim split; expert parallel: this rank's experts, whole
        self.first_expert, local_experts = parallel.split(E) if parallel.expert_parallel else (0, E)
        I = I if parallel.expert_parallel else I // parallel.world_size
        self.cfg, self.parallel = cfg, parallel
        self.gate_weight = nn.Parameter(torch.empty(E, D, dtype=torch.float32))  # router stays float32
        self.e_score_correction_bias = nn.Parameter(torch.zeros(E, dtype=torch.float32))
        self.w13 = nn.Parameter(torch.empty(local_experts, 2 * I, D))  # per expert: gate (w1) rows, then up (w3)
        self.w2 = nn.Parameter(torch.empty(local_experts, D, I))
        self.shared_experts = (SwiGLU(D, cfg.moe_intermediate_size * cfg.num_shared_experts, parallel, reduce=False)
                               if cfg.num_shared_experts else None)
        # called with each step's chosen expert ids [N, k] (all experts' ids) when set: bench's routing statistics
        self.routing_observer: Callable[[torch.Tensor], None] | None = None
        self._router_bf16: torch.Tensor | None = None  # choose_router_gemm's

    def forward(self, x: torch.Tensor, in_graph: bool = False) -> torch.Tensor:
        """x [N, D] -> routed experts (scaled) + shared expert (unscaled), [N, D]. in_graph: ForwardBatch.in_graph."""
        return self._route_and_run(x, self._router_logits(x), in_graph)

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm,
                       in_graph: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(h), s) for (h, s) = norm(x, residual): the decoder layer's post-attention norm, then this block.
        Where the router's GEMV serves the step (a few half-precision tokens on a GPU, one process: _router_gemv),
        the norm runs inside it (kernels.norm_gemv: one launch less a layer), which also stores h for the experts."""
        fused = linear.norm_gemv_kernels(x, self.kernels)
        if fused is not None and self.parallel.world_size == 1 \
                and fused.fits(x, norm.weight, self.gate_weight, fused.ROUTER_NORM_MAX_TOKENS, residual):
            logits, residual, h = fused.add_norm_gemv(x, residual, norm.weight, norm.eps, self.gate_weight,
                                                      store_normed=True, pdl=self.kernels.pdl)
            return self._route_and_run(h, logits, in_graph), residual
        h, residual = norm(x, residual)
        return self(h, in_graph), residual

    def _route_and_run(self, x: torch.Tensor, logits: torch.Tensor, in_graph: bool) -> torch.Tensor:
        """x [N, D] and its router logits [N, E] float32 -> the block's output [N, D]."""
        cfg = self.cfg
        weights, ids = select_experts(logits, self.e_score_correction_bias.float(), cfg.num_experts_per_token,
                                      cfg.num_expert_group, cfg.topk_group, cfg.moe_renormalize,
                                      cfg.routed_scaling_factor, exact=x.dtype == torch.float32,
                                      pdl=self.kernels.pdl)
        if self.routing_observer is not None:
            self.routing_observer(ids)
        shared = self._shared_in_decode_kernels(x, ids)
        if shared is not None:  # the shared expert as one more slot of the routed experts' kernels
            from deltaserve.kernels.moe.triton_decode import decode_experts

            scales = (self.w13_scale_inv, self.w2_scale_inv, self.block) if self.w13.dtype == FP8 else ()
            return all_reduce(decode_experts(x, self.w13, self.w2, weights, ids, *scales, shared=shared,
                                             pdl=self.kernels.pdl), self.parallel)
        out = self._local_experts(x, weights, ids, in_graph) if self.parallel.expert_parallel else self._experts(
            x, weights, ids, in_graph)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return all_reduce(out, self.parallel)

    def _router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] -> router logits [N, E], in float32 whatever x's dtype (the reference's router)."""
        if self._router_gemv(x):
            from deltaserve.kernels.moe.triton_routing import router_logits

            return router_logits(x, self.gate_weight, pdl=self.kernels.pdl)
        if x.dtype == torch.bfloat16 and self._router_bf16 is not None:  # choose_router_gemm's copy (a GPU)
            return torch.mm(x, self._router_bf16.t(), out_dtype=torch.float32)
        # F.linear where cpu_gemv does not serve
        return cpu_gemv.linear(x.float(), self.gate_weight.float(), linear.cpu_gemv_threads(self.kernels))

    def choose_router_gemm(self) -> None:
        """Once the weights are loaded (KimiLinearForCausalLM.set_kernel_options): keep a bfloat16 copy of the
        router's float32 weights where it holds them exactly (a checkpoint stored in bfloat16, the published config's
        torch_dtype, upcast at load; dummy weights are drawn so), on a GPU. Then a bf16 x's logits come from a
        tensor-core GEMM with float32 output, each product exact as in float32 and accumulated in float32 (in another
        order than the float32 GEMM, which runs on CUDA cores, ~9x slower at an 8k prefill chunk: BENCHMARKS.md, stop
        51). Weights changed later need this called again. Not for float16 models (their activations are not bf16)."""
        weight = self.gate_weight.detach()
        self._router_bf16 = None
        if weight.is_cuda and self.w13.dtype != torch.float16:
            as_bf16 = weight.bfloat16()
            self._router_bf16 = as_bf16 if torch.equal(as_bf16.float(), weight) else None

    def _router_gemv(self, x: torch.Tensor) -> bool:
        """Whether the router's logits come from our GEMV kernel: a few half-precision tokens on a GPU, one process
        only (ranks autotune the kernel apart, and a different summation order could tip a near-tie of the top-k one
        way on one rank and the other way on another)."""
        if not x.is_cuda or x.dtype == torch.float32 or self.parallel.world_size > 1:
            return False
        from deltaserve.kernels.moe.triton_routing import ROUTER_GEMV_MAX_TOKENS  # Triton

        return x.shape[0] <= ROUTER_GEMV_MAX_TOKENS

    def _shared_in_decode_kernels(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """The shared expert's weights (gate_up, down; with FP8, then their block scales) where the few-token GPU
        kernels can run it with the routed experts: a step of few enough pairs, in half precision (float32 keeps its
        own products), the same shapes, dtypes and blocks, every expert on this rank. None otherwise."""
        shared, fp8 = self.shared_experts, self.w13.dtype == FP8
        most_pairs = MAX_PAIRS_PER_PAIR_GEMV if fp8 else FEW_ASSIGNMENTS_GPU
        if (shared is None or not x.is_cuda or x.dtype == torch.float32 or ids.numel() > most_pairs
                or self.parallel.expert_parallel):
            return None
        gate_up, down = shared.gate_up_proj, shared.down_proj
        if ((gate_up.weight.dtype, down.weight.dtype) != (self.w13.dtype, self.w2.dtype)
                or (gate_up.weight.shape, down.weight.shape) != (self.w13.shape[1:], self.w2.shape[1:])):
            return None
        if not fp8:
            return gate_up.weight, down.weight
        if (gate_up.block, down.block) != (self.block, self.block):
            return None
        return gate_up.weight, down.weight, gate_up.weight_scale_inv, down.weight_scale_inv

    def _local_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, in_graph: bool) -> torch.Tensor:
        """Expert parallel: the contributions of this rank's experts only, [N, D] (zero rows for tokens that chose
        none of them); weights, ids [N, k] over all experts."""
        local_ids = ids - self.first_expert
        rows, slots = ((local_ids >= 0) & (local_ids < self.w13.shape[0])).nonzero(as_tuple=True)
        out = torch.zeros_like(x)
        if rows.numel():
            y = self._experts(x[rows], weights[rows, slots, None], local_ids[rows, slots, None], in_graph)
            out.index_add_(0, rows, y)
        return out

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, in_graph: bool) -> torch.Tensor:
        """The routed experts' weighted sum, [N, D]; ids index this rank's experts. FP8 weights (layers/fp8.py
        swaps them in, with w13_scale_inv, w2_scale_inv and the block size) go through their own kernels."""
        if self.w13.dtype == FP8:
            return fp8_fused_experts(x, self.w13, self.w13_scale_inv, self.w2, self.w2_scale_inv, weights, ids,
                                     self.block, linear.cpu_gemv_threads(self.kernels), in_graph, self.kernels.pdl)
        return fused_experts(x, self.w13, self.w2, weights, ids, linear.cpu_gemv_threads(self.kernels),
                             self.kernels.pdl)
