"""The CUDA caching allocator watched for retries.

When a cudaMalloc fails for lack of free memory, PyTorch's caching allocator synchronizes the device, frees every
cached block no tensor uses and tries again (a "retry", counted in torch.cuda.memory_stats). A step that needs one
waits for the device and for the frees and allocations, and with the engine's cache sized to fill the card, a
server whose steps allocate blocks of ever new sizes may retry step after step. Nothing else shows it: the step is
just slow. AllocatorWatch reads the count every few steps and warns at the first retry and whenever the count has
doubled since its last warning."""

from __future__ import annotations

import logging
from typing import Callable

import torch

from deltaserve.kernels.step_watch import StepWatch

log = logging.getLogger("deltaserve")


def allocator_retries(device) -> int:
    """The caching allocator's retries on device since the process started (torch.cuda.memory_stats builds a dict of a
    few hundred entries each call: not for every step)."""
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


class AllocatorWatch(StepWatch):
    """Counts steps and, every `every` of them, reads the allocator's retries on device (read: allocator_retries or
    a stand-in)."""

    def __init__(self, device, hint: str, every: int = 64, read: Callable[[object], int] = allocator_retries):
        self.device, self.hint, self._read_device = device, hint, read
        self._warned_at = 0
        super().__init__(every)  # start-up's retries (weights, cache, warm-up) are not the steps'

    def _snapshot(self) -> int:
        return self._read_device(self.device)

    def check(self) -> int:
        """The retries since the watch started; warns when they reach one, then twice those of the last warning."""
        retries = self._snapshot() - self._seen
        if retries >= max(1, 2 * self._warned_at):
            log.warning("the CUDA caching allocator ran out of free memory and freed its cached blocks to retry %d "
                        "time(s) in %d steps; each retry stalls a step. %s", retries, self._steps, self.hint)
            self._warned_at = retries
        return retries
