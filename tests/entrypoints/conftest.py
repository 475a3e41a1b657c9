"""Fixtures of the LLM tests: the tiny model, and LLMs whose pools must be full again at the end of every test."""

from __future__ import annotations

import pytest
from helpers.engine import LLMFactory, tiny_model_dir


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
