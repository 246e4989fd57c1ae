"""Requests in the API's own shapes: Chat Completions, Responses and Anthropic Messages bodies, converted and
encoded by deepseek-recipe; each answered with the API's own response object (or stream of chunks), or with
the API's own error body when the request is invalid. Lines follow the OpenAI batch-file shape:
`{"custom_id": ..., "url": "/v1/chat/completions" | "/v1/responses" | "/v1/messages", "body": {...}}`
(or `"api": "chat.completions" | "responses" | "messages"` instead of `url`).

Every body field is honoured or refused: each API's own fields that deepinfer serves (FIELDS), and deepinfer's
extensions, read from the body and removed before conversion: `so_args` (structured output),
`max_reasoning_tokens` (a thinking budget after which `</think>` is forced; Anthropic's
`thinking.budget_tokens` sets it too) and the sampler's `top_k`, `min_p`, `presence_penalty`,
`frequency_penalty`, `repetition_penalty`, `logit_bias`, `seed` (alias `seq_seed`) and `ignore_eos`. Any other
field, or a value deepinfer cannot honour (`store: true`, ...), gets a 400 naming it. Logprobs (Chat Completions
`logprobs` / `top_logprobs`; Responses `include: ["message.output_text.logprobs"]` with `top_logprobs`) are
computed by the engine and put into the response and its chunks by deepseek-recipe's stream processor. A Messages request
without `max_tokens` is refused, as Anthropic's API does; the other APIs without a bound get deepseek-recipe's
default (8192 tokens, 65536 in thinking mode), capped by the context left after the prompt.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from deepinfer.errors import RequestError
from deepinfer.serving.recipe import SERVED_MODEL_NAME, EncodedPrompt, OutputProcessor, Recipe
from deepinfer.runtime.sampling import SamplingParams
from deepinfer.serving.structured import Constraint, from_output_constraint, from_so_args

APIS = {"chat.completions": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
URLS = {v: k for k, v in APIS.items()}

# Body fields each API honours (through deepseek-recipe or here); request metadata that has no effect on the
# answer (user, metadata, ...) is accepted too. Any other field is refused with a 400 naming it.
FIELDS = {
    "chat.completions": {"model", "messages", "temperature", "top_p", "seed", "max_tokens", "max_completion_tokens",
                         "stop", "stream", "stream_options", "response_format", "tools", "tool_choice",
                         "parallel_tool_calls", "thinking", "reasoning_effort", "n", "logprobs", "top_logprobs",
                         "user", "metadata", "safety_identifier", "prompt_cache_key", "store"},
    "responses": {"model", "input", "instructions", "temperature", "top_p", "max_output_tokens", "stream", "reasoning",
                  "text", "tools", "tool_choice", "parallel_tool_calls", "top_logprobs", "include", "truncation",
                  "user", "metadata", "safety_identifier", "prompt_cache_key", "store"},
    "messages": {"model", "messages", "system", "max_tokens", "temperature", "top_p", "top_k", "stop_sequences",
                 "stream", "thinking", "output_config", "output_format", "tools", "tool_choice", "metadata"},
}
# deepinfer's sampling and decoding extensions, read from any API's body (removed before conversion)
SAMPLING_EXTENSIONS = ("top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                       "logit_bias", "seed", "seq_seed", "ignore_eos")
EXTENSIONS = ("so_args", "max_reasoning_tokens") + SAMPLING_EXTENSIONS
LOGPROBS_INCLUDE = "message.output_text.logprobs"  # the Responses API's request for output logprobs


@dataclass(frozen=True)
class APIError:
    custom_id: str
    status_code: int
    body: dict[str, Any]
    request_id: str = field(default_factory=lambda: f"req_{uuid.uuid4().hex[:24]}")

    @property
    def message(self) -> str:
        return str((self.body.get("error") or {}).get("message", ""))


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


def error_body(message: str, api: str = "chat.completions", kind: str = "invalid_request_error",
               param: str | None = None) -> dict[str, Any]:
    """The API's own error body: Anthropic's `{"type": "error", "error": {type, message}}` for Messages, OpenAI's
    `{"error": {message, type, param, code}}` otherwise."""
    if api == "messages":
        return {"type": "error", "error": {"type": kind, "message": message}}
    return {"error": {"message": message, "type": kind, "param": param, "code": kind}}


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


class _BadParam(RequestError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _refuse_unsupported(api: str, body: dict[str, Any]) -> None:
    """A 400 for a field the API's request may carry but deepinfer cannot honour, or one it does not know."""
    unknown = sorted(set(body) - FIELDS[api] - set(EXTENSIONS))
    if unknown:
        raise _BadParam(unknown[0], f"unsupported parameter(s) {unknown} for {APIS[api]}; supported: "
                                    f"{', '.join(sorted(FIELDS[api]))}, and deepinfer's {', '.join(EXTENSIONS)}")
    include = body.get("include")
    if include is not None and not (isinstance(include, list) and all(i == LOGPROBS_INCLUDE for i in include)):
        raise _BadParam("include", f"include={include!r}: only {LOGPROBS_INCLUDE!r} is supported (no encrypted "
                                   "reasoning, no tool outputs)")
    refusals = {
        "store": "responses are not stored by deepinfer (offline batches): leave 'store' out or set it false",
        "truncation": "only truncation 'disabled' is supported (a prompt longer than the context is refused)",
    }
    defaults = {"store": (False,), "truncation": ("disabled",)}
    for name, message in refusals.items():
        if name in body and body[name] is not None and body[name] not in defaults[name]:
            raise _BadParam(name, f"{name}={body[name]!r}: {message}")
    if api == "messages" and "max_tokens" not in body:
        raise _BadParam("max_tokens", "max_tokens: Field required (the Messages API needs a bound on the output)")
    if api == "chat.completions" and body.get("max_completion_tokens") is not None:
        value = body.pop("max_completion_tokens")
        if body.get("max_tokens") is not None and body["max_tokens"] != value:
            raise _BadParam("max_completion_tokens", f"max_completion_tokens={value!r} and max_tokens="
                                                     f"{body['max_tokens']!r} disagree; give one")
        body["max_tokens"] = value


def _messages_format(body: dict[str, Any]) -> dict[str, Any] | None:
    """Anthropic structured output (`output_config.format` or `output_format`: {"type": "json_schema",
    "schema": ...}) as so_args; other output_config keys (effort) stay for the conversion."""
    fmt = body.pop("output_format", None)
    config = body.get("output_config")
    if isinstance(config, dict) and "format" in config:
        config = dict(config)
        fmt = config.pop("format")
        body["output_config"] = config
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise _BadParam("output_config.format", f"output format {fmt!r} is not supported; accepted: "
                                                '{"type": "json_schema", "schema": {...}}')
    return {"json_schema": fmt["schema"]}


def convert(recipe: Recipe, line: dict[str, Any], index: int, context_limit: int, stream: bool,
            model_names: tuple[str, ...], validate: Callable[..., None],
            on_chunk: Callable[[str, dict[str, Any]], None] | None = None) -> APIRequest | APIError:
    """One batch line -> a runnable request, or the API's error body for it. With `stream` the chunks are kept
    (and passed to `on_chunk(custom_id, chunk)` as they are produced). `validate(ids, max_new_tokens,
    constraint, params, thinking, budget)` raises RequestError for a request the model or cache cannot take or
    a constraint that does not compile."""
    if not isinstance(line, dict):
        return APIError(f"request-{index}", 400, error_body(f"a request line must be an object, got {type(line).__name__}"))
    import deepseek_recipe as dr

    custom_id = str(line.get("custom_id", f"request-{index}"))
    api = "chat.completions"
    try:
        api = api_of(line)
        body = line.get("body")
        if not isinstance(body, dict):
            raise RequestError(f"'body' must be a request object, got {type(body).__name__}")
        body = dict(body)
        _refuse_unsupported(api, body)
        if body.get("stream") is not None and body["stream"] is not stream:
            raise _BadParam("stream", f"stream={body['stream']!r}, but this batch is {'' if stream else 'not '}"
                                      "streamed: `deepinfer run offline --stream` (serve(stream=...)) decides for "
                                      "the whole batch; leave 'stream' out of the body")
        extensions = {k: body.pop(k) for k in EXTENSIONS if k in body}
        so_args, budget = extensions.pop("so_args", None), extensions.pop("max_reasoning_tokens", None)
        if api == "messages":
            anthropic_format = _messages_format(body)
            if anthropic_format is not None:
                if so_args is not None:
                    raise _BadParam("so_args", "give either so_args or output_config.format, not both")
                so_args = anthropic_format
            thinking = body.get("thinking")
            if budget is None and isinstance(thinking, dict) and thinking.get("type") == "enabled":
                budget = thinking.get("budget_tokens")
        constraint = from_so_args(so_args) if so_args is not None else None
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
            raise _BadParam("max_reasoning_tokens", f"max_reasoning_tokens must be an integer >= 0, got {budget!r}")
        sampling = {k: v for k, v in extensions.items() if v is not None}
        cls = {"chat.completions": dr.ChatCompletionRequest, "responses": dr.ResponsesRequest,
               "messages": dr.MessagesRequest}[api]
        raw = _construct(cls, body)
        options = recipe.options(model_names)
        echo = raw.echo() if api == "responses" else None
        namespaces = raw.namespace_tool_map(options) if api == "responses" else None
        request = raw.convert(options)
        ids = recipe.encode_conversation(request.conversation)
        inference = request.inference_options
        thinking_mode = request.conversation.thinking_mode
        if budget is not None and not thinking_mode:
            raise _BadParam("max_reasoning_tokens", f"a reasoning budget ({budget}) needs thinking on")
        if constraint is None and inference.output_constraint is not None:
            oc = inference.output_constraint
            constraint = from_output_constraint(oc, one_call=not _parallel_calls(api, body))
            choice = body.get("tool_choice")
            if api == "messages" and isinstance(choice, dict) and choice.get("type") == "any" and oc.kind == "tool_call":
                constraint = Constraint("tool_call_required", constraint.spec, constraint.one_call)
        max_tokens = request.resolve_max_tokens(len(ids), context_limit)
        seed = sampling.pop("seed", inference.seed)
        params = SamplingParams(max_new_tokens=max_tokens, temperature=inference.temperature if inference.temperature
                                is not None else 1.0, top_p=inference.top_p or 1.0, seed=seed,
                                logprobs=_logprobs(api, body, inference), **sampling)
        validate(ids, max_tokens, constraint, params, thinking_mode, budget)
    except dr.ConversionError as exc:
        return APIError(custom_id, exc.status_code, _reshape(json.loads(exc.body), api))
    except _BadParam as exc:
        return APIError(custom_id, 400, error_body(str(exc), api, param=exc.param))
    except (RequestError, ValueError, RuntimeError) as exc:
        return APIError(custom_id, 400, error_body(str(exc), api))
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
                             sink=(lambda chunk: on_chunk(custom_id, chunk)) if stream and on_chunk else None,
                             with_logprobs=params.logprobs is not None)
    return APIRequest(custom_id, api, prompt, params, constraint, thinking_mode, budget, output)


def _logprobs(api: str, body: dict[str, Any], inference: Any) -> int | None:
    """`SamplingParams.logprobs` for a request: Chat Completions `logprobs: true` (with `top_logprobs`, both checked
    by deepseek-recipe), Responses `include: ["message.output_text.logprobs"]` (with `top_logprobs`); else None."""
    if api == "chat.completions":
        wanted = inference.logprobs
    else:
        wanted = api == "responses" and LOGPROBS_INCLUDE in (body.get("include") or ())
    return (inference.top_logprobs or 0) if wanted else None


def _construct(cls: Any, body: dict[str, Any]) -> Any:
    """deepseek-recipe's request object for `body`; its type errors (which name no field) get the field named."""
    try:
        return cls(json.dumps(body))
    except ValueError as exc:
        for key in body:  # the field whose removal makes the body parse (or only reports it as missing)
            try:
                cls(json.dumps({k: v for k, v in body.items() if k != key}))
            except ValueError as other:
                if f"missing field `{key}`" not in str(other):
                    continue
            raise _BadParam(key, f"{key}={_short(body[key])}: {exc}") from None
        raise


def _short(value: Any, limit: int = 80) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _reshape(body: dict[str, Any], api: str) -> dict[str, Any]:
    """deepseek-recipe's (OpenAI-shaped) error body in the API's own shape."""
    if api != "messages":
        return body
    error = body.get("error") or {}
    return error_body(str(error.get("message", body)), api, str(error.get("type") or "invalid_request_error"))
