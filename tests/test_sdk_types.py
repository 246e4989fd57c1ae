"""Every API shape `LLM.serve` answers, checked against the official SDKs' own types (openai, anthropic): whole
responses, every stream chunk or event, every error body, and the CLI's OpenAI batch-output lines. The SDK models
are pydantic v2 models that allow undeclared fields but do require their required fields and literal values; they
are validated here in strict mode (no type coercion)."""

from __future__ import annotations

import json
import typing

import anthropic.types as at
import openai.types.chat as oc
import openai.types.responses as orr
import pydantic
import pytest
from click.testing import CliRunner
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.shared import ErrorObject

import deepinfer
from deepinfer.cli import main
from deepinfer.serving.api_requests import APIError

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                               "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}
# a one-value argument keeps a whole tool call short (a call takes ~70 tokens in the DSML format)
PARAMS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris"]}}, "required": ["city"],
          "additionalProperties": False}
USER = [{"role": "user", "content": "Weather in Paris?"}]
CALL_TOKENS = 96  # room for one whole tool call

CHAT_TOOL = {"type": "function", "function": {"name": "weather", "parameters": PARAMS}}
RESP_TOOL = {"type": "function", "name": "weather", "parameters": PARAMS}
MSG_TOOL = {"name": "weather", "input_schema": PARAMS}


def chat(cid, **body):
    return {"custom_id": cid, "url": "/v1/chat/completions", "body": {"model": "deepinfer", "messages": USER, **body}}


def responses(cid, **body):
    return {"custom_id": cid, "url": "/v1/responses", "body": {"model": "deepinfer", "input": "Weather in Paris?", **body}}


def messages(cid, **body):
    return {"custom_id": cid, "url": "/v1/messages", "body": {"model": "deepinfer", "messages": USER, **body}}


SHAPES = [
    chat("chat-plain", max_tokens=8, seed=1),
    chat("chat-system", messages=[{"role": "system", "content": "Be brief."}, *USER], max_tokens=4, seed=2),
    chat("chat-thinking", max_tokens=16, thinking={"type": "enabled"}, max_reasoning_tokens=4, seed=1),
    chat("chat-json-schema", max_tokens=24, seed=1,
         response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}),
    chat("chat-tools-auto", max_tokens=16, tools=[CHAT_TOOL], tool_choice="auto", seed=1),
    chat("chat-tools-required", max_tokens=CALL_TOKENS, tools=[CHAT_TOOL], tool_choice="required",
         parallel_tool_calls=False, seed=1),
    chat("chat-tools-named", max_tokens=CALL_TOKENS, tools=[CHAT_TOOL], parallel_tool_calls=False, seed=2,
         tool_choice={"type": "function", "function": {"name": "weather"}}),
    chat("chat-stop", max_tokens=16, stop=["STOP"], so_args={"regex": "abcSTOPdef"}),
    chat("chat-length", max_tokens=3, seed=3),
    responses("resp-plain", max_output_tokens=8, seed=1),
    responses("resp-instructions", instructions="Be brief.", input=[{"role": "user", "content": "hi"}],
              max_output_tokens=4, seed=2),
    responses("resp-reasoning", max_output_tokens=16, reasoning={"effort": "high"}, max_reasoning_tokens=4, seed=1),
    responses("resp-json-schema", max_output_tokens=24, seed=1,
              text={"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}}),
    responses("resp-tools-auto", max_output_tokens=16, tools=[RESP_TOOL], tool_choice="auto", seed=1),
    responses("resp-tools-required", max_output_tokens=CALL_TOKENS, tools=[RESP_TOOL], tool_choice="required",
              parallel_tool_calls=False, seed=1),
    responses("resp-tools-named", max_output_tokens=CALL_TOKENS, tools=[RESP_TOOL], parallel_tool_calls=False,
              tool_choice={"type": "function", "name": "weather"}, seed=2),
    responses("resp-completed", max_output_tokens=16, so_args={"regex": "(yes|no)"}),
    messages("msg-plain", max_tokens=8),
    messages("msg-system", system="Be brief.", max_tokens=4),
    messages("msg-thinking", max_tokens=16, thinking={"type": "enabled", "budget_tokens": 1024},
             max_reasoning_tokens=4),
    messages("msg-tools-auto", max_tokens=16, tools=[MSG_TOOL], tool_choice={"type": "auto"}),
    messages("msg-tools-any", max_tokens=CALL_TOKENS, tools=[MSG_TOOL],
             tool_choice={"type": "any", "disable_parallel_tool_use": True}),
    messages("msg-tools-tool", max_tokens=CALL_TOKENS, tools=[MSG_TOOL],
             tool_choice={"type": "tool", "name": "weather", "disable_parallel_tool_use": True}),
    messages("msg-stop-sequence", max_tokens=16, stop_sequences=["STOP"], so_args={"regex": "abcSTOPdef"}),
    messages("msg-end-turn", max_tokens=16, so_args={"regex": "(yes|no)"}),
]

ERRORS = [
    chat("err-chat-empty", messages=[]),
    chat("err-chat-type", max_tokens="x"),
    chat("err-chat-model", max_tokens=3, model="gpt-9"),
    chat("err-chat-so-args", max_tokens=3, so_args={"regex": "a", "ebnf": "root ::= \"a\""}),
    chat("err-chat-budget", max_tokens=3, max_reasoning_tokens=-1),
    {"custom_id": "err-resp-no-input", "url": "/v1/responses", "body": {"model": "deepinfer"}},
    responses("err-resp-model", max_output_tokens=3, model="gpt-9"),
    responses("err-resp-schema", max_output_tokens=3, text={"format": {"type": "json_schema", "name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "nosuchtype"}}}}}),
    messages("err-msg-empty", messages=[], max_tokens=3),
    messages("err-msg-type", max_tokens="x"),
    messages("err-msg-model", max_tokens=3, model="gpt-9"),
    messages("err-msg-ebnf", max_tokens=3, so_args={"ebnf": "root ::= undefined"}),
    messages("err-msg-budget", max_tokens=3, max_reasoning_tokens=-1),
    {"custom_id": "err-msg-body", "url": "/v1/messages", "body": "not an object"},
    {"custom_id": "err-url", "url": "/v1/embeddings", "body": {}},  # no API of its own: the batch's (OpenAI) shape
]

LINES = {line["custom_id"]: line for line in SHAPES + ERRORS}
API = {"/v1/chat/completions": "chat", "/v1/responses": "responses", "/v1/messages": "messages"}


def api(cid: str) -> str:
    return API.get(LINES[cid]["url"], "chat")


# ---- SDK validation -----------------------------------------------------------------------------------------

def _by_type(union) -> dict[str, type[pydantic.BaseModel]]:
    """The members of an SDK event union, by their `type` literal (validating against the one member named by
    the event gives precise errors, where the whole union reports every member's)."""
    args = typing.get_args(union)
    if typing.get_origin(union) is typing.Annotated:
        args = typing.get_args(args[0])
    return {lit: cls for cls in args for lit in typing.get_args(cls.model_fields["type"].annotation)}


RESPONSE_EVENTS = _by_type(orr.ResponseStreamEvent)
MESSAGE_EVENTS = _by_type(at.RawMessageStreamEvent)
RESPONSE_EVENT_ADAPTER = pydantic.TypeAdapter(orr.ResponseStreamEvent)
MESSAGE_EVENT_ADAPTER = pydantic.TypeAdapter(at.RawMessageStreamEvent)
RESPONSE_TYPES = {"chat": oc.ChatCompletion, "responses": orr.Response, "messages": at.Message}


def sdk(cls, obj, what: str):
    """`obj` validated as the SDK type `cls` (strict: no coercion), failing with every field path that does not."""
    try:
        return cls.model_validate(obj, strict=True)
    except pydantic.ValidationError as exc:
        errors = exc.errors()
    problems = "\n".join(f"  {'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']} "
                         f"(got {json.dumps(e['input'], default=str, ensure_ascii=False)[:200]})" for e in errors)
    pytest.fail(f"{what} is not a valid {cls.__module__}.{cls.__name__}:\n{problems}", pytrace=False)


def check_response_event(data: dict, what: str):
    cls = RESPONSE_EVENTS.get(data.get("type"))
    assert cls is not None, f"{what}: {data.get('type')!r} is not a Responses stream event type"
    event = sdk(cls, data, what)
    assert isinstance(RESPONSE_EVENT_ADAPTER.validate_python(data, strict=True), cls)
    return event


def check_message_event(data: dict, what: str):
    if data.get("type") == "ping":  # a documented SSE event the SDK skips; not a member of RawMessageStreamEvent
        assert data == {"type": "ping"}, what
        return None
    cls = MESSAGE_EVENTS.get(data.get("type"))
    assert cls is not None, f"{what}: {data.get('type')!r} is not a Messages stream event type"
    event = sdk(cls, data, what)
    assert isinstance(MESSAGE_EVENT_ADAPTER.validate_python(data, strict=True), cls)
    return event


def check_error_body(kind: str, body: dict, what: str) -> str:
    """An API's error body; returns its message."""
    if kind == "messages":
        err = sdk(at.ErrorResponse, body, what)
        assert err.type == "error"
        assert err.error.type == "invalid_request_error", err.error.type
        return err.error.message
    assert isinstance(body, dict) and set(body) == {"error"}, f"{what}: an OpenAI error body is {{'error': {{...}}}}, got {body}"
    err = sdk(ErrorObject, body["error"], f"{what} ['error']")
    assert err.type == "invalid_request_error", err.type
    return err.message


def check_response(kind: str, body: dict, what: str):
    return sdk(RESPONSE_TYPES[kind], body, what)


# ---- fixtures -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm():
    return deepinfer.LLM(max_num_seqs=16)


def _serve(llm, stream: bool):
    """Every line served in one batch (the whole module costs two runs of the engine)."""
    lines = SHAPES + ERRORS
    results = llm.serve(lines, stream=stream, use_tqdm=False)
    assert [r.custom_id for r in results] == [line["custom_id"] for line in lines]
    return stream, {r.custom_id: r for r in results}


@pytest.fixture(scope="module")
def whole(llm):
    return _serve(llm, False)


@pytest.fixture(scope="module")
def streamed(llm):
    return _serve(llm, True)


@pytest.fixture(params=["whole", "streamed"])
def served(request):
    """Both modes: a streamed request's `response` is the same object type as a whole one."""
    return request.getfixturevalue(request.param)


def result(served, cid):
    stream, results = served
    out = results[cid]
    assert not isinstance(out, APIError), f"{cid}: unexpected error {out.status_code} {out.body}"
    return stream, out


# ---- whole responses ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("cid", [line["custom_id"] for line in SHAPES])
def test_response_is_the_sdk_type(served, cid):
    _, out = result(served, cid)
    check_response(api(cid), out.response, f"{cid} response")


@pytest.mark.parametrize("cid", [line["custom_id"] for line in SHAPES if api(line["custom_id"]) == "chat"])
def test_chat_completion_content(served, cid):
    _, out = result(served, cid)
    completion = check_response("chat", out.response, cid)
    assert completion.object == "chat.completion" and len(completion.choices) == 1
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    usage = completion.usage
    assert usage is not None and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    if cid == "chat-length":
        assert choice.finish_reason == "length" and usage.completion_tokens == 3
    if cid == "chat-stop":
        assert choice.finish_reason == "stop" and choice.message.content == "abc"
    if cid == "chat-json-schema":
        assert choice.finish_reason == "stop"
        assert set(json.loads(choice.message.content)) == {"ok", "n"}
    if cid == "chat-thinking":
        assert out.response["choices"][0]["message"].get("reasoning_content")
        assert usage.completion_tokens_details is not None and usage.completion_tokens_details.reasoning_tokens >= 4
    if cid in ("chat-tools-required", "chat-tools-named"):
        assert choice.finish_reason == "tool_calls"
        calls = choice.message.tool_calls
        assert calls is not None and len(calls) == 1
        assert calls[0].type == "function" and calls[0].function.name == "weather" and calls[0].id
        assert json.loads(calls[0].function.arguments) == {"city": "Paris"}


@pytest.mark.parametrize("cid", [line["custom_id"] for line in SHAPES if api(line["custom_id"]) == "responses"])
def test_responses_content(served, cid):
    _, out = result(served, cid)
    response = check_response("responses", out.response, cid)
    assert response.object == "response"
    assert response.usage is not None
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    kinds = [item.type for item in response.output]
    if cid in ("resp-plain", "resp-instructions"):
        assert response.status == "incomplete" and response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
    if cid == "resp-completed":
        assert response.status == "completed" and response.output_text in ("yes", "no")
    if cid == "resp-json-schema":
        assert response.status == "completed" and set(json.loads(response.output_text)) == {"ok", "n"}
    if cid == "resp-reasoning":
        assert kinds[0] == "reasoning" and "message" in kinds
        assert response.usage.output_tokens_details.reasoning_tokens >= 4
    if cid in ("resp-tools-required", "resp-tools-named"):
        assert response.status == "completed" and kinds == ["function_call"]
        call = response.output[0]
        assert call.name == "weather" and call.call_id and json.loads(call.arguments) == {"city": "Paris"}


@pytest.mark.parametrize("cid", [line["custom_id"] for line in SHAPES if api(line["custom_id"]) == "messages"])
def test_message_content(served, cid):
    _, out = result(served, cid)
    message = check_response("messages", out.response, cid)
    assert message.type == "message" and message.role == "assistant"
    kinds = [block.type for block in message.content]
    if cid in ("msg-plain", "msg-system"):
        assert message.stop_reason == "max_tokens" and kinds == ["text"]
    if cid == "msg-thinking":
        assert kinds == ["thinking", "text"] and message.content[0].thinking
    if cid == "msg-stop-sequence":
        assert message.stop_reason == "stop_sequence" and message.stop_sequence == "STOP"
        assert message.content[0].text == "abc"
    if cid == "msg-end-turn":
        assert message.stop_reason == "end_turn" and message.stop_sequence is None
        assert message.content[0].text in ("yes", "no")
    if cid in ("msg-tools-any", "msg-tools-tool"):
        assert message.stop_reason == "tool_use" and kinds == ["tool_use"]
        block = message.content[0]
        assert block.name == "weather" and block.id and block.input == {"city": "Paris"}


# ---- streams ------------------------------------------------------------------------------------------------

def _stream(streamed, cid):
    _, out = result(streamed, cid)
    assert out.chunks, f"{cid}: no chunks"
    for i, chunk in enumerate(out.chunks):
        assert set(chunk) == {"event", "data"}, f"{cid} chunk {i}: keys {sorted(chunk)}"
        assert isinstance(chunk["data"], dict), f"{cid} chunk {i}: data {chunk['data']!r}"
    return out


@pytest.mark.parametrize("cid", [line["custom_id"] for line in SHAPES if api(line["custom_id"]) == "chat"])
def test_chat_stream_chunks(streamed, cid):
    out = _stream(streamed, cid)
    state = ChatCompletionStreamState()
    for i, chunk in enumerate(out.chunks):
        assert chunk["event"] is None, f"{cid} chunk {i}: Chat Completions chunks are unnamed SSE data"
        parsed = sdk(oc.ChatCompletionChunk, chunk["data"], f"{cid} chunk {i}")
        assert parsed.object == "chat.completion.chunk" and parsed.id == out.response["id"]
        state.handle_chunk(parsed)
    # the SDK's own accumulation of the stream is the whole response
    snapshot = state.current_completion_snapshot
    whole = check_response("chat", out.response, cid)
    got, want = snapshot.choices[0], whole.choices[0]
    assert got.finish_reason == want.finish_reason
    assert (got.message.content or "") == (want.message.content or "")
    got_calls = [(c.id, c.function.name, c.function.arguments) for c in got.message.tool_calls or []]
    want_calls = [(c.id, c.function.name, c.function.arguments) for c in want.message.tool_calls or []]
    assert got_calls == want_calls
    usages = [chunk["data"]["usage"] for chunk in out.chunks if chunk["data"].get("usage") is not None]
    assert usages in ([], [out.response["usage"]]), usages  # at most one usage report, the whole response's


@pytest.mark.parametrize("cid", [line["custom_id"] for line in SHAPES if api(line["custom_id"]) == "responses"])
def test_responses_stream_events(streamed, cid):
    out = _stream(streamed, cid)
    events = []
    for i, chunk in enumerate(out.chunks):
        data = chunk["data"]
        assert chunk["event"] == data.get("type"), f"{cid} chunk {i}: SSE event {chunk['event']!r} != {data.get('type')!r}"
        event = check_response_event(data, f"{cid} event {i} ({data.get('type')})")
        assert event.sequence_number == i, f"{cid} event {i}: sequence_number {event.sequence_number}"
        events.append(event)
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type in ("response.completed", "response.incomplete", "response.failed")
    assert events[-1].response.status == out.response["status"]
    assert out.chunks[-1]["data"]["response"] == out.response  # the last event carries the whole response
    done = [e.item.model_dump(mode="json") for e in events if e.type == "response.output_item.done"]
    assert done == [item.model_dump(mode="json") for item in check_response("responses", out.response, cid).output]


@pytest.mark.parametrize("cid", [line["custom_id"] for line in SHAPES if api(line["custom_id"]) == "messages"])
def test_messages_stream_events(streamed, cid):
    out = _stream(streamed, cid)
    blocks: list[dict] = []
    partial_json: dict[int, str] = {}
    events = []
    for i, chunk in enumerate(out.chunks):
        data = chunk["data"]
        assert chunk["event"] == data.get("type"), f"{cid} chunk {i}: SSE event {chunk['event']!r} != {data.get('type')!r}"
        event = check_message_event(data, f"{cid} event {i} ({data.get('type')})")
        if event is None:
            continue
        events.append(event)
        if event.type == "content_block_start":
            assert event.index == len(blocks)
            blocks.append(event.content_block.model_dump(mode="json", exclude_unset=True))
        elif event.type == "content_block_delta":
            block, delta = blocks[event.index], event.delta
            if delta.type == "text_delta":
                block["text"] += delta.text
            elif delta.type == "thinking_delta":
                block["thinking"] += delta.thinking
            elif delta.type == "signature_delta":
                block["signature"] = block.get("signature", "") + delta.signature
            elif delta.type == "input_json_delta":
                partial_json[event.index] = partial_json.get(event.index, "") + delta.partial_json
    assert events[0].type == "message_start" and events[-1].type == "message_stop"
    assert events[-2].type == "message_delta"
    for index, text in partial_json.items():
        blocks[index]["input"] = json.loads(text)
    whole = check_response("messages", out.response, cid)
    assert events[0].message.id == whole.id
    assert events[-2].delta.stop_reason == whole.stop_reason
    assert events[-2].delta.stop_sequence == whole.stop_sequence
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    assert blocks == [block.model_dump(mode="json", exclude_unset=True) for block in whole.content]


# ---- errors -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cid", [line["custom_id"] for line in ERRORS])
def test_error_body_is_the_sdk_type(served, cid):
    _, results = served
    err = results[cid]
    assert isinstance(err, APIError), f"{cid}: expected an error, got a response"
    assert err.custom_id == cid and err.status_code == 400
    message = check_error_body(api(cid), err.body, f"{cid} error body")
    assert message


def test_messages_without_max_tokens_is_an_error():
    """max_tokens is required by the Messages API (a small model length bounds the run if it is not enforced)."""
    small = deepinfer.LLM(max_num_seqs=1, max_model_len=32)
    err = small.serve([messages("no-max-tokens")], use_tqdm=False)[0]
    assert isinstance(err, APIError), "a Messages request without max_tokens was served"
    assert err.status_code == 400
    assert "max_tokens" in check_error_body("messages", err.body, "no-max-tokens error body")


# ---- the CLI's batch-output lines -------------------------------------------------------------------------------

def test_cli_batch_output_lines(tmp_path):
    """`run offline --prompts-file` with API lines writes OpenAI batch-output lines: {id, custom_id, response:
    {status_code, request_id, body}, error}. (The SDKs have no type for these lines: openai's BatchError is the
    batch object's `errors.data[]` item, anthropic's MessageBatchIndividualResponse is Anthropic's own batch
    result format.)"""
    lines = [chat("cli-chat", max_tokens=4, seed=1), responses("cli-resp", max_output_tokens=4, seed=1),
             messages("cli-msg", max_tokens=4), messages("cli-msg-bad", max_tokens="x")]
    prompts = tmp_path / "lines.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(main, ["run", "offline", "--prompts-file", str(prompts), "--format", "jsonl",
                                       "--output", str(out), "--max-num-seqs", "4"],
                                env={"DEEPINFER_HF_MODEL_DIR": ""}, catch_exceptions=False)
    assert result.exit_code in (0, 3), result.output  # 3: some request failed (the bad line)
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    by_id = {row["custom_id"]: row for row in rows}
    assert sorted(by_id) == sorted(line["custom_id"] for line in lines) and len(rows) == len(lines)
    urls = {line["custom_id"]: line["url"] for line in lines}
    ids = set()
    for cid, row in by_id.items():
        assert {"id", "custom_id", "response", "error"} <= set(row), row
        assert isinstance(row["id"], str) and row["id"]
        ids.add(row["id"])
        response = row["response"]
        assert {"status_code", "request_id", "body"} <= set(response), response
        assert isinstance(response["request_id"], str) and response["request_id"]
        kind = API[urls[cid]]
        if cid == "cli-msg-bad":
            assert response["status_code"] == 400
            check_error_body(kind, response["body"], f"{cid} body")
        else:
            assert response["status_code"] == 200 and row["error"] is None
            check_response(kind, response["body"], f"{cid} body")
    assert len(ids) == len(rows)  # one id per line
