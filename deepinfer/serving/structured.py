"""Structured output: constraints compiled by xgrammar, applied as token masks to a whole batch at once.

A constraint comes from a request's `so_args` (exactly one of `json_schema`, `regex`, `ebnf`) or from the
`OutputConstraint` deepseek-recipe derives from `response_format` and tools (JSON, regex, V4 tool-call markup
in the exact form deepseek-recipe renders and parses, see tool_grammar.py). Grammars are compiled once per constraint and cached. In
thinking mode the reasoning is free and the constraint starts after `</think>`; while reasoning, EOS is masked
(the answer must come), and an optional reasoning budget then forces `</think>`.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepinfer.errors import RequestError
from deepinfer.runtime.staging import upload
from deepinfer.serving.tool_grammar import tool_call_tag, tools_of

SO_ARGS_KINDS = ("json_schema", "regex", "ebnf")
THINK_END = "</think>"
TOOL_TEXT_TOKENS = ("｜DSML｜",)  # added tokens that are plain text inside constrained output (tool-call markup)
_BOUNDED_STRING_CHAR = '[^\\"\\\\\\r\\n]'  # as xgrammar prints it: [^"\\\r\n]
_JSON_STRING_CHAR = '[^\\"\\\\\\0-\\x1f]'


class ConstraintError(RequestError):
    """A schema, regex or grammar that cannot be compiled; the message carries the compiler's error."""


@dataclass(frozen=True)
class Constraint:
    kind: str  # json_schema | regex | ebnf | tool_call | tool_call_required
    spec: str  # the schema (JSON text), the regex, the grammar, or the tool list (JSON)
    one_call: bool = False  # tool calls: at most one per answer (parallel tool calls disabled)


def json_ebnf(schema: dict[str, Any] | bool) -> str:
    """EBNF of one compact JSON value under `schema` (whitespace between tokens is never required)."""
    import xgrammar as xgr

    ebnf = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
    # xgrammar 0.2.8 writes length-bounded strings as [^"\\\r\n]{m,n}, which lets raw control characters
    # (invalid JSON) through; exclude them as its unbounded strings do.
    return ebnf.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)


def from_so_args(so_args: Any) -> Constraint:
    if not isinstance(so_args, dict):
        raise RequestError(f"so_args must be an object with one of {', '.join(SO_ARGS_KINDS)}, got {so_args!r}")
    given = [k for k in so_args if k in SO_ARGS_KINDS]
    unknown = sorted(set(so_args) - set(SO_ARGS_KINDS))
    if len(given) != 1 or unknown:
        raise RequestError(f"so_args must have exactly one of {', '.join(SO_ARGS_KINDS)}; got keys {sorted(so_args)}")
    kind, value = given[0], so_args[given[0]]
    if kind == "json_schema":
        if not isinstance(value, (dict, bool)):
            raise RequestError(f"so_args.json_schema must be a JSON Schema object, got {type(value).__name__}")
        return Constraint("json_schema", json.dumps(value))
    if not isinstance(value, str) or not value:
        raise RequestError(f"so_args.{kind} must be a non-empty string, got {value!r}")
    return Constraint(kind, value)


def from_output_constraint(oc: Any, one_call: bool = False) -> Constraint:
    """deepseek-recipe's OutputConstraint -> Constraint (`one_call`: parallel tool calls disabled)."""
    if oc.kind == "json":  # JSON mode without a schema: any JSON value
        return Constraint("json_schema", oc.schema or "{}")
    return Constraint(oc.kind, oc.schema, one_call=one_call and oc.kind.startswith("tool_call"))


class Grammars:
    """xgrammar state for one tokenizer: the vocabulary, the compiler and the compiled-grammar cache."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_ids: tuple[int, ...], v41: bool,
                 think_end: int | None):
        self.path, self.vocab_size, self.eos_ids, self.v41 = Path(tokenizer_json), vocab_size, eos_ids, v41
        self.think_end = think_end  # the `</think>` token id
        self._compiler = None
        self._compiled: dict[Constraint, Any] = {}
        self._lock = threading.Lock()

    def _setup(self):
        if self._compiler is not None:
            return
        import xgrammar as xgr

        data = json.loads(self.path.read_text())
        vocab = [""] * self.vocab_size
        for token, i in data["model"]["vocab"].items():
            if i < self.vocab_size:
                vocab[i] = token
        for added in data.get("added_tokens", []):  # control tokens never appear inside constrained text
            if added["id"] < self.vocab_size:
                vocab[added["id"]] = added["content"] if added["content"] in TOOL_TEXT_TOKENS else ""
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=self.vocab_size,
                                 stop_token_ids=list(self.eos_ids), add_prefix_space=False)
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=True)
        self.batch = xgr.BatchGrammarMatcher()

    def compile(self, c: Constraint) -> Any:
        """The compiled grammar of `c` (cached); ConstraintError names what the compiler rejected."""
        with self._lock:
            if c in self._compiled:
                return self._compiled[c]
            self._setup()
            try:
                grammar = self._compile(c)
            except (RuntimeError, ValueError, TypeError) as exc:
                detail = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc).strip().splitlines()[0])
                raise ConstraintError(f"invalid {c.kind.replace('_', ' ')}: {detail}") from exc
            self._compiled[c] = grammar
            return grammar

    def _compile(self, c: Constraint) -> Any:
        comp = self._compiler
        if c.kind == "json_schema":
            return comp.compile_grammar(json_ebnf(json.loads(c.spec)))
        if c.kind == "regex":
            return comp.compile_regex(c.spec)
        if c.kind == "ebnf":
            return comp.compile_grammar(c.spec)
        if c.kind in ("tool_call", "tool_call_required"):
            tag = tool_call_tag(tools_of(c.spec), c.kind == "tool_call_required", self.v41, json_ebnf,
                                one_call=c.one_call)
            return comp.compile_structural_tag(json.dumps(tag))
        raise ConstraintError(f"unknown constraint kind {c.kind!r}")

    def start(self, c: Constraint | None, thinking: bool, reasoning_budget: int | None) -> ConstraintState | None:
        """A request's state: its grammar's matcher (none for a free answer) and its reasoning budget;
        None when there is nothing to enforce."""
        if c is None and not (thinking and reasoning_budget is not None):
            return None
        if c is None:
            return ConstraintState(None, reasoning=True, budget=reasoning_budget)
        import xgrammar as xgr

        return ConstraintState(xgr.GrammarMatcher(self.compile(c)), reasoning=thinking, budget=reasoning_budget)


@dataclass
class ConstraintState:
    """One request's progress: reasoning (free text until `</think>`), then the grammar's matcher (None: the
    answer is free, only the reasoning budget is enforced)."""

    matcher: Any
    reasoning: bool
    budget: int | None = None
    reasoning_tokens: int = 0

    def accept(self, token: int, think_end: int | None) -> None:
        if self.reasoning:
            self.reasoning_tokens += 1
            if token == think_end:
                self.reasoning = False
            return
        if self.matcher is not None and not self.matcher.accept_token(token):
            raise AssertionError(f"the grammar matcher rejected token {token} that its own mask allowed")

    @property
    def done(self) -> bool:
        return not self.reasoning and self.matcher is not None and self.matcher.is_terminated()


def apply_masks(logits: torch.Tensor, states: list[ConstraintState | None], grammars: Grammars) -> None:
    """Mask every constrained row of `logits` [B, V] in place: grammar rows through one batch bitmask fill
    and one masked apply; reasoning rows forbid EOS (and, past their budget, allow only `</think>`)."""
    import xgrammar as xgr

    rows = [i for i, s in enumerate(states) if s is not None and not s.reasoning and s.matcher is not None]
    if rows:
        bitmask = xgr.allocate_token_bitmask(len(states), grammars.vocab_size)
        grammars.batch.batch_fill_next_token_bitmask([states[i].matcher for i in rows], bitmask, rows)
        xgr.apply_token_bitmask_inplace(logits, upload(bitmask, logits.device), vocab_size=grammars.vocab_size,
                                        indices=rows)
    thinking = [i for i, s in enumerate(states) if s is not None and s.reasoning]
    if not thinking:
        return
    device = logits.device
    logits[upload(torch.tensor(thinking), device)[:, None], upload(torch.tensor(grammars.eos_ids), device)[None, :]] = (
        float("-inf"))
    spent = [i for i in thinking if states[i].budget is not None and states[i].reasoning_tokens >= states[i].budget]
    if spent and grammars.think_end is not None:  # only `</think>` may follow, whatever its logit was
        spent_rows = upload(torch.tensor(spent), device)
        logits[spent_rows] = float("-inf")
        logits[spent_rows, grammars.think_end] = 0.0
