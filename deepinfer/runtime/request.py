"""Request state and request output: plain data."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepinfer.runtime.cache import SeqCache
from deepinfer.serving.recipe import EncodedPrompt, OutputProcessor
from deepinfer.runtime.sampling import SamplingParams


@dataclass(eq=False)  # compared by identity: the scheduler's list lookups stay cheap
class Request:
    index: int
    prompt: EncodedPrompt
    params: SamplingParams
    seed: int
    output: OutputProcessor
    prompt_text: str | None = None
    generated: list[int] = field(default_factory=list)
    cache: SeqCache | None = None  # its slot and blocks while it runs
    finish_reason: str | None = None
    preemptions: int = 0
    constraint: Any = None  # structured.ConstraintState while the request is constrained
    custom_id: str | None = None  # set for requests in an API's own shape
    arrival: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per generated token, when params.logprobs asks
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at its first prefill chunk
    block_names: tuple[int, list[bytes]] | None = None  # (prefill length, its blocks' prefix-cache names)
    drafts: list[int] = field(default_factory=list)  # draft tokens for the positions after the last (speculative)
    confidence: list[float] = field(default_factory=list)  # each draft's estimated acceptance, given those before

    @property
    def prompt_ids(self) -> list[int]:
        return self.prompt.token_ids

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens; the next token takes this position."""
        return len(self.prompt.token_ids) + len(self.generated)

    @property
    def prefill_ids(self) -> list[int]:
        """The tokens prefill must put in the cache: the prompt, and after a preemption also every generated
        token but the last (which the next decode step feeds)."""
        return self.prompt.token_ids + self.generated[:-1]

    @property
    def num_prefill(self) -> int:
        """len(prefill_ids), without building the list."""
        return len(self.prompt.token_ids) + max(len(self.generated) - 1, 0)

    @property
    def cached(self) -> int:
        return 0 if self.cache is None else self.cache.num_tokens

    @property
    def in_prefill(self) -> bool:
        return self.cached < self.num_prefill


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's logprob and the most likely tokens' (`SamplingParams.logprobs` of them): log_softmax of
    the model's raw fp32 logits of the step, before masks, logit_bias, penalties, temperature and filters; `top`
    is (token id, logprob) in descending logprob order, ties toward the lower token id."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]

    def to_dict(self) -> dict[str, Any]:
        return {"token_id": self.token_id, "logprob": self.logprob, "top": [list(pair) for pair in self.top]}


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
    preemptions: int = 0
    response: dict[str, Any] | None = None  # the API's response object
    chunks: list[dict[str, Any]] | None = None  # its stream of chunks, when streaming
    custom_id: str | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per generated token (token_ids), when asked for
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (not prefilled again)

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
            "num_cached_tokens": self.num_cached_tokens,
        }
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.logprobs is not None:
            out["logprobs"] = [e.to_dict() for e in self.logprobs]
        return out


@dataclass(frozen=True)
class RequestFailure:
    """A request that was refused (bad input) or failed; the others of its batch still run."""

    index: int
    error: str  # what is wrong and what is accepted
    kind: str = "RequestError"  # the exception type that carried it
    source: str | None = None  # where the request came from (a prompts file's path:line), when known

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index, "error": {"type": self.kind, "message": self.error}}
        if self.source is not None:
            out["source"] = self.source
        return out
