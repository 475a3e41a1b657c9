"""A deltaserve model run over one sequence with a fresh cache of its own, without the scheduler or the sampler.

Teacher forcing needs the logits at every position of prompt + golden continuation; the engine only computes
the ones it samples from. SequenceRunner builds the ForwardBatch the runner builds for a single sequence: one
page holding all its tokens, one zeroed KDA state slot; a piece of n > 1 tokens is a prefill chunk, a single
token takes the decode path."""

from __future__ import annotations

import torch

from deltaserve.forward_batch import ForwardBatch
from deltaserve.kernels.varlen import pack_seqs
from deltaserve.runner.caches import allocate_caches


class SequenceRunner:
    """One sequence fed in pieces, as the engine feeds it: a prefill chunk, then one token a step."""

    def __init__(self, model, max_tokens: int, latent_dtype: torch.dtype | None = None):
        self.model, self.num_computed = model, 0
        weight = model.embed_tokens.weight
        self.device = weight.device
        # one page, one slot; the latents in latent_dtype (the engine's, e.g. a float8 cache), default the weights'
        self.caches = allocate_caches(model.cache_specs(), 1, max_tokens, 1, weight.dtype, weight.device, latent_dtype)

    @torch.inference_mode()
    def extend(self, token_ids: list[int], first_row: int = 0) -> torch.Tensor:
        """The next n tokens -> logits [n - first_row, V] float32 at the new positions from first_row on."""
        n, start = len(token_ids), self.num_computed
        positions = torch.arange(start, start + n, device=self.device)
        one = lambda value: torch.tensor([value], dtype=torch.int64, device=self.device)  # noqa: E731
        batch = ForwardBatch(positions=positions, slot_mapping=positions.clone(), state_slots=one(0),
                             block_tables=one(0)[None], context_lens=one(start + n), num_decodes=int(n == 1),
                             query_lens=[n], start_positions=[start], state_slot_list=[0],
                             prefill=pack_seqs([0], [0, n], self.device) if n > 1 else None)
        hidden = self.model(torch.tensor(token_ids, device=self.device), batch, self.caches)  # [n, D]
        self.num_computed += n
        return self.model.compute_logits(hidden[first_row:])


def sequence_logits(model, token_ids: list[int], first_row: int = 0,
                    latent_dtype: torch.dtype | None = None) -> torch.Tensor:
    """token_ids [T] in one pass -> logits [T - first_row, V] float32 (position p predicts token p + 1)."""
    return SequenceRunner(model, len(token_ids), latent_dtype).extend(token_ids, first_row)


def decode_logits(model, prompt: list[int], continuation: list[int],
                  latent_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The engine's path for one request: prefill the prompt, then feed continuation[:-1] one token a step.
    Returns the logits [M, V] float32 that predict the M tokens of continuation."""
    runner = SequenceRunner(model, len(prompt) + len(continuation), latent_dtype)
    rows = [runner.extend(prompt, len(prompt) - 1)]
    rows += [runner.extend([token]) for token in continuation[:-1]]
    return torch.cat(rows)
