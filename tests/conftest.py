"""Set-up shared by every test folder.

pytest puts this file's folder (tests/) on sys.path, so test modules import the shared `helpers` package.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # tests/kernels/test_triton_interpreted.py runs our Triton kernels through Triton's CPU interpreter. Triton
    # reads this when it is first imported, and other tests import it early (transformers' kimi_linear does), so
    # it is set here, before any test module loads.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers.engine import LLMFactory, tiny_model_dir  # noqa: E402


def pytest_configure(config):
    # The tests run tiny models: extra threads only add synchronisation, and on a busy 2-core machine OpenMP's
    # spinning made them ~100x slower. One thread keeps the run time stable.
    torch.set_num_threads(1)
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    # without fla / causal_conv1d the reference logs that it runs its pure-PyTorch kernels: that is what we compare to
    hf_logging.set_verbosity_error()


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
