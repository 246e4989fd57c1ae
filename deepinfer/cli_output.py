"""How `deepinfer run offline` writes plain prompts' results: each record (text or a JSONL line, flushed at
once; a JSONL line carries `num_cached_tokens`, the prompt tokens found in the prefix cache) and the run's
closing throughput line (with the prefix cache's hit rate when it found any)."""

from __future__ import annotations

import json
from typing import TextIO

import click


def write(record, fmt: str, stream: TextIO) -> None:
    """A RequestOutput or RequestFailure as a JSONL line (`to_dict`) or as text, flushed."""
    from deepinfer.runtime.request import RequestFailure

    if fmt == "jsonl":
        stream.write(json.dumps(record.to_dict(), ensure_ascii=False) + "\n")
    elif isinstance(record, RequestFailure):
        stream.write(f"=== request {record.index} ({record.source}): error ===\n{record.error}\n")
    else:
        o = record
        cached = o.num_cached_tokens
        stream.write(f"=== request {o.index} ({o.num_prompt_tokens} prompt tokens, "
                     + (f"{cached} cached, " if cached else "")
                     + f"{o.num_generated_tokens} generated, finish: {o.finish_reason}) ===\n")
        if o.reasoning_content:
            stream.write(f"[thinking]\n{o.reasoning_content}\n[answer]\n")
        stream.write(o.text + "\n")
        if o.tool_calls:
            stream.write(f"[tool calls] {json.dumps(o.tool_calls, ensure_ascii=False)}\n")
        if o.logprobs is not None:
            stream.write(f"[logprobs] {json.dumps([e.to_dict() for e in o.logprobs])}\n")
    stream.flush()


def summary(stats, n_requests: int, start: float) -> None:
    """The throughput line on stderr; `start`: when the process started (perf_counter), for the first token's time."""
    if stats is None:
        return
    decode_rate = stats.decode_tokens / stats.decode_seconds if stats.decode_seconds else 0.0
    prefill_rate = stats.prompt_tokens / stats.prefill_seconds if stats.prefill_seconds else 0.0
    ttft = (stats.first_token_time - start) if stats.first_token_time else float("nan")
    click.echo(
        f"deepinfer: {n_requests} request(s), {stats.prompt_tokens} prompt + {stats.generated_tokens} generated tokens; "
        f"prefill {prefill_rate:.1f} tok/s, decode {decode_rate:.1f} tok/s ({stats.decode_steps} steps); "
        f"first token {ttft:.2f} s after start" + (f"; {stats.preemptions} preemption(s)" if stats.preemptions else "")
        + (f"; experts max/mean per rank {stats.expert_balance:.3f} ({stats.expert_rebalances} rebalance(s))"
           if stats.expert_balance is not None else "") + prefix_cache_clause(stats) + speculative_clause(stats),
        err=True,
    )


def speculative_clause(stats) -> str:
    """'; speculative: ...' for the throughput line when decode steps verified draft tokens, else ''."""
    spec = stats.spec
    if not spec.steps:
        return ""
    per = "/".join(f"{a:.2f}" for a in spec.acceptance)
    return (f"; speculative: {spec.mean_accepted:.2f} tokens per request-step, acceptance by draft position {per}, "
            f"{spec.verify_tokens / spec.steps:.1f} verify tokens per step")


def prefix_cache_clause(stats) -> str:
    """'; prefix cache: ...' for the throughput line when the run found prompt tokens in the prefix cache, else
    ''. Hit rate: cached / the requests' prompt tokens; saved: cached tokens less those prefilled again to rebuild
    sliding windows (replayed)."""
    cached, total, replayed = stats.cached_tokens, stats.input_tokens, stats.replayed_tokens
    if cached <= 0:
        return ""
    rate = f"{100 * cached / total:.1f} %" if total else "? %"
    return (f"; prefix cache: {rate} of prompt tokens cached ({cached:,} of {total:,}), "
            f"{cached - replayed:,} prefill tokens saved" + (f" ({replayed:,} replayed)" if replayed else ""))
