"""deltaserve: an inference and serving engine for Kimi-Linear."""

from deltaserve.entrypoints.llm import LLM
from deltaserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"
