"""Tile shapes of our Triton kernels chosen by triton.autotune, the same way for every kernel that tunes.

tile_configs: the candidates as triton.Configs. Under the CPU interpreter (CI), which checks values and not
speed, only the default: tuning there would run every candidate for nothing.
with_tile: the autotuned kernel, or with a tile given the kernel under the autotuner (its heuristics still apply)
and that tile's arguments; tests check every candidate's values this way, benchmarks time them."""

from __future__ import annotations

import os

import triton


def tile_configs(names: tuple[str, str], tiles: tuple[tuple[int, int], ...], default: tuple[int, int],
                 warps: tuple[int, ...]) -> list[triton.Config]:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return [triton.Config(dict(zip(names, default)), num_warps=4)]
    return [triton.Config(dict(zip(names, tile)), num_warps=w) for tile in tiles for w in warps]


def with_tile(kernel, names: tuple[str, str], tile: tuple[int, int] | None):
    """(kernel to launch, extra launch arguments): kernel itself with none, or with `tile` its wrapped kernel."""
    return (kernel, {}) if tile is None else (kernel.fn, dict(zip(names, tile)))
