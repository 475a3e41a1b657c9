"""AllocatorWatch: the CUDA caching allocator's retries read every few steps, a warning at the first and at each
doubling, start-up's retries left out (a stand-in for the count on the CPU)."""

from __future__ import annotations

import logging

from deltaserve.runner.allocator_watch import AllocatorWatch


class FakeStats:
    """allocator_retries's stand-in: the count set by the test, and how often it was read."""

    def __init__(self, retries: int = 0):
        self.retries, self.reads = retries, 0

    def __call__(self, device) -> int:
        self.reads += 1
        return self.retries


def test_warns_at_the_first_retry_after_start_up_and_again_when_they_double(caplog):
    stats = FakeStats(retries=5)  # start-up's own retries
    watch = AllocatorWatch("cuda", hint="lower it", every=4, read=stats)
    caplog.set_level(logging.WARNING, logger="deltaserve")
    for _ in range(8):
        watch.step()
    assert not caplog.records and stats.reads == 3  # at start, then every 4th step
    stats.retries = 6
    for _ in range(4):
        watch.step()
    assert len(caplog.records) == 1 and "retry 1 time(s) in 12 steps" in caplog.text and "lower it" in caplog.text
    stats.retries = 7  # 2 since the start: twice the last warning's, warned
    assert watch.check() == 2 and len(caplog.records) == 2
    stats.retries = 8  # 3: under 4
    assert watch.check() == 3 and len(caplog.records) == 2
    stats.retries = 9
    assert watch.check() == 4 and len(caplog.records) == 3


def test_no_stats_are_read_between_checks():
    stats = FakeStats()
    watch = AllocatorWatch("cuda", hint="", every=64, read=stats)
    for _ in range(63):
        watch.step()
    assert stats.reads == 1
    watch.step()
    assert stats.reads == 2
