"""Which experts a run's decode steps chose: distinct experts per MoE layer per step and the busiest expert's load.

bench sizes a decode step's floor from these (the routed experts a step reads are the distinct ones its tokens
chose), so a model whose router picks a few experts for every token (as badly initialised dummy weights do) gets
the lower floor it earns instead of one that assumes uniform routing."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from deltaserve.layers.moe import MoE


@dataclass
class RoutingStats:
    distinct_experts: float  # mean over decode steps and MoE layers of the distinct experts a step's tokens chose
    busiest_expert_load: float  # over all recorded steps, the busiest expert's picks over the mean picks per expert
    # (the largest over MoE layers)
    tokens_per_step: float  # tokens routed per MoE layer per step (the batch, where no padding row was counted)
    num_steps: int  # decode steps recorded (MoE calls over MoE layers)


class RoutingRecorder:
    """Counts each MoE layer's chosen experts while entered: one [E] count a layer per forward, kept on the device
    (torch.bincount syncs on a GPU to size its output: the counting runs only in bench's untimed rerun). Enter it only
    around steps whose every row is a real token of a decode step (ModelRunner.eager: no CUDA graph, whose replay would
    skip the observer and count its padding rows)."""

    def __init__(self, model: torch.nn.Module):
        self.moes = [m for m in model.modules() if isinstance(m, MoE)]
        self.counts: list[list[torch.Tensor]] = [[] for _ in self.moes]  # per layer, per step: picks per expert

    def __enter__(self) -> RoutingRecorder:
        for layer, moe in enumerate(self.moes):
            moe.routing_observer = partial(self._record, layer)
        return self

    def __exit__(self, *exc) -> None:
        for moe in self.moes:
            moe.routing_observer = None

    def _record(self, layer: int, ids: torch.Tensor) -> None:
        self.counts[layer].append(torch.bincount(ids.flatten(), minlength=self.moes[layer].cfg.num_experts))

    def stats(self, tokens: int | None = None) -> RoutingStats | None:
        """The recorded steps' statistics (only the steps that routed `tokens` tokens, if given); None if no MoE layer
        ran or no step qualified."""
        if not self.moes or not self.counts[0]:
            return None
        counts = torch.stack([torch.stack(layer) for layer in self.counts]).float().cpu()  # [layers, steps, E]
        k = self.moes[0].cfg.num_experts_per_token
        if tokens is not None:
            counts = counts[:, counts[0].sum(-1) == tokens * k]
            if not counts.shape[1]:
                return None
        totals = counts.sum(1)  # [layers, E]
        return RoutingStats(distinct_experts=(counts > 0).sum(-1).float().mean().item(),
                            busiest_expert_load=(totals.max(-1).values / totals.mean(-1)).max().item(),
                            tokens_per_step=counts.sum(-1).mean().item() / k, num_steps=counts.shape[1])


def uniform_distinct_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts a step of `batch` tokens chooses per MoE layer under uniform, independent routing."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)
