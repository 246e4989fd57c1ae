"""deepinfer: an inference engine for the DeepSeek-V4 model family.

`import deepinfer` is cheap: the heavy parts (torch, the model, deepseek-recipe) load when first used.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutput", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from deepinfer.api import LLM

        return LLM
    if name == "SamplingParams":
        from deepinfer.runtime.sampling import SamplingParams

        return SamplingParams
    if name == "RequestOutput":
        from deepinfer.runtime.request import RequestOutput

        return RequestOutput
    raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")
