"""ForwardBatch: the per-step metadata the model reads, passed explicitly (never a global).

Sequences are ordered decodes first: the first num_decodes sequences have exactly one new token each (a decode,
or a one-token prompt chunk), so their tokens are x[:num_decodes] and run through the batched recurrent paths;
the rest are prefill chunks, run one sequence at a time through the chunked paths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    positions: torch.Tensor  # [N] int64, absolute position of each new token
    slot_mapping: torch.Tensor  # [N] int64, MLA cache index of each new token (block_id * block_size + offset)
    state_slots: torch.Tensor  # [B] int64, KDA conv + recurrent state slot of each sequence
    block_tables: torch.Tensor  # [B, max_blocks] int64, MLA pages of each sequence (padded with 0)
    context_lens: torch.Tensor  # [B] int64, tokens in the cache after this step
    num_decodes: int
    # host copies, for loops over prefill sequences without device syncs
    query_lens: list[int]  # new tokens per sequence
    start_positions: list[int]  # tokens already cached per sequence before this step
    state_slot_list: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def prefill_cu_seqlens(self) -> list[int]:
        """Offsets of the prefill sequences' tokens, relative to the first prefill token."""
        cu = [0]
        for n in self.query_lens[self.num_decodes:]:
            cu.append(cu[-1] + n)
        return cu
