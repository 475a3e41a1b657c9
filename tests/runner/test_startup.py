"""Start-up phases: one log line each with its seconds; the loading bar closes as the last tensor arrives."""

from __future__ import annotations

import io
import logging
import sys

from deltaserve.runner.startup import ProgressBar, phase


def test_a_phase_logs_its_name_seconds_and_detail(caplog):
    caplog.set_level(logging.INFO, logger="deltaserve")
    with phase("weights") as info:
        info["detail"] = "0.02 GiB"
    with phase("cache allocation"):
        pass
    first, second = (r.getMessage() for r in caplog.records)
    assert first.startswith("start-up: weights ") and first.endswith(" s, 0.02 GiB")
    assert second.startswith("start-up: cache allocation ") and second.endswith(" s")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_loading_bar_closes_at_its_last_step(monkeypatch):
    """Closed there, not when loading returns: the engine's next log line then starts on a line of its own."""
    monkeypatch.setattr(sys, "stderr", _Terminal())
    bar = ProgressBar("loading weights", "tensor")
    bar(1, 3)
    bar(2, 3)
    assert bar._bar.n == 2 and not bar._bar.disable
    bar(3, 3)
    assert bar._bar.disable, "tqdm marks a closed bar disabled"
