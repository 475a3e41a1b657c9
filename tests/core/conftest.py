"""make_scheduler (no model): schedulers whose pools must be full again at the end of every test. make_llm and
tiny_model come from tests/conftest.py."""

from __future__ import annotations

import pytest
from scheduler_harness import assert_pools_full, new_scheduler


@pytest.fixture
def make_scheduler():
    """Factory of schedulers; at teardown every leftover request is aborted and both pools must be full."""
    made = []

    def make(**kwargs):
        sched = new_scheduler(**kwargs)
        made.append(sched)
        return sched

    yield make
    for sched in made:
        for req_id in list(sched.requests):
            sched.abort_request(req_id)
        assert_pools_full(sched)

