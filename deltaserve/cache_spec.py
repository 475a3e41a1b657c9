"""Per-layer cache specs: what each decoder layer keeps between steps, one typed spec per layer kind.

The model declares them (KimiLinearForCausalLM.cache_specs), cache/sizing prices them into a plan and the runner
allocates them: one description for both. An MLA layer keeps a paged latent (a page is block_size tokens ×
latent_dim values in the run dtype; pages are shared by all MLA layers, one block id addressing the page of each),
a KDA layer a fixed state per request slot (the short-conv tails of q, k and v in the run dtype, and the float32
recurrent state; slots are shared by all KDA layers)."""

from __future__ import annotations

from dataclasses import dataclass

from deltaserve.config import KDA, ModelConfig

RECURRENT_STATE_BYTES = 4  # the KDA state is float32 whatever the run dtype


@dataclass(frozen=True)
class MLAPageSpec:
    """An MLA layer's paged latent cache: latent_dim values a cached token (c_kv 512 + k_rot 64 at the 48B shape)."""

    latent_dim: int

    def page_bytes(self, block_size: int, dtype_bytes: int) -> int:
        return block_size * self.latent_dim * dtype_bytes


@dataclass(frozen=True)
class KDAStateSpec:
    """A KDA layer's state a request slot: conv tails in the run dtype, the recurrent state in float32."""

    conv_shape: tuple[int, int]  # (3 * heads * head_dim: q, k and v each run their own conv, conv_kernel_size - 1)
    recurrent_shape: tuple[int, int, int]  # (heads, head_dim, head_dim)

    def slot_bytes(self, dtype_bytes: int) -> int:
        conv, recurrent = self.conv_shape, self.recurrent_shape
        return conv[0] * conv[1] * dtype_bytes + recurrent[0] * recurrent[1] * recurrent[2] * RECURRENT_STATE_BYTES


def layer_cache_specs(cfg: ModelConfig, world_size: int = 1) -> list[MLAPageSpec | KDAStateSpec]:
    """One spec per decoder layer, in layer order. world_size: tensor-parallel ranks, each holding its share of the
    KDA heads (MLA's latent is one for all heads, kept whole on every rank)."""
    H, K = cfg.kda_num_heads // world_size, cfg.kda_head_dim
    kda = KDAStateSpec((3 * H * K, cfg.conv_kernel_size - 1), (H, K, K))
    return [kda if layer_type == KDA else MLAPageSpec(cfg.latent_dim) for layer_type in cfg.layer_types]
