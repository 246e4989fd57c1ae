"""Request state and request output: plain data."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepinfer.model.state import SequenceState
from deepinfer.recipe import EncodedPrompt, OutputProcessor
from deepinfer.sampling import SamplingParams


@dataclass
class Request:
    index: int
    prompt: EncodedPrompt
    params: SamplingParams
    seed: int
    output: OutputProcessor
    state: SequenceState
    prompt_text: str | None = None
    generated: list[int] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens already run through the model
    finish_reason: str | None = None
    arrival: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def prompt_ids(self) -> list[int]:
        return self.prompt.token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt.token_ids) + len(self.generated)

    @property
    def in_prefill(self) -> bool:
        return self.prefilled < len(self.prompt.token_ids)


@dataclass(frozen=True)
class RequestOutput:
    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    reasoning_content: str | None
    tool_calls: list[dict[str, Any]] | None
    finish_reason: str
    time_to_first_token: float
    latency: float

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "index": self.index,
            "prompt": self.prompt,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generated_tokens": self.num_generated_tokens,
        }
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out
