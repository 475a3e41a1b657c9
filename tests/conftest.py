"""Session-wide set-up shared by every test folder.

This file's folder (tests/) is put on sys.path by pytest, so test modules import `helpers.*`.
"""

import warnings

import pytest
import torch


@pytest.fixture(autouse=True)
def _float32_default():
    """Tests compare float32 numerics; a test that changes torch's default dtype must not leak it."""
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)


def pytest_configure(config):
    # the reference falls back to its pure-PyTorch kernels without fla / causal_conv1d: that is what we compare to
    warnings.filterwarnings("ignore", message=".*falling back to its reference PyTorch implementation.*")
