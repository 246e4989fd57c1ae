"""Structured output on the embedded tiny model (random weights, the real V4 tokenizer): every constrained
output is well formed because decoding is constrained, whatever the seed and the batch size."""

from __future__ import annotations

import ast
import json
import re

import jsonschema
import pytest
import torch

import deepinfer
from deepinfer.errors import RequestError
from deepinfer.runtime.sampling import SamplingParams
from deepinfer.serving.structured import apply_masks, from_so_args

# Schemas whose every value is bounded, so random weights finish them well inside max_new_tokens.
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                      "ok": {"type": "boolean"}},
     "required": ["name", "age", "ok"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 3},
                                               "maxItems": 2},
                                      "kind": {"const": "x"}},
     "required": ["kind"], "additionalProperties": False},
]
REGEXES = [r"\d{3}-\d{4}", r"(cat|dog)s?", r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)", r"(yes|no|maybe)!{0,2}"]
# Nested lists of digits (JSON, so json.loads checks them) and arithmetic (Python's parser checks it).
LISTS = 'root ::= "[" (v ("," v){0,3})? "]"\nv ::= [0-9] | "[" ([0-9] ("," [0-9]){0,3})? "]"'
ARITH = ('root ::= e\ne ::= t (("+" | "-") t){0,2}\nt ::= f ("*" f){0,2}\n'
         'f ::= [1-9] [0-9]{0,2} | "(" [1-9] ("+" [1-9]){0,2} ")"')
BATCHES = (1, 4, 16)


@pytest.fixture(scope="module")
def llm():
    return deepinfer.LLM(max_num_seqs=16)


def _params(seed: int, n: int = 64) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_new_tokens=n, seed=seed)


def _run(llm, so_args, batch: int, seed0: int, **item):
    items = [{"messages": [{"role": "user", "content": f"request {i}"}], "so_args": so_args, **item}
             for i in range(batch)]
    return llm.generate(items, [_params(seed0 + i) for i in range(batch)], use_tqdm=False)


def _list_of_digits(value) -> bool:
    return isinstance(value, list) and len(value) <= 4 and all(
        (isinstance(v, int) and 0 <= v <= 9) or (isinstance(v, list) and all(isinstance(d, int) for d in v))
        for v in value)


def _arith(text: str) -> bool:
    tree = ast.parse(text, mode="eval")
    allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult)
    return all(isinstance(node, allowed) for node in ast.walk(tree))


@pytest.mark.parametrize("batch", BATCHES)
def test_json_schema_outputs_parse_and_validate(llm, batch):
    for k, schema in enumerate(SCHEMAS):
        for out in _run(llm, {"json_schema": schema}, batch, seed0=100 * k + batch):
            assert out.finish_reason == "stop", out.text
            jsonschema.validate(json.loads(out.text), schema)


@pytest.mark.parametrize("batch", BATCHES)
def test_regex_outputs_match_in_full(llm, batch):
    for k, pattern in enumerate(REGEXES):
        for out in _run(llm, {"regex": pattern}, batch, seed0=100 * k + batch):
            assert out.finish_reason == "stop" and re.fullmatch(pattern, out.text), (pattern, out.text)


@pytest.mark.parametrize("batch", BATCHES)
def test_ebnf_outputs_parse(llm, batch):
    for out in _run(llm, {"ebnf": LISTS}, batch, seed0=batch):
        assert out.finish_reason == "stop" and _list_of_digits(json.loads(out.text)), out.text
    for out in _run(llm, {"ebnf": ARITH}, batch, seed0=50 + batch):
        assert out.finish_reason == "stop" and _arith(out.text), out.text


def test_mixed_batch_constrained_and_free_rows(llm):
    """Constrained and unconstrained requests share decode steps; each keeps its own behaviour."""
    items = [{"messages": [{"role": "user", "content": "a"}], "so_args": {"regex": r"(cat|dog)s?"}},
             {"messages": [{"role": "user", "content": "b"}]},
             {"messages": [{"role": "user", "content": "c"}], "so_args": {"json_schema": SCHEMAS[1]}}]
    outs = llm.generate(items, [_params(7 + i, 24) for i in range(3)], use_tqdm=False)
    assert re.fullmatch(r"(cat|dog)s?", outs[0].text)
    free_alone = llm.generate(items[1], _params(8, 24), use_tqdm=False)[0]
    assert outs[1].token_ids == free_alone.token_ids  # the free row is not touched by the others' masks
    jsonschema.validate(json.loads(outs[2].text), SCHEMAS[1])


def test_thinking_reasoning_is_free_and_the_answer_constrained(llm):
    pattern = r"(yes|no)"
    outs = llm.generate([{"messages": [{"role": "user", "content": f"q{i}"}], "thinking": True,
                          "so_args": {"regex": pattern}, "max_reasoning_tokens": 12} for i in range(6)],
                        [_params(300 + i, 40) for i in range(6)], use_tqdm=False)
    think_end = llm.recipe.special_token_id("</think>")
    for out in outs:
        assert out.reasoning_content, "the reasoning part is empty"
        assert not re.fullmatch(pattern, out.reasoning_content)  # it is free text, not the grammar's
        assert re.fullmatch(pattern, out.text), out.text
        assert think_end in out.token_ids and out.token_ids.index(think_end) <= 12
        assert out.finish_reason == "stop"


def test_reasoning_budget_without_a_constraint(llm):
    out = llm.generate({"messages": [{"role": "user", "content": "x"}], "thinking": True, "max_reasoning_tokens": 5},
                       _params(1, 12), use_tqdm=False)[0]
    assert out.token_ids[5] == llm.recipe.special_token_id("</think>")
    assert out.reasoning_content and out.text


def test_grammars_are_compiled_once_per_constraint(llm):
    c = from_so_args({"json_schema": SCHEMAS[0]})
    first = llm.grammars.compile(c)
    assert llm.grammars.compile(from_so_args({"json_schema": json.loads(json.dumps(SCHEMAS[0]))})) is first


def test_batch_mask_equals_row_by_row_masks(llm):
    """One batched bitmask fill + apply gives every row exactly what its own matcher allows."""
    g = llm.grammars
    specs = [{"regex": r"(cat|dog)s?"}, None, {"json_schema": SCHEMAS[1]}, {"ebnf": LISTS}]
    states = [g.start(from_so_args(s), False, None) if s else None for s in specs]
    states[0].matcher.accept_string("ca")
    logits = torch.randn(len(specs), llm.config.vocab_size)
    masked = logits.clone()
    apply_masks(masked, states, g)
    assert torch.equal(masked[1], logits[1])
    for i in (0, 2, 3):
        allowed = torch.isfinite(masked[i])
        single = logits[i:i + 1].clone()
        apply_masks(single, [states[i]], g)
        assert torch.equal(allowed, torch.isfinite(single[0])) and 0 < int(allowed.sum()) < llm.config.vocab_size


def test_invalid_constraints_are_rejected_before_decoding(llm):
    cases = [({"json_schema": {"type": "object", "properties": {"a": {"type": "nosuchtype"}}}}, "json schema"),
             ({"regex": "(unclosed"}, "invalid regex"),
             ({"ebnf": 'root ::= "a" undefined_rule'}, "invalid ebnf"),
             ({"regex": "a", "ebnf": "root ::= \"a\""}, "exactly one of"),
             ({"schema": {}}, "exactly one of"),
             ({"json_schema": "not a schema"}, "JSON Schema object")]
    for so_args, message in cases:
        with pytest.raises(RequestError, match=message):
            llm.generate({"prompt": "x", "so_args": so_args}, _params(0, 4), use_tqdm=False)
