"""Where start-up time goes: one log line per phase with its seconds, and a progress bar on stderr for the long ones.

A first start on a GPU spends most of a minute loading weights, compiling and tuning kernels and capturing CUDA
graphs; these lines say which. Bars appear only on a terminal and only once a phase has run PHASE_BAR_DELAY
seconds, so a quick start (the CPU, the demo model) prints the lines alone."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from tqdm import tqdm

log = logging.getLogger("deltaserve")
PHASE_BAR_DELAY = 1.0  # seconds


@contextmanager
def phase(name: str) -> Iterator[dict]:
    """Time the block and log `start-up: NAME S s[, DETAIL]`; the block may set the yielded dict's "detail"."""
    info: dict = {}
    start = time.perf_counter()
    yield info
    detail = f", {info['detail']}" if info.get("detail") else ""
    log.info("start-up: %s %.2f s%s", name, time.perf_counter() - start, detail)


def phase_bar(items: Iterable, desc: str, total: int | None = None, unit: str = "it") -> tqdm:
    """items wrapped in a progress bar on stderr (shown on a terminal, after PHASE_BAR_DELAY s; cleared at the end)."""
    return tqdm(items, desc=desc, total=total, unit=unit, file=sys.stderr, delay=PHASE_BAR_DELAY, leave=False,
                disable=None)  # None: off where stderr is not a terminal


class ProgressBar:
    """A progress(step, total) callback (the loader's) drawn as a phase bar; closed when step reaches total, so the
    lines logged after it start on a line of their own."""

    def __init__(self, desc: str, unit: str):
        self.desc, self.unit = desc, unit
        self._bar: tqdm | None = None

    def __call__(self, step: int, total: int) -> None:
        if self._bar is None:
            self._bar = phase_bar(None, self.desc, total=total, unit=self.unit)
        self._bar.update(step - self._bar.n)
        if step >= total:
            self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
