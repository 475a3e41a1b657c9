"""deltaserve: an inference and serving engine for Kimi-Linear.

LLM and SamplingParams are imported on first use (module __getattr__), so that `import deltaserve` and the
command line's --help do not pay for torch and the engine."""

import importlib

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"

_LAZY = {"LLM": "deltaserve.entrypoints.llm", "SamplingParams": "deltaserve.sampling_params"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'deltaserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
