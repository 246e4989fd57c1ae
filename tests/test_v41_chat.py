"""V4.1 chat through deepseek-recipe's `DeepseekV41Encoding`: a request with a system message, thinking and
tools encodes with `<｜System｜>` and parses back (reasoning, a tool call); a V4.1 model whose tokenizer lacks
`<｜System｜>` refuses chat prompts naming it; a chat carrying an image fails alone. The tokenizer is the V4 one
with a placeholder renamed `<｜System｜>` (tests/v41_dirs.py: no V4.1 tokenizer.json ships in a package)."""

from __future__ import annotations

import json

import deepseek_recipe as dr
import pytest

from deepinfer.errors import RequestError
from deepinfer.serving.api_requests import APIError, APIRequest, convert
from deepinfer.serving.recipe import Recipe, default_tokenizer_path
from tests.v41_dirs import chat_tokenizer

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city", "days"]}
TOOL = {"type": "function", "function": {"name": "weather", "description": "Weather forecast", "parameters": PARAMS}}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Rome for 3 days?"}]


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    return Recipe(chat_tokenizer(tmp_path_factory.mktemp("tok")), v41=True)


def line(body):
    return {"custom_id": "c", "url": "/v1/chat/completions", "body": {"model": "deepinfer", "max_tokens": 200, **body}}


def run(recipe, body) -> APIRequest | APIError:
    return convert(recipe, line(body), 0, 4096, False, ("deepinfer",), lambda *args: None)


def tool_call_text(args: dict) -> str:
    """The V4.1 template's own rendering of an assistant tool call (what the model is trained to emit)."""
    options = dr.ConversionOptions(default_thinking_mode=False).with_model_alias("m", dr.ModelVersion.DeepseekV41Flash)
    body = {"model": "m", "tools": [TOOL], "messages": MESSAGES + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "weather", "arguments": json.dumps(args)}}]},
        {"role": "tool", "tool_call_id": "1", "content": "sunny"}]}
    conversation = dr.ChatCompletionRequest(json.dumps(body)).convert(options).conversation
    rendered = dr.DeepseekV41Encoding().render_conversation(conversation).prompt
    start = rendered.index("<｜Assistant｜></think>") + len("<｜Assistant｜></think>")
    return rendered[start: rendered.index("<｜end▁of▁sentence｜>", start)]


def test_thinking_and_tools_encode_and_parse(recipe):
    req = run(recipe, {"messages": MESSAGES, "tools": [TOOL], "thinking": {"type": "enabled"}})
    assert isinstance(req, APIRequest) and req.thinking and req.constraint.kind == "tool_call"
    system = recipe.special_token_id("<｜System｜>")
    ids = req.prompt.token_ids
    assert ids.count(system) == 1 and ids[-1] == recipe.special_token_id("<think>")
    assert recipe.tokenizer.encode("Be brief.")[0] in ids
    call = tool_call_text({"city": "Rome", "days": 3})
    assert "｜DSML｜ invoke" in call  # V4.1's spelling: a space after the DSML tag
    for token in recipe.tokenizer.encode("The user wants Rome.</think>" + call):
        req.output.push(token)
    req.output.push_stop_token()
    parsed = req.output.finish("stop")
    assert parsed["reasoning_content"] == "The user wants Rome."
    assert parsed["finish_reason"] == "tool_calls"
    [tool_call] = parsed["tool_calls"]
    assert tool_call["function"]["name"] == "weather"
    assert json.loads(tool_call["function"]["arguments"]) == {"city": "Rome", "days": 3}


def test_a_v41_model_without_the_system_token_refuses_chat_naming_it():
    recipe = Recipe(default_tokenizer_path(), v41=True)  # the V4 tokenizer: no <｜System｜>
    assert recipe.is_v41 and recipe.missing_token == "<｜System｜>"
    with pytest.raises(RequestError, match="need the special token <｜System｜>, which the tokenizer .* does not "
                                           "have"):
        recipe.encode_chat([{"role": "user", "content": "hi"}])
    failed = run(recipe, {"messages": MESSAGES})
    assert isinstance(failed, APIError) and "<｜System｜>" in failed.message
    assert recipe.encode_raw("hi").token_ids  # raw text needs no template
    assert Recipe(default_tokenizer_path()).encoding_name == "V4"  # a V4 model keeps the V4 template


def test_an_image_fails_its_own_request(recipe):
    content = [{"type": "text", "text": "what is this"},
               {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]
    with pytest.raises(RequestError, match="carries 1 image\\(s\\): images are not supported yet"):
        recipe.encode_chat([{"role": "user", "content": content}])
    failed = run(recipe, {"messages": [{"role": "user", "content": content}]})
    assert isinstance(failed, APIError) and failed.status_code == 400
    assert "images are not supported yet" in failed.message
