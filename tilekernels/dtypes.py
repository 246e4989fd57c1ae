"""dtype names shared by variants (strings keep variants hashable, printable and framework-free)."""

from __future__ import annotations

import torch

NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def name(dtype: torch.dtype) -> str:
    if dtype not in NAMES:
        raise ValueError(f"dtype {dtype} is not supported by the kernels; accepted: {', '.join(NAMES.values())}")
    return NAMES[dtype]


def torch_dtype(name_: str) -> torch.dtype:
    return {v: k for k, v in NAMES.items()}[name_]
