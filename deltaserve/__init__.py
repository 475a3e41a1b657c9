"""deltaserve: an inference and serving engine for Kimi-Linear.

LLM and SamplingParams are imported on first use (module __getattr__), so that `import deltaserve` and the
command line's --help do not pay for torch and the engine."""

import importlib
import os
import sys

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"

_LAZY = {"LLM": "deltaserve.entrypoints.llm", "SamplingParams": "deltaserve.sampling_params"}


ALLOCATOR_ENV = "PYTORCH_CUDA_ALLOC_CONF"
ALLOCATOR_DEFAULT = "expandable_segments:True"


def _default_cuda_allocator() -> None:
    """Have PyTorch's CUDA caching allocator grow its segments in place (expandable segments) unless the user set
    PYTORCH_CUDA_ALLOC_CONF. The engine sizes its cache to leave little free memory on the card; with fixed-size
    segments, a server's prefill steps, whose activations change size with each mix of requests, likely fragmented
    the cached blocks until the allocator freed and allocated again, step after step (BENCHMARKS.md, stop 49). The
    allocator reads the variable once, so it is set at import, before torch's where deltaserve is imported first,
    and never once CUDA has started; processes the engine starts inherit it."""
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    if cuda is not None and cuda.is_initialized():  # too late to take effect: leave it as it is
        return
    os.environ.setdefault(ALLOCATOR_ENV, ALLOCATOR_DEFAULT)


_default_cuda_allocator()


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'deltaserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
