"""The grammar of DeepSeek-V4 tool calls, written exactly as deepseek-recipe renders them (so its parser reads
every constrained call back):

    \\n\\n<｜DSML｜tool_calls>\\n
    <｜DSML｜invoke name="NAME">\\n
    <｜DSML｜parameter name="KEY" string="true">raw text</｜DSML｜parameter>\\n
    <｜DSML｜parameter name="KEY" string="false">compact JSON</｜DSML｜parameter>\\n
    </｜DSML｜invoke>\\n
    </｜DSML｜tool_calls>

V4.1 spells the tags `<｜DSML｜ calls>`, `<｜DSML｜ invoke ...>`, `<｜DSML｜ parameter ...>`. Parameters follow the
schema's property order (required ones always, optional ones may be left out); string-typed properties are raw
text (an enum or pattern becomes a regex, maxLength bounds it), the others compact JSON under their own schema.
xgrammar's built-in DeepSeek tags allow whitespace where the recipe's parser does not expect it, hence this.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

DSML = "｜DSML｜"


def _names(v41: bool) -> tuple[str, str, str]:
    return (" calls", " invoke", " parameter") if v41 else ("tool_calls", "invoke", "parameter")


def tool_call_tag(tools: list[dict[str, Any]], required: bool, v41: bool,
                  json_grammar: Callable[[dict[str, Any] | bool], str], one_call: bool = False) -> dict[str, Any]:
    """An xgrammar structural tag (as a dict) for the calls of `tools` (OpenAI function-tool objects).
    `required`: the answer is tool calls only; else free text that may end with one block of calls.
    `one_call`: a single invocation (parallel tool calls disabled). `json_grammar(schema)` gives the EBNF of a compact JSON value under `schema`. `｜DSML｜` is always the
    added token (the recipe's parser, rightly, reads its spelling in plain bytes as text)."""
    calls, invoke, parameter = _names(v41)
    invokes = [_invoke(_function(t), invoke, parameter, json_grammar) for t in tools]
    invocations = {"type": "or", "elements": invokes}
    if not one_call:
        invocations = {"type": "plus", "content": invocations}
    if required:
        fmt = {"type": "sequence", "elements": [_const("\n\n<"), _DSML_TOKEN, _const(f"{calls}>\n"), invocations,
                                                *_close(calls)]}
    else:  # free text; the ｜DSML｜ token starts the one block of calls, after which only the end may come
        inner = {"type": "sequence", "elements": [_const(f"{calls}>\n"), invocations, _const("</"), _DSML_TOKEN]}
        fmt = {"type": "token_triggered_tags", "trigger_tokens": [DSML],
               "tags": [{"type": "tag", "begin": _DSML_TOKEN, "content": inner, "end": f"{calls}>"}],
               "at_least_one": False, "stop_after_first": True}
    return {"type": "structural_tag", "format": fmt}


_DSML_TOKEN = {"type": "token", "token": DSML}


def _const(text: str) -> dict[str, Any]:
    return {"type": "const_string", "value": text}


def _open(name: str, rest: str) -> list[dict[str, Any]]:
    return [_const("<"), _DSML_TOKEN, _const(f"{name}{rest}>")]


def _close(name: str, newline: str = "") -> list[dict[str, Any]]:
    return [_const("</"), _DSML_TOKEN, _const(f"{name}>{newline}")]


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool.get("function", tool) if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"a tool needs a function with a name, got {tool!r}")
    return fn


def _invoke(fn: dict[str, Any], invoke: str, parameter: str, json_grammar) -> dict[str, Any]:
    schema = fn.get("parameters") or {}
    props = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    elements = [*_open(invoke, f' name="{fn["name"]}"'), _const("\n")]
    for key, sub in props.items():
        param = _parameter(key, sub, parameter, json_grammar)
        elements.append(param if key in required else {"type": "optional", "content": param})
    return {"type": "sequence", "elements": elements + _close(invoke, "\n")}


def _parameter(key: str, schema: Any, parameter: str, json_grammar) -> dict[str, Any]:
    is_string = isinstance(schema, dict) and schema.get("type") == "string"
    if not is_string:
        value = {"type": "grammar", "grammar": json_grammar(schema if isinstance(schema, (dict, bool)) else {})}
    elif "enum" in schema or "const" in schema:
        options = schema.get("enum", [schema.get("const")])
        value = {"type": "regex", "pattern": "|".join(re.escape(str(o)) for o in options)}
    elif "pattern" in schema:
        value = {"type": "regex", "pattern": schema["pattern"]}
    else:  # raw text without '<' (so no tag inside), bounded by minLength/maxLength
        low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
        value = {"type": "regex", "pattern": f"[^<]{{{low},{'' if high is None else int(high)}}}"}
    opening = _open(parameter, f' name="{key}" string="{"true" if is_string else "false"}"')
    return {"type": "sequence", "elements": [*opening, value, *_close(parameter, "\n")]}


def tools_of(spec: str) -> list[dict[str, Any]]:
    tools = json.loads(spec)
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"a tool-call constraint needs a non-empty list of tools, got {spec[:80]!r}")
    return tools
