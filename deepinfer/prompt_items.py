"""The prompts `LLM.generate` and `LLM.chat` take, and their sampling parameters, shaped and checked: one
prompt (`prepare`), a prompt list, conversations, parameter lists."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, Union

from deepinfer.errors import RequestError
from deepinfer.runtime.sampling import SamplingParams
from deepinfer.serving.recipe import EncodedPrompt
from deepinfer.serving.structured import Constraint, from_so_args

PromptInput = Union[str, dict]


@dataclass(frozen=True)
class Prepared:
    prompt: EncodedPrompt
    text: str | None
    constraint: Constraint | None = None
    thinking: bool = False
    reasoning_budget: int | None = None


def prepare(recipe, item: PromptInput) -> Prepared:
    """A prompt of `generate` (text, {"prompt"}, {"messages"} or {"token_ids"}, with its options) encoded and checked."""
    if isinstance(item, str):
        return Prepared(recipe.encode_raw(item), item)
    if not isinstance(item, dict):
        raise RequestError(f"a prompt must be a string or an object, got {type(item).__name__}")
    kinds = [k for k in ("prompt", "messages", "token_ids", "prompt_token_ids") if k in item]
    if len(kinds) != 1:
        raise RequestError(
            f"a prompt object needs exactly one of 'prompt', 'messages' or 'token_ids'; got keys {sorted(item)}"
        )
    unknown = sorted(set(item) - set(kinds) - {"thinking", "so_args", "max_reasoning_tokens"})
    if unknown:
        raise RequestError(f"unknown prompt key(s) {unknown}; accepted: one of prompt, messages, token_ids, and "
                           "thinking, so_args, max_reasoning_tokens")
    kind, thinking = kinds[0], item.get("thinking", False)
    if not isinstance(thinking, bool):
        raise RequestError(f"'thinking' must be true or false, got {thinking!r}")
    budget = item.get("max_reasoning_tokens")
    if budget is not None:
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise RequestError(f"'max_reasoning_tokens' must be an integer >= 0, got {budget!r}")
        if not thinking:
            raise RequestError(f"'max_reasoning_tokens' ({budget}) needs thinking on (\"thinking\": true)")
    if thinking and kind != "messages":
        raise RequestError("'thinking' applies to chat prompts ('messages') only")
    constraint = from_so_args(item["so_args"]) if item.get("so_args") is not None else None
    if kind == "prompt":
        if not isinstance(item["prompt"], str):
            raise RequestError(f"'prompt' must be a string, got {type(item['prompt']).__name__}")
        return Prepared(recipe.encode_raw(item["prompt"]), item["prompt"], constraint)
    if kind == "messages":
        messages = item["messages"]
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise RequestError(f"'messages' must be a non-empty list of message objects, got {_short(messages)}")
        return Prepared(recipe.encode_chat(messages, thinking=thinking), None, constraint, thinking, budget)
    ids = item[kind]
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise RequestError(f"'{kind}' must be a list of integers, got {_short(ids)}")
    return Prepared(EncodedPrompt(list(ids), None), None, constraint)


def expand_params(sampling_params, n: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, (SamplingParams, dict)):
        return [_params(sampling_params)] * n
    if isinstance(sampling_params, (str, bytes)) or not isinstance(sampling_params, Sequence):
        raise RequestError(f"sampling_params must be a SamplingParams, a dict of its fields, or a list of those; "
                           f"got {type(sampling_params).__name__}")
    params = [_params(p) for p in sampling_params]
    if len(params) != n:
        raise RequestError(f"got {len(params)} sampling parameter sets for {n} prompts; pass one, or one per prompt")
    return params


def _params(p: Any) -> SamplingParams:
    return p if isinstance(p, SamplingParams) else SamplingParams.from_dict(p)


def prompt_list(prompts: Any) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, Sequence) and not isinstance(prompts, bytes):
        return list(prompts)
    raise RequestError(f"prompts must be a string, a prompt object, or a list of those; got {_short(prompts)}")


def conversations(messages: Any) -> list[list[dict]]:
    """One conversation (a list of message dicts) or several (a list of such lists)."""
    if isinstance(messages, Sequence) and not isinstance(messages, (str, bytes)) and messages:
        if all(isinstance(m, dict) for m in messages):
            return [list(messages)]
        if all(isinstance(c, Sequence) and not isinstance(c, (str, bytes)) and c and
               all(isinstance(m, dict) for m in c) for c in messages):
            return [list(c) for c in messages]
    raise RequestError(f"chat() takes a conversation (a non-empty list of message objects such as "
                       f"{{'role': 'user', 'content': 'Hi'}}), a list of conversations, or a whole API request body; "
                       f"got {_short(messages)}")


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
