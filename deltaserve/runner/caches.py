"""The runner's cache tensors: every layer's MLA pages or KDA states, allocated from the model's cache specs."""

from __future__ import annotations

import torch

from deltaserve.cache_spec import KDAStateSpec, MLAPageSpec


class LayerCaches(list):
    """Per layer, its cache tensors by name (a list of dicts, as the model takes them); `stacks` holds, per name of
    a per-slot state (KDA's conv and recurrent), one tensor [layers with it, slots, ...] whose rows are those
    layers' tensors: a request's whole state is copied or reset in one op a name, not one a layer. `snapshots`
    likewise holds prefix caching's copies of those states ({} without); a KDA layer's dict has its rows as
    `<name>_snapshots`, for the saves it makes inside a step (forward_batch.SnapshotSplit)."""

    def __init__(self, layers: list[dict[str, torch.Tensor]], stacks: dict[str, torch.Tensor],
                 snapshots: dict[str, torch.Tensor]):
        super().__init__(layers)
        self.stacks, self.snapshots = stacks, snapshots


def allocate_caches(specs: list[MLAPageSpec | KDAStateSpec], num_pages: int, page_size: int, num_slots: int,
                    dtype: torch.dtype, device: torch.device, latent_dtype: torch.dtype | None = None,
                    num_snapshot_slots: int = 0) -> LayerCaches:
    """Zeroed cache tensors, per layer (specs: the model's cache_specs()): MLA pages [num_pages, page_size,
    latent_dim] in latent_dtype (default: dtype); KDA conv tails [num_slots, ...] in dtype and recurrent states
    [num_slots, ...] float32, both rows of LayerCaches.stacks, and num_snapshot_slots snapshots of each."""
    kda = [spec for spec in specs if isinstance(spec, KDAStateSpec)]
    assert len(set(kda)) <= 1, f"the KDA layers' states differ in shape: {sorted(set(kda), key=str)}"
    stacks, snapshots = {}, {}
    if kda:
        shapes = {"conv": (kda[0].conv_shape, dtype), "recurrent": (kda[0].recurrent_shape, torch.float32)}
        for name, (shape, state_dtype) in shapes.items():
            stacks[name] = torch.zeros(len(kda), num_slots, *shape, dtype=state_dtype, device=device)
            if num_snapshot_slots:
                snapshots[name] = torch.zeros(len(kda), num_snapshot_slots, *shape, dtype=state_dtype, device=device)
    layers, row = [], 0
    for spec in specs:
        if isinstance(spec, KDAStateSpec):
            layers.append({name: stack[row] for name, stack in stacks.items()}
                          | {f"{name}_snapshots": snapshot[row] for name, snapshot in snapshots.items()})
            row += 1
        else:
            layers.append({"latent": torch.zeros(num_pages, page_size, spec.latent_dim, dtype=latent_dtype or dtype,
                                                 device=device)})
    return LayerCaches(layers, stacks, snapshots)
