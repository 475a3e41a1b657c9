"""Fixtures whose pools must be full again at the end of every test: make_scheduler (no model) and make_llm
(engines on the tiny model)."""

from __future__ import annotations

import pytest
from helpers.engine import LLMFactory, tiny_model_dir
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


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory)


@pytest.fixture
def make_llm(tiny_model):
    """Factory of LLMs (default: the tiny model, max_model_len 512, one thread); at teardown each must be idle
    with every page and slot back in its pool."""
    factory = LLMFactory(tiny_model)
    yield factory
    factory.check_idle()
