"""Kimi-Linear: pre-norm decoder layers of KDA or NoPE MLA attention, each followed by a dense MLP or a MoE.

    x = embed(input_ids)                        # [N, D], N = new tokens of all sequences in the step
    for each layer:  x += attn(rms(x));  x += mlp(rms(x))
    logits = lm_head(rms(x))                    # only at the positions the sampler needs"""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.cache_spec import KDAStateSpec, MLAPageSpec, layer_cache_specs
from deltaserve.config import KDA, MOE, ModelConfig
from deltaserve.distributed import SINGLE, ParallelConfig
from deltaserve.forward_batch import ForwardBatch
from deltaserve.kernel_options import KernelOptions
from deltaserve.layers import linear
from deltaserve.layers.kda import KimiDeltaAttention
from deltaserve.layers.linear import Linear
from deltaserve.layers.mla import MultiheadLatentAttention
from deltaserve.layers.moe import MoE, SwiGLU
from deltaserve.layers.norm import RMSNorm


class DecoderLayer(nn.Module):
    kernels = KernelOptions()  # the engine's choice, set on the built model (KimiLinearForCausalLM.set_kernel_options)

    def __init__(self, cfg: ModelConfig, layer_id: int, parallel: ParallelConfig = SINGLE):
        super().__init__()
        self.is_kda = cfg.layer_types[layer_id] == KDA
        attn = KimiDeltaAttention if self.is_kda else MultiheadLatentAttention
        self.self_attn = attn(cfg, parallel)
        self.mlp = (MoE(cfg, parallel) if cfg.mlp_types[layer_id] == MOE
                    else SwiGLU(cfg.hidden_size, cfg.intermediate_size, parallel))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch,
                cache: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output (the embedding for layer 0, with residual None); residual: the stream
        before it. Returns this layer's (MLP output, stream before it); adds are fused into the next norm."""
        projected, residual = linear.norm_then_project(self.input_layernorm, self.self_attn.in_proj, x, residual,
                                                      self.kernels)
        attn = self.self_attn.forward_projected(projected, batch, cache)
        return self.mlp.forward_normed(attn, residual, self.post_attention_layernorm, batch.in_graph)


class KimiLinearForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, parallel: ParallelConfig = SINGLE):
        """parallel: this rank's shard of a tensor-parallel model; the embedding, norms and lm_head are replicated,
        so every rank ends a step with the same logits."""
        super().__init__()
        self.cfg, self.world_size = cfg, parallel.world_size
        # from an empty tensor: Embedding's own random init on the meta device imports torch._dynamo (a second)
        self.embed_tokens = nn.Embedding.from_pretrained(torch.empty(cfg.vocab_size, cfg.hidden_size), freeze=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, parallel) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, gemv=False)  # cuBLAS streams it faster
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def set_kernel_options(self, options: KernelOptions) -> None:
        """The engine's kernel choices, on every layer that makes one, and the routers' GEMM, which depends on their
        weights (MoE.choose_router_gemm): once, after the weights are loaded."""
        for module in self.modules():
            if isinstance(getattr(type(module), "kernels", None), KernelOptions):
                module.kernels = options
            if isinstance(module, MoE):
                module.choose_router_gemm()

    def cache_specs(self) -> list[MLAPageSpec | KDAStateSpec]:
        """Per layer, what its cache holds (this rank's share of it): KDA a state a request slot, MLA a paged latent."""
        return layer_cache_specs(self.cfg, self.world_size)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, caches: list[dict[str, torch.Tensor]]):
        """input_ids [N] -> final hidden states [N, D] (normalised); caches[i] is layer i's cache tensors."""
        x, residual = self.embed_tokens(input_ids), None
        for layer, cache in zip(self.layers, caches):
            x, residual = layer(x, residual, batch, cache)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, D] -> logits [M, V] float32."""
        return self.lm_head(hidden).float()
