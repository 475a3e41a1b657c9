"""distributed.check_device: a device option against the machine, before anything loads onto it."""

from __future__ import annotations

import pytest
import torch

from deltaserve.distributed import check_device


def test_cpu_always_passes():
    check_device("cpu")


def test_a_name_that_is_no_device():
    with pytest.raises(ValueError, match="'cudax' is not a device name"):
        check_device("cudax")


def test_cuda_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device 'cuda:0': CUDA is not available .*--device cpu"):
        check_device("cuda:0")


@pytest.mark.parametrize("device, count, words", [
    ("cuda:1", 1, "device 'cuda:1': this machine has 1 GPU(s), cuda:0 to cuda:0"),
    ("cuda", 2, "device 'cuda' for 2 tensor-parallel ranks: this machine has 1 GPU(s)"),
])
def test_more_gpus_than_the_machine_has(monkeypatch, device, count, words):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        check_device(device, count)
    check_device("cuda:0")
