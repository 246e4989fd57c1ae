"""Sampling parameters and the sampler.

Greedy when temperature is 0; otherwise temperature, then top-k, then top-p (nucleus) filtering. Each random
draw uses a generator seeded by (request seed, absolute position of the token being drawn), so a seeded
request gives the same tokens whatever it is batched with and however its prompt was chunked.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from typing import Sequence

import torch

from deepinfer.errors import RequestError

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filtering
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        _check(isinstance(self.max_new_tokens, int) and not isinstance(self.max_new_tokens, bool)
               and self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, "an integer >= 1")
        _check(isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
               and self.temperature >= 0, "temperature", self.temperature, "a number >= 0 (0 = greedy)")
        _check(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, "top_p", self.top_p, "a number in (0, 1]")
        _check(isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= 0,
               "top_k", self.top_k, "an integer >= 0 (0 = disabled)")
        _check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool) and self.seed >= 0),
               "seed", self.seed, "an integer >= 0 or null")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop, "a list of non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check(ok: bool, name: str, value: object, accepted: str) -> None:
    if not ok:
        raise RequestError(f"sampling parameter {name}={value!r} is invalid; expected {accepted}")


def request_seed(params: SamplingParams) -> int:
    """The seed a request samples with: its own, or a fresh random one."""
    return params.seed if params.seed is not None else secrets.randbits(63)


def draw_seed(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): the generator seed of one draw."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[V] fp32 logits -> temperature-scaled logits with the top-k / top-p rejected tokens at -inf."""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked above it already reach top_p (the first is always kept)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int], positions: Sequence[int]
) -> list[int]:
    """logits [B, V] fp32 -> one token per row. `positions[i]` is the position the new token will take."""
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = torch.softmax(filter_logits(logits[i], p), dim=-1)
        gen = torch.Generator(device=logits.device).manual_seed(draw_seed(seeds[i], positions[i]))
        out[i] = int(torch.multinomial(probs, 1, generator=gen))
    return out
