"""Prefix-cache reporting (CPU, no model): the prompt tokens found in the prefix cache reach each API's usage
through `OutputProcessor.start`, the text/JSONL records and the closing throughput line."""

from __future__ import annotations

import io
import json

import pytest

from deepinfer.cli_output import summary, write
from deepinfer.runtime.engine import RunStats
from deepinfer.runtime.request import RequestOutput
from deepinfer.serving.api_requests import APIRequest, convert
from deepinfer.serving.recipe import Recipe, default_tokenizer_path

LONG = "Tell me about prefix caches. " * 12  # well over 37 prompt tokens


@pytest.fixture(scope="module")
def recipe():
    return Recipe(default_tokenizer_path())


def _line(api: str) -> dict:
    if api == "chat.completions":
        body = {"messages": [{"role": "user", "content": LONG}], "max_tokens": 16}
    elif api == "responses":
        body = {"input": LONG, "max_output_tokens": 16}
    else:
        body = {"messages": [{"role": "user", "content": LONG}], "max_tokens": 16}
    url = {"chat.completions": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}[api]
    return {"custom_id": "x", "url": url, "body": {"model": "deepinfer", **body}}


def _convert(recipe, api: str, stream: bool = False, sink: list | None = None) -> APIRequest:
    """The request as `LLM.serve` builds it (api_requests.convert), validation passing."""
    on_chunk = (lambda _cid, chunk: sink.append(chunk)) if sink is not None else None
    req = convert(recipe, _line(api), 0, 4096, stream, (), lambda *a: None, on_chunk=on_chunk)
    assert isinstance(req, APIRequest), req
    assert len(req.prompt.token_ids) > 37
    return req


def _run(recipe, req: APIRequest, cached: int | None) -> dict:
    if cached is not None:
        req.output.start(cached)
    for t in recipe.tokenizer.encode("Hello there"):
        req.output.push(t)
    req.output.push_stop_token()
    return req.output.finish("stop")["response"]


def _cached(api: str, usage: dict) -> int:
    """The prompt's cached tokens in the API's own usage field(s), checking the fields agree."""
    if api == "chat.completions":
        assert usage["prompt_cache_hit_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
        assert usage["prompt_cache_hit_tokens"] + usage["prompt_cache_miss_tokens"] == usage["prompt_tokens"]
        return usage["prompt_tokens_details"]["cached_tokens"]
    if api == "responses":
        assert usage["input_tokens_details"]["cache_write_tokens"] == 0
        return usage["input_tokens_details"]["cached_tokens"]
    return usage["cache_read_input_tokens"]  # messages: input_tokens counts the uncached ones


def _prompt_total(api: str, usage: dict) -> int:
    if api == "chat.completions":
        return usage["prompt_tokens"]
    if api == "responses":
        return usage["input_tokens"]
    return usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]


@pytest.mark.parametrize("api", ["chat.completions", "responses", "messages"])
@pytest.mark.parametrize("cached", [37, None])
def test_cached_tokens_reach_the_apis_usage(recipe, api, cached):
    req = _convert(recipe, api)
    usage = _run(recipe, req, cached)["usage"]
    assert _cached(api, usage) == (cached or 0)  # never started: the first push starts with 0 cached
    assert _prompt_total(api, usage) == len(req.prompt.token_ids)


@pytest.mark.parametrize("api", ["chat.completions", "responses", "messages"])
def test_streamed_usage_carries_the_cached_tokens(recipe, api):
    seen: list[dict] = []
    req = _convert(recipe, api, stream=True, sink=seen)
    response = _run(recipe, req, 37)
    usages = []
    for chunk in req.output.chunks:
        data = chunk["data"]
        usages += [data["usage"]] if data.get("usage") else []
        usages += [data[k]["usage"] for k in ("response", "message")
                   if isinstance(data.get(k), dict) and data[k].get("usage")]
    assert usages and all(_cached(api, u) == 37 for u in usages)
    assert seen == req.output.chunks and _cached(api, response["usage"]) == 37


@pytest.mark.parametrize("api", ["chat.completions", "responses"])
def test_start_feeds_once_and_not_before_it_is_called(recipe, api):
    seen: list[dict] = []
    req = _convert(recipe, api, stream=True, sink=seen)
    assert seen == [] and req.output.chunks == []  # construction feeds nothing: the ready chunk waits for start
    req.output.start(37)
    opened = len(seen)
    if api == "responses":
        assert [c["event"] for c in seen] == ["response.created", "response.in_progress"]
    req.output.start(5)  # a second admission (after a preemption): ignored
    assert len(seen) == opened
    assert _cached(api, _run(recipe, req, None)["usage"]) == 37
    assert len([c for c in seen if c["event"] == "response.created"]) == (1 if api == "responses" else 0)


def test_plain_prompt_output_takes_the_cached_tokens(recipe):
    prompt = recipe.encode_raw(LONG)
    out = recipe.output(prompt, ("STOP",), "t")
    out.start(37)
    for t in recipe.tokenizer.encode("one STOP two"):
        out.push(t)
        if out.stopped:
            break
    parsed = out.finish("stop")
    assert parsed["text"] == "one " and _cached("chat.completions", parsed["response"]["usage"]) == 37


def test_start_refuses_more_cached_tokens_than_the_prompt_has(recipe):
    req = _convert(recipe, "chat.completions")
    n = len(req.prompt.token_ids)
    with pytest.raises(ValueError, match="cached_tokens"):
        req.output.start(n + 1)
    with pytest.raises(ValueError, match="cached_tokens"):
        req.output.start(-1)
    req.output.start(n)  # the refused calls fed nothing: this one is the first
    assert _cached("chat.completions", _run(recipe, req, None)["usage"]) == n


def _stats(**kw) -> RunStats:
    return RunStats(prompt_tokens=9_024, generated_tokens=100, decode_tokens=96, prefill_seconds=1.0,
                    decode_seconds=2.0, decode_steps=24, first_token_time=None, **kw)


def test_summary_reports_the_prefix_cache_hit_rate(capsys):
    summary(_stats(input_tokens=14_912, cached_tokens=6_144, replayed_tokens=256), 3, 0.0)
    line = capsys.readouterr().err
    assert "; prefix cache: 41.2 % of prompt tokens cached (6,144 of 14,912), 5,888 prefill tokens saved " \
           "(256 replayed)" in line
    assert line.startswith("deepinfer: 3 request(s), 9024 prompt + 100 generated tokens;") and line.count("\n") == 1


def test_summary_without_replay_or_without_hits(capsys):
    summary(_stats(input_tokens=200, cached_tokens=50), 1, 0.0)
    assert "prefix cache: 25.0 % of prompt tokens cached (50 of 200), 50 prefill tokens saved\n" in capsys.readouterr().err
    summary(_stats(input_tokens=14_912, cached_tokens=0), 1, 0.0)
    assert "prefix cache" not in capsys.readouterr().err


def _output(cached: int) -> RequestOutput:
    return RequestOutput(index=2, prompt="p", prompt_token_ids=list(range(64)), token_ids=[5, 6, 7], text="hi",
                         reasoning_content=None, tool_calls=None, finish_reason="stop", time_to_first_token=0.0,
                         latency=0.0, num_cached_tokens=cached)


def test_records_carry_the_cached_tokens():
    text = io.StringIO()
    write(_output(37), "text", text)
    assert text.getvalue().startswith("=== request 2 (64 prompt tokens, 37 cached, 3 generated, finish: stop) ===\n")
    text = io.StringIO()
    write(_output(0), "text", text)
    assert text.getvalue().startswith("=== request 2 (64 prompt tokens, 3 generated, finish: stop) ===\n")
    for cached in (37, 0):
        line = io.StringIO()
        write(_output(cached), "jsonl", line)
        assert json.loads(line.getvalue())["num_cached_tokens"] == cached
