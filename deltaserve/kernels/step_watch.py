"""The engine's watches' common part: count steps, look every `every` of them, start afresh after a start-up phase."""

from __future__ import annotations


class StepWatch:
    """Subclasses give _snapshot() (what check() compares against: self._seen) and check() (_window() gives the
    steps since the last look)."""

    def __init__(self, every: int):
        self.every = every
        self.rebase()

    def step(self) -> None:
        self._steps += 1
        if self._steps % self.every == 0:
            self.check()

    def rebase(self) -> None:
        """Count steps afresh, and compare from now on against what there is now (what came before was a start-up
        phase's: saved or logged with it)."""
        self._steps = self._checked_at = 0
        self._seen = self._snapshot()

    def _window(self) -> tuple[int, int]:
        """(first, last) step since the last look; this look is the last from now on."""
        first, self._checked_at = self._checked_at + 1, self._steps
        return first, self._steps

    def _snapshot(self):
        raise NotImplementedError

    def check(self):
        raise NotImplementedError
