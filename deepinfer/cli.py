"""The `deepinfer` command line."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import click

import backends

from deepinfer.cli_output import summary as _summary, write as _write
from deepinfer.env import MAX_DRAFT_TOKENS
from deepinfer.errors import ConfigError, DeepInferError, RequestError
from deepinfer.runtime.prefix import MODES as PREFIX_MODES
from deepinfer.runtime.sampling import MAX_LOGPROBS
from deepinfer.runtime.defaults import MAX_PREFILL_TOKENS


def _process_age() -> float:
    """Seconds since this process started (Linux /proc), so timings include interpreter start-up."""
    try:
        import os

        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return 0.0


_START = time.perf_counter() - _process_age()


@click.group()
@click.version_option(package_name="deepinfer")
def main() -> None:
    """deepinfer: DeepSeek-V4 inference."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)


def _register() -> None:
    from deepinfer.compile.cli import compile_cmd, kernels

    main.add_command(compile_cmd)
    main.add_command(kernels)


@main.group()
def run() -> None:
    """Run a model."""


@run.command("offline")
@click.option("--model", "model_dir", type=click.Path(file_okay=False), default=None,
              help="HF-format model directory [default: $DEEPINFER_HF_MODEL_DIR, else a tiny random-weight model]")
@click.option("--prompt", "prompts", multiple=True, help="A prompt (repeatable).")
@click.option("--prompts-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="JSONL, either plain prompts (one object per line with 'prompt', 'messages' or 'token_ids', and "
                   "optionally max_new_tokens, temperature, top_p, top_k, min_p, presence_penalty, "
                   "frequency_penalty, repetition_penalty, logit_bias, seed (or seq_seed), logprobs, stop, thinking, "
                   "so_args, "
                   "max_reasoning_tokens) or requests in an API's own shape, as OpenAI batch lines "
                   "({\"custom_id\", \"url\": \"/v1/chat/completions\" | \"/v1/responses\" | \"/v1/messages\", "
                   "\"body\"}), answered as OpenAI batch-output lines. A bad line gets an error record; the others run.")
@click.option("--stream", is_flag=True, default=False,
              help="For API-shaped requests: write each response's stream of chunks as it is produced "
                   "(JSONL {custom_id, event, data}), then a [DONE] line per request, instead of whole responses.")
@click.option("--token-ids", "token_ids", multiple=True, help="A prompt as comma-separated token ids (repeatable).")
@click.option("--chat/--raw", default=True, show_default=True,
              help="--prompt text as a chat user message (rendered by deepseek-recipe) or as raw text.")
@click.option("--thinking/--no-thinking", default=False, show_default=True, help="Thinking mode for chat prompts.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=1.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True)
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0 = disabled.")
@click.option("--min-p", type=click.FloatRange(0, 1), default=0.0, show_default=True, help="0 = disabled.")
@click.option("--presence-penalty", type=click.FloatRange(-2, 2), default=0.0, show_default=True)
@click.option("--frequency-penalty", type=click.FloatRange(-2, 2), default=0.0, show_default=True)
@click.option("--repetition-penalty", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="1 = off.")
@click.option("--seed", type=click.IntRange(min=0), default=None, help="Sampling seed (per request; default random).")
@click.option("--logprobs", type=click.IntRange(0, MAX_LOGPROBS), default=None,
              help="Return each generated token's logprob and the N most likely tokens' (log_softmax of the raw "
                   "logits, before penalties, temperature and filters; 0 = the sampled token's only) [default: off].")
@click.option("--stop", "stop", multiple=True, help="A stop string (repeatable).")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto", show_default=True,
              help="Compute dtype of the weights; auto = the target's default (float32 on the CPU, bfloat16 on GPUs/NPUs).")
@click.option("--quantization", type=click.Choice(["auto", "none"]), default="auto", show_default=True,
              help="auto: FP8 / FP4 checkpoint tensors stay in their own precision on every backend (FP8 "
                   "projections run W8A8, FP4 experts are converted inside the expert GEMM); none: dequantized to "
                   "--dtype at load.")
@click.option("--output", "output", default="-", show_default=True,
              help="Output file, or - for stdout. Each result is written and flushed as soon as it finishes.")
@click.option("--format", "fmt", type=click.Choice(["text", "jsonl"]), default=None,
              help="Plain prompts: text or jsonl records [default: text]. API-shaped requests are always answered "
                   "as JSONL batch-output lines.")
@click.option("--backend", type=click.Choice(list(backends.BACKEND_NAMES)), default=None,
              help="A target: sm90 / sm100 (TileLang kernels + CUDA graphs), ascend (TileLang kernels through "
                   "torch_npu), c (TileLang's c target on the CPU, fp32, for checking kernels), reference (PyTorch "
                   "reference ops); or an alias: cpu = reference, nvidia = the SM of the visible GPU [default: "
                   "$DEEPINFER_ACCELERATOR, else the visible device's target, else reference]")
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=64, show_default=True, help="Requests run together.")
@click.option("--max-prefill-tokens", type=click.IntRange(min=1), default=MAX_PREFILL_TOKENS, show_default=True,
              help="Prompt tokens per prefill step.")
@click.option("--max-model-len", type=click.IntRange(min=2), default=None,
              help="Longest sequence (prompt + output) [default: min(model limit, 8192)].")
@click.option("--num-blocks", type=click.IntRange(min=1), default=None,
              help="Cache blocks of 128 positions [default: from free GPU memory; on the CPU, every slot at full length].")
@click.option("--async-scheduling/--no-async-scheduling", default=True, show_default=True,
              help="Prepare the next decode step on the CPU while the device runs this one (same outputs).")
@click.option("--prefix-cache", type=click.Choice(PREFIX_MODES), default=None,
              help="Reuse cached prompt prefixes (DeepSeek-V4): approximate (default) prefills the last "
                   "DEEPINFER_SWA_REPLAY_TOKENS (128) tokens before a hit again to rebuild the sliding window; exact "
                   "keeps window snapshots at block boundaries (same tokens as off; batch-invariant runs' default); "
                   "off.")
@click.option("--speculative-tokens", type=click.IntRange(0, MAX_DRAFT_TOKENS), default=None,
              help="Draft tokens per decode step from the checkpoint's drafter (an MTP layer or DSpark blocks), "
                   "verified in one target step (same tokens as plain decoding); 0 = plain decoding [default: "
                   "$DEEPINFER_USE_NEXTN_DECODE, else 5 (DSpark: at most its block) when the checkpoint has one, "
                   "else 0].")
@click.option("--speculative-varlen/--no-speculative-varlen", default=None,
              help="Confidence-sized verification: per step, verify the drafts worth it across the batch, from the "
                   "drafts' confidences and the measured step costs [default: $DEEPINFER_ENABLE_MTP_VARLEN, else off].")
@click.option("--batch-invariant/--no-batch-invariant", default=None,
              help="Batch-invariant ops: a request's tokens do not depend on what it is batched with (DeepSeek-V4) "
                   "[default: $DEEPINFER_BATCH_INVARIANT, else off].")
@click.option("--data-parallel-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="Data-parallel attention ranks (each schedules its share of the requests and owns its cache).")
@click.option("--tensor-parallel-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="Tensor-parallel ranks for the attention projections (heads split over them).")
@click.option("--enable-expert-parallel", is_flag=True, default=False,
              help="Split the routed experts over all ranks (data x tensor parallel), tokens exchanged per MoE layer.")
@click.option("--enable-eplb", is_flag=True, default=False,
              help="Balance the split experts over the ranks from the token counts recorded during the run (EPLB).")
@click.option("--eplb-redundant-experts", type=click.IntRange(min=0), default=0, show_default=True,
              help="EPLB: expert slots beyond one per expert, given to replicas of the hottest experts.")
@click.option("--eplb-step-interval", type=click.IntRange(min=0), default=1000, show_default=True,
              help="EPLB: forward passes between rebalances (0: the placement made at start is kept).")
def offline(**options) -> None:
    """Generate for a batch of prompts, writing each result as soon as it finishes.

    Exit status: 0 when every request succeeded, 3 when some requests failed (each has an error record in the
    output), 1 for an error that stops the run (named on stderr), 2 for a bad option, 130 when interrupted
    (SIGINT or SIGTERM; every result finished before it is on disk)."""
    previous = signal.signal(signal.SIGTERM, _interrupt) if threading.current_thread() is threading.main_thread() else None
    ctx = click.get_current_context()
    explicit = frozenset(name for name in options if ctx.get_parameter_source(name) in (
        click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT))
    try:
        code = _offline(**options, explicit=explicit)
    except DeepInferError as exc:
        raise click.ClickException(str(exc)) from exc
    except KeyboardInterrupt:
        click.echo("deepinfer: interrupted; every result finished before the interrupt has been written", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except OSError as exc:  # writing the output (a full disk, a closed pipe)
        raise click.ClickException(f"{exc.filename or 'output'}: {exc.strerror or exc}") from exc
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if code:
        sys.exit(code)


EXIT_FAILED_REQUESTS = 3
EXIT_INTERRUPTED = 130
_SAMPLING_FLAGS = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "seed", "logprobs")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


@dataclass
class _Item:
    """One request of the run: its place (index, where it came from) and either what to run or why not."""

    index: int
    source: str
    prompt: Any = None
    params: Any = None
    error: str | None = None


def _offline(model_dir, prompts, prompts_file, stream, token_ids, chat, thinking, stop, dtype, output, fmt, backend,
             max_num_seqs, max_prefill_tokens, max_model_len, num_blocks, quantization, async_scheduling=True,
             batch_invariant=None, prefix_cache=None, speculative_tokens=None, speculative_varlen=None,
             data_parallel_size=1, tensor_parallel_size=1, enable_expert_parallel=False, enable_eplb=False,
             eplb_redundant_experts=0, eplb_step_interval=1000, explicit=frozenset(), **flags) -> int:
    from deepinfer.api import LLM
    from deepinfer.env import Env
    from deepinfer.prompts_file import plain_line, read_lines
    from deepinfer.runtime.sampling import SamplingParams

    base = {name: flags[name] for name in _SAMPLING_FLAGS}
    base["stop"] = tuple(stop)
    for name, value in base.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise click.BadParameter(f"{value} is not a finite number", param_hint=_flag(name))
    try:
        SamplingParams(**base)
    except RequestError as exc:
        name = next((n for n in base if f"sampling parameter {n}=" in str(exc)), "stop")
        raise click.BadParameter(str(exc), param_hint=_flag(name)) from exc
    items: list[_Item] = []
    for text in prompts:
        prompt = {"messages": [{"role": "user", "content": text}], "thinking": thinking} if chat else text
        items.append(_Item(len(items), f"--prompt {len(items)}", prompt, SamplingParams(**base)))
    for spec in token_ids:
        items.append(_Item(len(items), f"--token-ids {spec}", {"token_ids": _parse_ids(spec)}, SamplingParams(**base)))
    lines = list(read_lines(Path(prompts_file))) if prompts_file else []
    api_mode = any(error is None and "body" in obj for _, obj, error in lines)
    api_lines: list[dict[str, Any]] = []
    bad_lines: list[tuple[str, str]] = []  # API mode: (custom_id, message) of lines that are not requests
    for lineno, obj, error in lines:
        source = f"{prompts_file}:{lineno}"
        if api_mode and error is None and "body" not in obj:
            raise RequestError(f"{source}: a plain prompt line among requests in an API's shape (lines with a "
                               "'body'); the two cannot be mixed in one run")
        if api_mode:
            if error is None:
                api_lines.append(obj)  # checked per request by LLM.serve
            else:
                bad_lines.append((f"line-{lineno}", f"{source}: {error}"))
            continue
        item = _Item(len(items), source, error=error)
        if error is None:
            try:
                item.prompt, overrides = plain_line(obj, thinking)
                item.params = SamplingParams(**{**base, **overrides})
            except RequestError as exc:
                item.error = str(exc)
        items.append(item)
    if api_mode and items:
        raise RequestError("requests in an API's shape (lines with a 'body') cannot be mixed with plain prompts "
                           "(--prompt, --token-ids or plain lines) in one run")
    ignored = sorted(explicit & (set(_SAMPLING_FLAGS) | {"stop", "thinking", "chat"})) if api_mode else []
    if ignored:
        raise click.UsageError(f"{', '.join(_flag(n) for n in ignored)}: requests in an API's shape carry their own "
                               "parameters in their bodies; these options apply to plain prompts only")
    if "thinking" in explicit and thinking and not any(isinstance(it.prompt, dict) and "messages" in it.prompt
                                                       for it in items):
        raise click.UsageError("--thinking applies to chat prompts (--prompt with --chat, or 'messages' lines); "
                               "none was given")
    if stream and not api_mode:
        raise RequestError("--stream needs requests in an API's shape (--prompts-file lines with a 'body')")
    if api_mode and fmt == "text":
        raise RequestError("--format text: requests in an API's shape are answered as JSONL batch-output lines; "
                           "leave --format out or use --format jsonl")
    if not items and not api_mode:
        raise RequestError("no prompt given: use --prompt, --token-ids or --prompts-file")

    out = _open_output(output)  # before the model loads: a bad path fails now, not after minutes of loading
    try:
        model_dir = model_dir or Env.read().hf_model_dir
        if model_dir is None:
            click.echo("deepinfer: no --model and no DEEPINFER_HF_MODEL_DIR: using the embedded tiny DeepSeek-V4 "
                       "with RANDOM weights (its output is meaningless text)", err=True)
        logging.getLogger("deepinfer").info("deepinfer: start-up: interpreter and imports %.2f s",
                                            time.perf_counter() - _START)
        llm = LLM(model_dir, backend=backend, dtype=dtype, max_num_seqs=max_num_seqs,
                  max_prefill_tokens=max_prefill_tokens, max_model_len=max_model_len, num_blocks=num_blocks,
                  show_progress=True, quantization=quantization, async_scheduling=async_scheduling,
                  batch_invariant=batch_invariant, prefix_cache=prefix_cache, speculative_tokens=speculative_tokens,
                  speculative_varlen=speculative_varlen,
                  data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size,
                  enable_expert_parallel=enable_expert_parallel, enable_eplb=enable_eplb,
                  eplb_redundant_experts=eplb_redundant_experts, eplb_step_interval=eplb_step_interval)
        if not llm.leads:  # a rank torchrun started, not the first: rank 0 writes the results
            out = open(os.devnull, "w")  # noqa: SIM115 - closed below like any output
        else:
            click.echo(f"deepinfer: {llm.describe()}", err=True)
        if api_mode:
            failed = _serve(llm, api_lines, stream, out, bad_lines)
            n = len(api_lines) + len(bad_lines)
        else:
            failed = _generate(llm, items, fmt or "text", out)
            n = len(items)
    finally:
        if out is not sys.stdout:
            out.close()
    leads = llm.leads
    llm.close()
    if not leads:
        return 0
    _summary(llm.last_stats, n, _START)
    if failed:
        click.echo(f"deepinfer: {failed} of {n} request(s) failed (see their error records)", err=True)
        return EXIT_FAILED_REQUESTS
    return 0


def _open_output(output: str) -> TextIO:
    if output == "-":
        return sys.stdout
    try:
        return open(output, "w", encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"--output {output!r} cannot be written: {exc.strerror or exc}") from None


def _generate(llm, items: list[_Item], fmt: str, out: TextIO) -> int:
    """Plain prompts: each result (or error record) written and flushed as soon as it is final, in completion
    order; `index` says which request it is. Returns how many failed."""
    from deepinfer.runtime.request import RequestFailure

    failed = 0

    def write(record, item: _Item) -> None:
        nonlocal failed
        if isinstance(record, RequestFailure):
            failed += 1
            record = RequestFailure(item.index, record.error, record.kind, item.source)
        else:
            record = dataclasses.replace(record, index=item.index)
        _write(record, fmt, out)

    for item in items:
        if item.error is not None:
            write(RequestFailure(item.index, item.error), item)
    runnable = [it for it in items if it.error is None]
    if runnable:
        llm.generate([it.prompt for it in runnable], [it.params for it in runnable], use_tqdm=len(items) > 1,
                     errors="return", on_output=lambda r: write(r, runnable[r.index]))
    return failed


def _serve(llm, lines: list[dict[str, Any]], stream: bool, out: TextIO, bad_lines: list[tuple[str, str]]) -> int:
    """API-shaped requests: whole responses as OpenAI batch-output lines, or (--stream) chunks as they come;
    each written and flushed as soon as it is final; lines that are not requests (bad JSON, not an object)
    first, as 400s. Returns how many failed."""
    from deepinfer.serving.api_requests import APIError, error_body

    failed = 0

    def emit(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj, ensure_ascii=False) + "\n")
        out.flush()

    def done(r) -> None:
        nonlocal failed
        failed += isinstance(r, APIError)
        if stream:
            if isinstance(r, APIError):
                emit({"custom_id": r.custom_id, "status_code": r.status_code, "error": r.body})
            emit({"custom_id": r.custom_id, "data": "[DONE]"})
            return
        status, request_id, body = ((r.status_code, r.request_id, r.body) if isinstance(r, APIError)
                                    else (200, r.response.get("id", ""), r.response))
        emit({"id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": r.custom_id,
              "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None})

    for custom_id, message in bad_lines:
        done(APIError(custom_id, 400, error_body(message)))
    on_chunk = (lambda custom_id, chunk: emit({"custom_id": custom_id, **chunk})) if stream else None
    llm.serve(lines, stream=stream, use_tqdm=len(lines) > 1 and not stream, on_chunk=on_chunk, on_output=done)
    return failed


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parse_ids(spec: str) -> list[int]:
    try:
        ids = [int(t) for t in spec.replace(" ", "").split(",") if t]
    except ValueError:
        raise click.BadParameter(f"{spec!r} is not a comma-separated list of integers", param_hint="--token-ids") from None
    if not ids or min(ids) < 0:
        raise click.BadParameter(f"{spec!r}: token ids must be integers >= 0, at least one", param_hint="--token-ids")
    return ids


_register()
