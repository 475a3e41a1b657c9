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
# every name torch reads its allocator settings from (the first one set wins): a user's setting under any of them stays
ALLOCATOR_ENVS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")


def _default_cuda_allocator() -> None:
    """Have PyTorch's CUDA caching allocator grow its segments in place (expandable segments) unless the user set
    its configuration. The engine sizes its cache to leave little free memory on the card, and a server's prefill
    steps allocate blocks of new sizes with each mix of requests; with non-expandable segments, some server runs had
    prefill steps 2-4x slower, possibly from fragmented cached blocks (BENCHMARKS.md, stop 49). Torch may read the
    variable when it loads, so it is set only if torch is not imported yet (import deltaserve first); processes the
    engine starts inherit it."""
    if "torch" in sys.modules or any(name in os.environ for name in ALLOCATOR_ENVS):
        return
    os.environ[ALLOCATOR_ENV] = ALLOCATOR_DEFAULT


_default_cuda_allocator()


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'deltaserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
