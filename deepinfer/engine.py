"""The generation loop: prefill (chunked under a token budget) and batched decode over many requests.

Each step either prefills (the next chunks of the requests still reading their prompt, several requests in
one forward) or decodes (one new token for every running request, in one forward). A request ends on EOS, a
stop string, its `max_new_tokens`, or the model's position limit.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from deepinfer.errors import ConfigError
from deepinfer.model.model import DeepseekV4
from deepinfer.model.state import ForwardBatch, SeqSlice
from deepinfer.request import Request, RequestOutput
from deepinfer.sampling import sample


@dataclass(frozen=True)
class EngineConfig:
    max_prefill_tokens: int = 2048  # prompt tokens per prefill forward (chunked prefill)
    max_num_seqs: int = 64  # requests run together

    def __post_init__(self) -> None:
        for name in ("max_prefill_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass
class RunStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_tokens: int = 0  # tokens produced by decode steps (the first token of a request comes from prefill)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    first_token_time: float | None = None


class Engine:
    def __init__(self, model: DeepseekV4, config: EngineConfig):
        self.model, self.config = model, config
        self.eos = frozenset(model.cfg.eos_token_ids)
        self.max_len = model.cfg.max_position_embeddings

    def run(self, requests: list[Request], on_finish: Callable[[RequestOutput], None] | None = None) -> tuple[list[RequestOutput], RunStats]:
        stats = RunStats()
        waiting, running = deque(requests), []
        outputs: dict[int, RequestOutput] = {}
        while waiting or running:
            while waiting and len(running) < self.config.max_num_seqs:
                running.append(waiting.popleft())
            prefilling = [r for r in running if r.in_prefill]
            if prefilling:
                self._prefill(prefilling, stats)
            else:
                self._decode(running, stats)
            for r in [r for r in running if r.finish_reason is not None]:
                outputs[r.index] = self._finish(r)
                if on_finish is not None:
                    on_finish(outputs[r.index])
            running = [r for r in running if r.finish_reason is None]
        stats.generated_tokens = sum(len(o.token_ids) for o in outputs.values())
        return [outputs[r.index] for r in requests], stats

    # ---- steps ---------------------------------------------------------------------------------
    def _prefill(self, reqs: list[Request], stats: RunStats) -> None:
        budget = self.config.max_prefill_tokens
        ids, positions, seqs, logit_rows, completing = [], [], [], [], []
        offset = 0
        for r in reqs:
            if budget == 0:
                break
            take = min(len(r.prompt_ids) - r.prefilled, budget)
            ids.extend(r.prompt_ids[r.prefilled : r.prefilled + take])
            positions.extend(range(r.prefilled, r.prefilled + take))
            seqs.append(SeqSlice(r.state, offset, take))
            r.prefilled += take
            offset += take
            budget -= take
            if not r.in_prefill:
                logit_rows.append(offset - 1)
                completing.append(r)
        start = time.perf_counter()
        logits = self._forward(ids, positions, seqs, logit_rows)
        if completing:
            self._sample_and_append(completing, logits)
        stats.prefill_seconds += time.perf_counter() - start
        stats.prompt_tokens += len(ids)
        if completing and stats.first_token_time is None:
            stats.first_token_time = time.perf_counter()

    def _decode(self, reqs: list[Request], stats: RunStats) -> None:
        start = time.perf_counter()
        ids = [r.generated[-1] for r in reqs]
        positions = [r.num_tokens - 1 for r in reqs]
        seqs = [SeqSlice(r.state, i, 1) for i, r in enumerate(reqs)]
        logits = self._forward(ids, positions, seqs, None)
        self._sample_and_append(reqs, logits)
        stats.decode_seconds += time.perf_counter() - start
        stats.decode_steps += 1
        stats.decode_tokens += len(reqs)

    def _forward(self, ids, positions, seqs, logit_rows) -> torch.Tensor:
        device = self.model.device
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            seqs=tuple(seqs),
            logit_rows=None if logit_rows is None else torch.tensor(logit_rows, dtype=torch.long, device=device),
        )
        return self.model.forward(batch)

    def _sample_and_append(self, reqs: list[Request], logits: torch.Tensor) -> None:
        tokens = sample(logits, [r.params for r in reqs], [r.seed for r in reqs], [r.num_tokens for r in reqs])
        now = time.perf_counter()
        for r, token in zip(reqs, tokens):
            r.generated.append(token)
            if r.first_token_time is None:
                r.first_token_time = now
            if token in self.eos and not r.params.ignore_eos:
                r.finish_reason = "stop"
                continue
            r.output.push(token)
            if r.output.stopped:
                r.finish_reason = "stop"
            elif len(r.generated) >= r.params.max_new_tokens or r.num_tokens >= self.max_len:
                r.finish_reason = "length"

    def _finish(self, r: Request) -> RequestOutput:
        parsed = r.output.finish(r.finish_reason)
        r.state = None  # release the sequence's cache state
        r.finish_time = time.perf_counter()
        return RequestOutput(
            index=r.index,
            prompt=r.prompt_text,
            prompt_token_ids=list(r.prompt_ids),
            token_ids=list(r.generated),
            text=parsed["text"],
            reasoning_content=parsed["reasoning_content"],
            tool_calls=parsed["tool_calls"],
            finish_reason=parsed["finish_reason"],
            time_to_first_token=(r.first_token_time or r.finish_time) - r.arrival,
            latency=r.finish_time - r.arrival,
        )
