"""The `deepinfer` command line."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import click

import backends

from deepinfer.errors import DeepInferError, RequestError



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
_ITEM_KEYS = ("prompt", "messages", "token_ids", "thinking", "so_args", "max_reasoning_tokens")
_OVERRIDES = {"max_new_tokens": int, "temperature": float, "top_p": float, "top_k": int, "seed": int, "stop": list}


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
                   "optionally max_new_tokens, temperature, top_p, top_k, seed, stop, thinking, so_args, "
                   "max_reasoning_tokens) or requests in an API's own shape, as OpenAI batch lines "
                   "({\"custom_id\", \"url\": \"/v1/chat/completions\" | \"/v1/responses\" | \"/v1/messages\", "
                   "\"body\"}), answered as OpenAI batch-output lines.")
@click.option("--stream", is_flag=True, default=False,
              help="For API-shaped requests: write each response's stream of chunks as it is produced "
                   "(JSONL {custom_id, event, data}), then a [DONE] line per request, instead of whole responses.")
@click.option("--token-ids", "token_ids", multiple=True, help="A prompt as comma-separated token ids (repeatable).")
@click.option("--chat/--raw", default=True, show_default=True,
              help="--prompt text as a chat user message (rendered by deepseek-recipe) or as raw text.")
@click.option("--thinking/--no-thinking", default=False, show_default=True, help="Thinking mode for chat prompts.")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=1.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True, help="0 = disabled.")
@click.option("--seed", type=int, default=None, help="Sampling seed (per request; default random).")
@click.option("--stop", "stop", multiple=True, help="A stop string (repeatable).")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto", show_default=True,
              help="Compute dtype of the weights; auto = the target's default (float32 on the CPU, bfloat16 on GPUs/NPUs).")
@click.option("--output", "output", default="-", show_default=True, help="Output file, or - for stdout.")
@click.option("--format", "fmt", type=click.Choice(["text", "jsonl"]), default="text", show_default=True)
@click.option("--backend", type=click.Choice(list(backends.BACKEND_NAMES)), default=None,
              help="A target: sm90 / sm100 (TileLang kernels + CUDA graphs), ascend (TileLang kernels through "
                   "torch_npu), c (TileLang's c target on the CPU, fp32, for checking kernels), reference (PyTorch "
                   "reference ops); or an alias: cpu = reference, nvidia = the SM of the visible GPU [default: "
                   "$DEEPINFER_ACCELERATOR, else the visible device's target, else reference]")
@click.option("--max-num-seqs", type=int, default=64, show_default=True, help="Requests run together.")
@click.option("--max-prefill-tokens", type=int, default=2048, show_default=True, help="Prompt tokens per prefill step.")
@click.option("--max-model-len", type=int, default=None,
              help="Longest sequence (prompt + output) [default: min(model limit, 8192)].")
@click.option("--num-blocks", type=int, default=None,
              help="Cache blocks of 128 positions [default: from free GPU memory; on the CPU, every slot at full length].")
def offline(model_dir, prompts, prompts_file, stream, token_ids, chat, thinking, max_new_tokens, temperature, top_p, top_k,
            seed, stop, dtype, output, fmt, backend, max_num_seqs, max_prefill_tokens, max_model_len, num_blocks) -> None:
    """Generate for a batch of prompts and print or save the results."""
    try:
        _offline(**locals())
    except DeepInferError as exc:
        raise click.ClickException(str(exc)) from exc


def _offline(model_dir, prompts, prompts_file, stream, token_ids, chat, thinking, max_new_tokens, temperature, top_p, top_k,
             seed, stop, dtype, output, fmt, backend, max_num_seqs, max_prefill_tokens, max_model_len, num_blocks) -> None:
    from deepinfer.api import LLM
    from deepinfer.env import Env
    from deepinfer.runtime.sampling import SamplingParams

    base = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                stop=tuple(stop))
    items: list[Any] = []
    params: list[SamplingParams] = []
    for text in prompts:
        items.append({"messages": [{"role": "user", "content": text}], "thinking": thinking} if chat else text)
        params.append(SamplingParams(**base))
    for spec in token_ids:
        items.append({"token_ids": _parse_ids(spec)})
        params.append(SamplingParams(**base))
    api_lines: list[dict[str, Any]] = []
    if prompts_file:
        for item, overrides in _read_prompts_file(Path(prompts_file), thinking):
            if overrides is None:
                api_lines.append(item)
                continue
            items.append(item)
            params.append(SamplingParams(**{**base, **overrides}))
    if api_lines and items:
        raise RequestError("requests in an API's shape (lines with a 'body') cannot be mixed with plain prompts "
                           "(--prompt, --token-ids or plain lines) in one run")
    if stream and not api_lines:
        raise RequestError("--stream needs requests in an API's shape (--prompts-file lines with a 'body')")
    if not items and not api_lines:
        raise RequestError("no prompt given: use --prompt, --token-ids or --prompts-file")

    model_dir = model_dir or Env.read().hf_model_dir
    if model_dir is None:
        click.echo("deepinfer: no --model and no DEEPINFER_HF_MODEL_DIR: using the embedded tiny DeepSeek-V4 "
                   "with RANDOM weights (its output is meaningless text)", err=True)
    llm = LLM(model_dir, backend=backend, dtype=dtype, max_num_seqs=max_num_seqs, max_prefill_tokens=max_prefill_tokens,
              max_model_len=max_model_len, num_blocks=num_blocks, show_progress=True)
    ops = f"TileLang kernels for {llm.backend.kernel_target}" if llm.backend.kernel_target else "PyTorch reference ops"
    spec = llm.cache.spec
    click.echo(f"deepinfer: model {model_dir or 'tiny-random'} ({llm.config.num_hidden_layers} layers, "
               f"{llm.model.dtype}), tokenizer {llm.recipe.path} ({llm.recipe.encoding_name} encoding), "
               f"backend {llm.backend.name} ({ops}), cache {spec.num_blocks} blocks x {spec.block_tokens} positions, "
               f"max {spec.max_tokens} per sequence", err=True)
    out = sys.stdout if output == "-" else open(output, "w", encoding="utf-8")
    try:
        if api_lines:
            _serve(llm, api_lines, stream, out)
            n = len(api_lines)
        else:
            outputs = llm.generate(items, params, use_tqdm=len(items) > 1)
            _write(outputs, fmt, out)
            n = len(outputs)
    finally:
        if out is not sys.stdout:
            out.close()
    _summary(llm.last_stats, n)


def _serve(llm, lines: list[dict[str, Any]], stream: bool, out: TextIO) -> None:
    """API-shaped requests: whole responses as OpenAI batch-output lines, or (--stream) chunks as they come."""
    from deepinfer.serving.api_requests import APIError

    def emit(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj, ensure_ascii=False) + "\n")
        out.flush()

    on_chunk = (lambda custom_id, chunk: emit({"custom_id": custom_id, **chunk})) if stream else None
    results = llm.serve(lines, stream=stream, use_tqdm=len(lines) > 1 and not stream, on_chunk=on_chunk)
    for r in results:
        if stream:
            if isinstance(r, APIError):
                emit({"custom_id": r.custom_id, "status_code": r.status_code, "error": r.body})
            emit({"custom_id": r.custom_id, "data": "[DONE]"})
            continue
        status, body = (r.status_code, r.body) if isinstance(r, APIError) else (200, r.response)
        emit({"id": f"batch_req_{r.custom_id}", "custom_id": r.custom_id,
              "response": {"status_code": status, "body": body}, "error": None})


def _parse_ids(spec: str) -> list[int]:
    try:
        return [int(t) for t in spec.replace(" ", "").split(",") if t]
    except ValueError:
        raise RequestError(f"--token-ids {spec!r} is not a comma-separated list of integers") from None


def _read_prompts_file(path: Path, thinking: bool):
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RequestError(f"{path}:{lineno}: not valid JSON: {exc}") from None
            if not isinstance(obj, dict):
                raise RequestError(f"{path}:{lineno}: each line must be a JSON object, got {type(obj).__name__}")
            if "body" in obj:  # a request in an API's own shape; checked per request by LLM.serve
                yield obj, None
                continue
            overrides = {}
            for key, kind in _OVERRIDES.items():
                if key in obj and obj[key] is not None:
                    value = obj.pop(key)
                    overrides[key] = tuple(value) if kind is list and isinstance(value, list) else value
            item = {k: v for k, v in obj.items() if k in _ITEM_KEYS}
            unknown = sorted(set(obj) - set(item))
            if unknown:
                raise RequestError(f"{path}:{lineno}: unknown key(s) {unknown}; accepted: {', '.join(_ITEM_KEYS)}, "
                                   f"{', '.join(_OVERRIDES)}, or an API request line with 'body'")
            if "messages" in item:
                item.setdefault("thinking", thinking)
            yield item, overrides


def _write(outputs, fmt: str, stream: TextIO) -> None:
    for o in outputs:
        if fmt == "jsonl":
            stream.write(json.dumps(o.to_dict(), ensure_ascii=False) + "\n")
            continue
        stream.write(f"=== request {o.index} ({o.num_prompt_tokens} prompt tokens, {o.num_generated_tokens} generated, "
                     f"finish: {o.finish_reason}) ===\n")
        if o.reasoning_content:
            stream.write(f"[thinking]\n{o.reasoning_content}\n[answer]\n")
        stream.write(o.text + "\n")
        if o.tool_calls:
            stream.write(f"[tool calls] {json.dumps(o.tool_calls, ensure_ascii=False)}\n")
    stream.flush()


def _summary(stats, n_requests: int) -> None:
    if stats is None:
        return
    decode_rate = stats.decode_tokens / stats.decode_seconds if stats.decode_seconds else 0.0
    prefill_rate = stats.prompt_tokens / stats.prefill_seconds if stats.prefill_seconds else 0.0
    ttft = (stats.first_token_time - _START) if stats.first_token_time else float("nan")
    click.echo(
        f"deepinfer: {n_requests} request(s), {stats.prompt_tokens} prompt + {stats.generated_tokens} generated tokens; "
        f"prefill {prefill_rate:.1f} tok/s, decode {decode_rate:.1f} tok/s ({stats.decode_steps} steps); "
        f"first token {ttft:.2f} s after start" + (f"; {stats.preemptions} preemption(s)" if stats.preemptions else ""),
        err=True,
    )


_register()
