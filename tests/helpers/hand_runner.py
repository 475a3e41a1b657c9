"""Drive a deltaserve model with hand-built ForwardBatches, without the scheduler or the sampler.

Pages are handed out in a random order (so a sequence's latents are scattered over the cache), every sequence
gets its own KDA state slot, and every page and slot no sequence owns holds POISON, so that a read or write in
the wrong place shows up in the logits or in `untouched_slots_intact`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deltaserve.cache_spec import MLAPageSpec
from deltaserve.forward_batch import ForwardBatch

POISON = 1e30


@dataclass
class Sequence:
    state_slot: int
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0


class HandRunner:
    def __init__(self, model, num_slots: int = 8, num_blocks: int = 128, block_size: int = 16, seed: int = 0):
        self.model, self.block_size, self.num_slots = model, block_size, num_slots
        gen = torch.Generator().manual_seed(seed)
        self.free_blocks = torch.randperm(num_blocks, generator=gen).tolist()
        self.free_slots = torch.randperm(num_slots, generator=gen).tolist()
        self.used_slots: list[int] = []
        dtype = next(model.parameters()).dtype
        self.caches = []
        for spec in model.cache_specs():
            if isinstance(spec, MLAPageSpec):
                layer = {"latent": torch.full((num_blocks, block_size, spec.latent_dim), POISON, dtype=dtype)}
            else:
                layer = {"conv": torch.full((num_slots, *spec.conv_shape), POISON, dtype=dtype),
                         "recurrent": torch.full((num_slots, *spec.recurrent_shape), POISON, dtype=torch.float32)}
            self.caches.append(layer)

    def new_sequence(self) -> Sequence:
        """A sequence with a fresh (zeroed) state slot, as the runner admits a new request."""
        slot = self.free_slots.pop()
        self.used_slots.append(slot)
        for layer in self.caches:
            for name in ("conv", "recurrent"):
                if name in layer:
                    layer[name][slot].zero_()
        return Sequence(slot)

    @torch.inference_mode()
    def step(self, work: list[tuple[Sequence, list[int]]]) -> list[torch.Tensor]:
        """Run one forward pass over the new tokens of several sequences (decodes are put first, as the runner
        does). Returns, in the order given, each sequence's logits at its new tokens [n, V] float32."""
        order = sorted(range(len(work)), key=lambda i: len(work[i][1]) != 1)
        ids, positions, slot_mapping, tables = [], [], [], []
        for i in order:
            seq, tokens = work[i]
            start = seq.num_computed_tokens
            while len(seq.block_ids) * self.block_size < start + len(tokens):
                seq.block_ids.append(self.free_blocks.pop())
            ids += tokens
            positions += range(start, start + len(tokens))
            slot_mapping += [seq.block_ids[p // self.block_size] * self.block_size + p % self.block_size
                             for p in range(start, start + len(tokens))]
            tables.append(seq.block_ids)
        width = max(len(t) for t in tables)
        seqs = [work[i][0] for i in order]
        query_lens = [len(work[i][1]) for i in order]
        starts = [s.num_computed_tokens for s in seqs]
        batch = ForwardBatch(
            positions=torch.tensor(positions), slot_mapping=torch.tensor(slot_mapping),
            state_slots=torch.tensor([s.state_slot for s in seqs]),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
            context_lens=torch.tensor([a + n for a, n in zip(starts, query_lens)]),
            num_decodes=sum(n == 1 for n in query_lens), query_lens=query_lens, start_positions=starts,
            state_slot_list=[s.state_slot for s in seqs])
        logits = self.model.compute_logits(self.model(torch.tensor(ids), batch, self.caches))
        for seq, n in zip(seqs, query_lens):
            seq.num_computed_tokens += n
        rows = logits.split(query_lens)
        by_input = dict(zip(order, rows))
        return [by_input[i] for i in range(len(work))]

    def untouched_slots_intact(self) -> bool:
        """Whether every state slot that no sequence was given still holds exactly POISON."""
        unused = [s for s in range(self.num_slots) if s not in self.used_slots]
        return all(bool((layer[name][unused] == POISON).all())
                   for layer in self.caches for name in ("conv", "recurrent") if name in layer)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|."""
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def prefill_logits(model, token_ids: list[int], seed: int = 0) -> torch.Tensor:
    """Logits [T, V] of one forward pass over a whole fresh sequence."""
    runner = HandRunner(model, seed=seed)
    return runner.step([(runner.new_sequence(), token_ids)])[0]
