"""ForwardBatch: the model's input besides the token ids, one a step, passed explicitly (never a global).

Built by the runner, read by the layers: a data-only contract on the ground floor, so that no layer imports the
runner. It holds device tensors because it is the model's input.

Sequences are ordered decodes first: the first num_decodes sequences have exactly one new token each (a decode,
or a one-token prompt chunk), so their tokens are x[:num_decodes] and run through the batched recurrent paths;
the rest are prefill chunks, packed, through the chunked paths."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedSeqs:
    """A step's prefill sequences as tensors (kernels.varlen.pack_seqs makes them): their state slots [B] and
    cu_seqlens [B+1] (token offsets) on the device, cu_seqlens on the host too, and the longest sequence. Made once
    a step and shared by every layer: a host list turned into a device tensor is a copy each time, and fla-core
    caches what it derives from cu_seqlens (its chunk indices) by the tensors' identity."""

    state_slots: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    max_len: int
    # [tiles, 2] on the device: (sequence, first token of the tile within it) for every TOKEN_TILE tokens of every
    # sequence, so a kernel over token tiles launches as many programs as there are tiles, however uneven the lengths
    token_tiles: torch.Tensor


@dataclass(frozen=True)
class PrefillPass:
    """Some of a step's prefill tokens for the KDA layers' varlen kernels: their rows among the prefill tokens
    (x[num_decodes:][rows]), the state slots and host offsets of the sequences they form, and those packed (on a
    GPU; None: the kernels pack their own, or read the host lists)."""

    rows: torch.Tensor | slice  # a slice where they are consecutive
    state_slots: list[int]
    cu_seqlens: list[int]
    packed: PackedSeqs | None


@dataclass(frozen=True)
class SnapshotSplit:
    """Prefix caching's snapshot saves at a position inside a prefill chunk, made without cutting the step there.

    The KDA layers run their recurrence over the prefill tokens in two passes, `heads` (every prefill sequence, those
    with a save only up to its position) and then `tails` (the rest of those), and between them copy each such
    sequence's state into its snapshot slot: the state after exactly `position` tokens. Their short conv runs the
    step whole: its state at a position is the inputs before it (rows starts..cuts), saved before the conv. The MLA
    and MoE layers run the step whole."""

    heads: PrefillPass
    tails: PrefillPass
    # [prefill tokens]: rows of cat(heads' outputs, tails' outputs) in the tokens' order; None: that order already
    inverse: torch.Tensor | None
    state_slots: torch.Tensor  # [S] the split sequences' state slots...
    snapshot_slots: torch.Tensor  # [S] ...and the snapshot slots their states at the split go to
    # [S] each split sequence's first row and its save position's row among the prefill tokens (x[num_decodes:])
    starts: torch.Tensor
    cuts: torch.Tensor


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
    # the prefill sequences (those after num_decodes) packed for the GPU kernels; None: the kernels pack their own
    # (or, on the CPU, read the host lists)
    prefill: PackedSeqs | None = None
    # prefix caching's KDA saves inside a prefill chunk (SnapshotSplit); None: none this step
    snapshot_split: SnapshotSplit | None = None
    # a CUDA graph's warm-up or capture (runner.cuda_graph): kernels that keep no memory past the step and compile at
    # the warm-up what the capture runs
    in_graph: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def prefill_cu_seqlens(self) -> list[int]:
        """Offsets of the prefill sequences' tokens, relative to the first prefill token."""
        cu = [0]
        for n in self.query_lens[self.num_decodes:]:
            cu.append(cu[-1] + n)
        return cu
