"""check_device: a device option checked against the machine before anything is loaded onto it."""

from __future__ import annotations


def check_device(device: str, count: int = 1) -> None:
    """ValueError, saying what to pass instead, unless device ('cpu', 'cuda' or 'cuda:N') is on this machine with
    `count` GPUs from its index on (tensor parallel's ranks). Without it, CUDA missing surfaced as torch's
    AssertionError from deep inside the load."""
    if device == "cpu":
        return
    import torch

    try:
        index = torch.device(device).index or 0
    except RuntimeError:
        raise ValueError(f"device {device!r} is not a device name: use 'cpu', 'cuda' or 'cuda:N'") from None
    if not torch.cuda.is_available():
        why = "this torch is a CPU-only build" if torch.version.cuda is None else "torch finds no CUDA GPU"
        raise ValueError(f"device {device!r}: CUDA is not available ({why}); use device cpu (--device cpu), or leave "
                         "the device out to take what the machine has")
    have = torch.cuda.device_count()
    if index + count > have:
        ranks = f" for {count} tensor-parallel ranks" if count > 1 else ""
        raise ValueError(f"device {device!r}{ranks}: this machine has {have} GPU(s), cuda:0 to cuda:{have - 1}; "
                         "pass one of those (or fewer ranks)")
