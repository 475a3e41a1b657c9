"""Programmatic dependent launch (PDL, Hopper and later) for our decode-step kernels.

A kernel launched with PDL may be scheduled while the kernel before it still runs: it starts with `pdl_enter`, which
waits for that kernel to complete (its writes visible) and then lets the next kernel be scheduled, so only the
launch overlaps, never a memory access. A kernel before ours that is not PDL-aware simply completes first; CUDA
graphs keep the edges. Off on older GPUs, in Triton's interpreter, and where the engine turns it off
(KernelOptions.pdl, the CLI's --no-pdl; the launchers' `pdl` argument)."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """A kernel's first statement: with PDL, wait for the kernel before to complete, then let the next one launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


_ON, _OFF = {"PDL": True, "launch_pdl": True}, {"PDL": False}


@functools.lru_cache(maxsize=None)
def _supported(index: int) -> bool:
    """Hopper or later, and not Triton's interpreter (TRITON_INTERPRET, Triton's own switch); once a device."""
    return os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.get_device_capability(index)[0] >= 9


def pdl_args(device: torch.device, pdl: bool = True) -> dict:
    """The launch arguments of a kernel that begins with pdl_enter: its PDL constexpr, and Triton's launch_pdl
    option where PDL is on (pdl: the engine's choice, KernelOptions.pdl, and the device supports it)."""
    if device.type != "cuda" or not pdl:
        return _OFF
    return _ON if _supported(device.index if device.index is not None else torch.cuda.current_device()) else _OFF
