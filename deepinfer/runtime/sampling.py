"""Sampling parameters: what a request asks of the sampler (`deepinfer/runtime/sampler.py`), validated when
made, and the seeds of its draws."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from deepinfer.errors import RequestError

_MASK64 = (1 << 64) - 1
LOGIT_BIAS_RANGE = (-100.0, 100.0)
GREEDY_BELOW = 1e-5  # a temperature under this samples greedily
MAX_LOGIT_BIAS = 1024  # entries per request (the graph-captured sampler holds this many per row)
PENALTY_RANGE = (-2.0, 2.0)
MAX_LOGPROBS = 20  # most likely alternatives reported per generated token (the OpenAI APIs' bound)


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filtering
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one (0 = off)
    presence_penalty: float = 0.0  # subtracted once from each token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # prompt and generated tokens: logit / r if positive, logit * r if not
    logit_bias: Mapping[int, float] = field(default_factory=dict)  # token id -> added to its logit
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; N = each generated token's logprob and the N most likely tokens'
    seq_seed: int | None = None  # an alias of `seed`, moved into it when the params are made (then None)

    def __post_init__(self) -> None:
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        _check(stop is None or isinstance(stop, (list, tuple)), "stop", stop, "a string or a list of non-empty strings")
        object.__setattr__(self, "stop", tuple(stop or ()))
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop, "a list of non-empty strings")
        _check(_int(self.max_new_tokens) and self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens,
               "an integer >= 1")
        _check(_real(self.temperature) and self.temperature >= 0, "temperature", self.temperature,
               "a number >= 0 (0 = greedy)")
        _check(_real(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "a number in (0, 1]")
        _check(_int(self.top_k) and self.top_k >= 0, "top_k", self.top_k, "an integer >= 0 (0 = disabled)")
        _check(_real(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "a number in [0, 1] (0 = disabled)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_real(value) and PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1], name, value,
                   "a number in [-2, 2] (0 = off)")
        _check(_real(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
               self.repetition_penalty, "a number > 0 (1 = off)")
        _check(isinstance(self.logit_bias, Mapping), "logit_bias", self.logit_bias,
               "an object mapping token ids to biases in [-100, 100]")
        bias = {}
        for token, value in self.logit_bias.items():
            if isinstance(token, str) and token.isascii() and token.strip().isdigit():  # JSON keys are strings
                token = int(token)
            _check(_int(token) and token >= 0, "logit_bias", {token: value}, "token ids (integers >= 0) as keys")
            _check(_real(value) and LOGIT_BIAS_RANGE[0] <= value <= LOGIT_BIAS_RANGE[1], "logit_bias",
                   {token: value}, "biases in [-100, 100]")
            bias[token] = float(value)
        _check(len(bias) <= MAX_LOGIT_BIAS, "logit_bias", f"<{len(bias)} entries>",
               f"at most {MAX_LOGIT_BIAS} entries")
        object.__setattr__(self, "logit_bias", bias)
        if self.seq_seed is not None:
            _check(_int(self.seq_seed) and self.seq_seed >= 0, "seq_seed", self.seq_seed,
                   "an integer >= 0 or null (an alias of seed)")
            if self.seed is not None and self.seed != self.seq_seed:
                raise RequestError(f"sampling parameters seed={self.seed!r} and seq_seed={self.seq_seed!r} disagree; "
                                   "seq_seed is an alias of seed: give one, or the same value")
            object.__setattr__(self, "seed", self.seq_seed)
            object.__setattr__(self, "seq_seed", None)
        _check(self.seed is None or (_int(self.seed) and self.seed >= 0), "seed", self.seed, "an integer >= 0 or null")
        _check(self.logprobs is None or (_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS), "logprobs",
               self.logprobs, f"null (off) or an integer in [0, {MAX_LOGPROBS}]: 0 = the sampled token's logprob "
               "only, N = also the N most likely tokens'")
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", self.ignore_eos, "true or false")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SamplingParams:
        """SamplingParams from a plain mapping; an unknown key is named with the accepted ones."""
        if not isinstance(values, Mapping):
            raise RequestError(f"sampling parameters must be a SamplingParams or a dict, got {type(values).__name__}")
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(names), key=str)
        if unknown:
            raise RequestError(f"unknown sampling parameter(s) {unknown}; accepted: {', '.join(names)}")
        return cls(**values)

    @property
    def greedy(self) -> bool:
        """Temperature 0, or below GREEDY_BELOW (where dividing the logits by it would overflow)."""
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0


def _check(ok: bool, name: str, value: object, accepted: str) -> None:
    if not ok:
        raise RequestError(f"sampling parameter {name}={value!r} is invalid; expected {accepted}")


def request_seed(params: SamplingParams) -> int:
    """The seed a request samples with: its own, or a fresh random one."""
    return params.seed if params.seed is not None else secrets.randbits(63)


def _mix(z: int) -> int:
    """splitmix64's finaliser on a 64-bit word."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def draw_seed(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): the key of one draw."""
    return _mix((seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64) & ((1 << 63) - 1)


def uniform(key: int) -> float:
    """A uniform in (0, 1) from the top 53 bits of splitmix64(key)."""
    return ((_mix((key * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & _MASK64) >> 11) + 0.5) / float(1 << 53)
