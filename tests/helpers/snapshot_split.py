"""A step with prefix caching's KDA saves inside its prefill chunks (forward_batch.SnapshotSplit) against its slow
twin, the same work cut into two steps at the saves (what the scheduler did before: the heads with every other
sequence, then the tails), whose KDA kernels see the same sequences as the split's two passes. Used by the CPU test
and the GPU one."""

from __future__ import annotations

import random

import torch

from deltaserve.loader.model_loader import build_model, init_dummy_weights
from deltaserve.runner.caches import allocate_caches
from deltaserve.runner.host_batch import HostBatch, cache_slot

BLOCK = 16
NUM_SLOTS, NUM_SNAPSHOTS = 8, 4


def check_split_step(cfg, seed: int, device: str = "cpu", dtype=torch.float32, tol: float = 1e-5,
                     lengths: list[int] | None = None, cuts: dict[int, int] | None = None) -> None:
    """Fresh random prompts of ragged lengths (two one-token chunks among them; or of `lengths`), some of them
    computed in part by a step before (so their chunks start mid-prompt, from states that are not zero), up to three
    of them split at random positions, some within the conv's width of their chunk's start (or, with `cuts`, all
    computed from 0 and split there: {sequence: position}): the split step's hidden states and final states are the
    twin's, and each snapshot is the state the twin's first step leaves, all within tol."""
    rng = random.Random(seed)
    model = build_model(cfg, dtype, device)
    init_dummy_weights(model, seed, std=0.1)
    lengths = lengths or [1, 1] + [rng.randint(3, 90) for _ in range(4)]
    prompts = {slot: [rng.randrange(3, cfg.vocab_size) for _ in range(n)] for slot, n in enumerate(lengths)}
    starts = {slot: rng.randint(1, n - 2) if n > 2 and rng.random() < 0.5 and cuts is None else 0
              for slot, n in enumerate(lengths)}
    split_slots = list(cuts) if cuts else [slot for slot, n in enumerate(lengths) if n - starts[slot] > 1][:3]
    cuts = cuts or {slot: starts[slot] + min(rng.choice([1, 2, rng.randint(1, 40)]), lengths[slot] - starts[slot] - 1)
                    for slot in split_slots}
    snapshot_of = {slot: snapshot for snapshot, slot in enumerate(split_slots)}
    close = dict(rtol=tol, atol=tol)

    split, twin = _caches(model, device, dtype), _caches(model, device, dtype)
    before = {slot: (0, prompts[slot][:start]) for slot, start in starts.items() if start}
    for caches in (split, twin):
        if before:
            _run_step(model, caches, before, device)
    got = _run_step(model, split, {slot: (starts[slot], p[starts[slot]:]) for slot, p in prompts.items()}, device,
                    [(slot, cuts[slot] - starts[slot], snapshot_of[slot]) for slot in split_slots])
    heads = _run_step(model, twin, {slot: (starts[slot], p[starts[slot]: cuts.get(slot, len(p))])
                                    for slot, p in prompts.items()}, device)
    at_cuts = {name: stack[:, split_slots].clone() for name, stack in twin.stacks.items()}
    tails = _run_step(model, twin, {slot: (cuts[slot], prompts[slot][cuts[slot]:]) for slot in split_slots}, device)
    for slot in prompts:
        expected = torch.cat([heads[slot], tails[slot]]) if slot in cuts else heads[slot]
        torch.testing.assert_close(got[slot], expected, **close)
    for name, stack in twin.stacks.items():
        torch.testing.assert_close(split.stacks[name], stack, **close)
        torch.testing.assert_close(split.snapshots[name][:, : len(split_slots)], at_cuts[name], **close)
        assert not split.snapshots[name][:, len(split_slots):].any()


def _caches(model, device, dtype):
    return allocate_caches(model.cache_specs(), 64, BLOCK, NUM_SLOTS, dtype, torch.device(device),
                           num_snapshot_slots=NUM_SNAPSHOTS)


def _run_step(model, caches, chunks: dict[int, tuple[int, list[int]]], device, splits=()):
    """One step computing, for each state slot, its chunk (start position, tokens), one-token chunks first (the
    decodes' place); splits: (state slot, tokens before the save, snapshot slot). Returns the final hidden states
    [chunk tokens, D] by state slot."""
    order = sorted(chunks, key=lambda slot: len(chunks[slot][1]) != 1)
    ids, positions, mapping, tables = [], [], [], []
    for slot in order:
        start, tokens = chunks[slot]
        end = start + len(tokens)
        table = [slot * 8 + i for i in range(-(-end // BLOCK))]  # 8 pages a slot: no two sequences share one
        ids += tokens
        positions += range(start, end)
        mapping += [cache_slot(table, p, BLOCK) for p in range(start, end)]
        tables.append(table)
    rows = {slot: row for row, slot in enumerate(order)}
    host = HostBatch(ids, positions, mapping, [len(chunks[s][1]) for s in order], [chunks[s][0] for s in order],
                     order, tables, [(rows[slot], tokens, snapshot) for slot, tokens, snapshot in splits])
    input_ids, batch = host.to_device(torch.device(device))
    with torch.inference_mode():
        hidden = model(input_ids, batch, caches).float()
    offsets = [0]
    for slot in order:
        offsets.append(offsets[-1] + len(chunks[slot][1]))
    return {slot: hidden[offsets[row]:offsets[row + 1]] for row, slot in enumerate(order)}
