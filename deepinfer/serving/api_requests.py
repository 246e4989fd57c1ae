"""Requests in the API's own shapes: Chat Completions, Responses and Anthropic Messages bodies, converted and
encoded by deepseek-recipe; each answered with the API's own response object (or stream of chunks), or with
the API's own error body when the request is invalid. Lines follow the OpenAI batch-file shape:
`{"custom_id": ..., "url": "/v1/chat/completions" | "/v1/responses" | "/v1/messages", "body": {...}}`
(or `"api": "chat.completions" | "responses" | "messages"` instead of `url`).

Extensions read from the body (and removed before conversion): `so_args` (structured output) and
`max_reasoning_tokens` (a thinking budget after which `</think>` is forced).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from deepinfer.errors import RequestError
from deepinfer.serving.recipe import SERVED_MODEL_NAME, EncodedPrompt, OutputProcessor, Recipe
from deepinfer.runtime.sampling import SamplingParams
from deepinfer.serving.structured import Constraint, from_output_constraint, from_so_args

APIS = {"chat.completions": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
URLS = {v: k for k, v in APIS.items()}


@dataclass(frozen=True)
class APIError:
    custom_id: str
    status_code: int
    body: dict[str, Any]


@dataclass
class APIRequest:
    custom_id: str
    api: str
    prompt: EncodedPrompt
    params: SamplingParams
    constraint: Constraint | None
    thinking: bool
    reasoning_budget: int | None
    output: OutputProcessor


def error_body(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": kind}}


def _parallel_calls(api: str, body: dict[str, Any]) -> bool:
    """Whether the request allows several tool calls in one answer (the APIs' default)."""
    if api == "messages":
        choice = body.get("tool_choice")
        return not (isinstance(choice, dict) and choice.get("disable_parallel_tool_use") is True)
    return body.get("parallel_tool_calls") is not False


def api_of(line: dict[str, Any]) -> str:
    if "url" in line:
        if line["url"] not in URLS:
            raise RequestError(f"unknown url {line['url']!r}; accepted: {', '.join(URLS)}")
        return URLS[line["url"]]
    api = line.get("api", "chat.completions")
    if api not in APIS:
        raise RequestError(f"unknown api {api!r}; accepted: {', '.join(APIS)}")
    return api


def convert(recipe: Recipe, line: dict[str, Any], index: int, context_limit: int, stream: bool,
            model_names: tuple[str, ...], validate: Callable[[list[int], int, Constraint | None], None],
            on_chunk: Callable[[str, dict[str, Any]], None] | None = None) -> APIRequest | APIError:
    """One batch line -> a runnable request, or the API's error body for it. With `stream` the chunks are kept
    (and passed to `on_chunk(custom_id, chunk)` as they are produced). `validate(ids, max_new_tokens,
    constraint)` raises RequestError for a request the model or cache cannot take or a constraint that does not
    compile."""
    if not isinstance(line, dict):
        return APIError(f"request-{index}", 400, error_body(f"a request line must be an object, got {type(line).__name__}"))
    import deepseek_recipe as dr

    custom_id = str(line.get("custom_id", f"request-{index}"))
    try:
        api = api_of(line)
        body = line.get("body")
        if not isinstance(body, dict):
            raise RequestError(f"'body' must be a request object, got {type(body).__name__}")
        body = dict(body)
        so_args, budget = body.pop("so_args", None), body.pop("max_reasoning_tokens", None)
        constraint = from_so_args(so_args) if so_args is not None else None
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
            raise RequestError(f"max_reasoning_tokens must be an integer >= 0, got {budget!r}")
        cls = {"chat.completions": dr.ChatCompletionRequest, "responses": dr.ResponsesRequest,
               "messages": dr.MessagesRequest}[api]
        raw = cls(json.dumps(body))
        options = recipe.options(model_names)
        echo = raw.echo() if api == "responses" else None
        namespaces = raw.namespace_tool_map(options) if api == "responses" else None
        request = raw.convert(options)
        ids = list(recipe.encoding.encode(request.conversation))
        inference = request.inference_options
        if constraint is None and inference.output_constraint is not None:
            constraint = from_output_constraint(inference.output_constraint, one_call=not _parallel_calls(api, body))
        max_tokens = request.resolve_max_tokens(len(ids), context_limit)
        validate(ids, max_tokens, constraint)
        params = SamplingParams(max_new_tokens=max_tokens, temperature=inference.temperature or 0.0,
                                top_p=inference.top_p or 1.0, seed=inference.seed)
    except dr.ConversionError as exc:
        return APIError(custom_id, exc.status_code, json.loads(exc.body))
    except (RequestError, ValueError, RuntimeError) as exc:
        return APIError(custom_id, 400, error_body(str(exc)))
    rid = f"{ {'chat.completions': 'chatcmpl', 'responses': 'resp', 'messages': 'msg'}[api]}-{uuid.uuid4().hex[:24]}"
    model = str(body.get("model", SERVED_MODEL_NAME))
    generator = cls.chunk_generator(request, rid, model)
    if echo is not None:
        generator = generator.with_echo(echo)
    if namespaces:
        generator = generator.with_namespace_tool_map(namespaces)
    response_cls = {"chat.completions": dr.ChatCompletionResponse, "responses": dr.ResponsesResponse,
                    "messages": dr.MessagesResponse}[api]
    prompt = EncodedPrompt(ids, request)
    output = OutputProcessor(recipe, prompt, (), rid, api=api, generator=generator,
                             response=response_cls(rid, model, int(time.time()), len(ids), 0), keep_chunks=stream,
                             sink=(lambda chunk: on_chunk(custom_id, chunk)) if stream and on_chunk else None)
    return APIRequest(custom_id, api, prompt, params, constraint, request.conversation.thinking_mode, budget, output)
