"""Asynchronous scheduling (on by default): the next decode step is scheduled and launched before the host has
read this step's tokens (they feed it on the device). Outputs are the same with it on and off, for greedy and
seeded sampling, penalties and logit bias, and structured output (preemption under a tiny cache, both ways:
tests/test_engine.py); a request that
finishes while the next step is already launched loses nothing, and its blocks are released only once that step
has landed."""

from __future__ import annotations

import pytest
import torch

import deepinfer
from deepinfer.errors import ConfigError
from deepinfer.runtime.sampling import SamplingParams
from deepinfer.runtime.scheduler import SchedulerConfig


def guard_releases(llm) -> list[int]:
    """Fail the run if a sequence's cache is released while a launched decode step that has a row of it has not
    landed (its tokens read back); returns the slots released (the test checks the guard saw releases)."""
    engine, unlanded, released = llm.engine, [], []
    decode, land, release = engine.steps.decode, engine._land, llm.cache.release

    def launched(ids, positions, seqs):
        unlanded.append([id(s) for s in seqs])
        return decode(ids, positions, seqs)

    def landed(flight, *args):
        unlanded.pop(0)  # flights land in launch order
        return land(flight, *args)

    def checked(seq):
        assert not any(id(seq) in step for step in unlanded), f"slot {seq.slot} released while a step is in flight"
        released.append(seq.slot)
        release(seq)

    engine.steps.decode, engine._land, llm.cache.release = launched, landed, checked
    return released


@pytest.fixture(scope="module")
def pair():
    on, off = deepinfer.LLM(max_num_seqs=8), deepinfer.LLM(max_num_seqs=8, async_scheduling=False)
    assert on.engine.config.async_scheduling and not off.engine.config.async_scheduling
    return on, off


def prompts(lengths, seed=0, vocab=1000):
    g = torch.Generator().manual_seed(seed)
    return [{"token_ids": torch.randint(2, vocab, (n,), generator=g).tolist()} for n in lengths]


def same(a, b) -> None:
    assert [(o.token_ids, o.text, o.finish_reason) for o in a] == [(o.token_ids, o.text, o.finish_reason) for o in b]


def test_sampling_outputs_equal_with_and_without_async(pair):
    on, off = pair
    released = guard_releases(on)
    reqs = prompts([5, 40, 17, 9, 63, 3])
    params = [SamplingParams(temperature=0, max_new_tokens=23, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_new_tokens=31, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=20, seed=3, max_new_tokens=4, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=11, repetition_penalty=1.3, frequency_penalty=0.5,
                             max_new_tokens=19, ignore_eos=True),
              SamplingParams(temperature=0, logit_bias={17: 5.0, 99: 3.0}, max_new_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, min_p=0.1, seed=5, max_new_tokens=27)]
    a = on.generate(reqs, params, use_tqdm=False)
    stats = on.last_stats
    b = off.generate(reqs, params, use_tqdm=False)
    same(a, b)
    assert stats.ahead_steps > 0 and off.last_stats.ahead_steps == 0
    assert stats.decode_tokens == off.last_stats.decode_tokens  # every token appended once, none from dropped rows
    assert sorted(released) == sorted(set(released)) and len(released) == len(reqs)
    assert on.cache.used_blocks == 0 and on.cache.free_slots == on.cache.spec.max_seqs


def test_structured_outputs_equal_with_and_without_async(pair):
    on, off = pair
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    items = [{"messages": [{"role": "user", "content": f"r{i}"}], "so_args": {"json_schema": schema}} for i in range(5)]
    items.append({"messages": [{"role": "user", "content": "free"}]})  # an unconstrained row beside them
    params = [SamplingParams(temperature=1.0, seed=40 + i, max_new_tokens=48) for i in range(6)]
    a = on.generate(items, params, use_tqdm=False)
    assert on.last_stats.ahead_steps > 0 and on.last_stats.mask_seconds > 0
    same(a, off.generate(items, params, use_tqdm=False))


def test_a_request_finishing_while_the_next_step_is_launched_loses_nothing(pair):
    """Request A stops on a token (an end-of-sequence id) that the host sees only after the next step, with A's
    row in it, is already launched: A ends exactly there, the dropped row adds nothing, B runs on unchanged."""
    on, off = pair
    reqs = prompts([7, 12], seed=5)
    greedy = SamplingParams(temperature=0, max_new_tokens=30)
    free = [o.token_ids for o in off.generate(reqs, greedy, use_tqdm=False)]
    a, b = free
    k = next(i for i in range(3, 20) if a[i] not in a[:i] and a[i] not in b)  # A's first `stop` comes at k
    for llm in (on, off):
        llm.engine.eos = frozenset({a[k]})
    try:
        released = guard_releases(on)
        got = on.generate(reqs, greedy, use_tqdm=False)
        stats = on.last_stats
        ref = off.generate(reqs, greedy, use_tqdm=False)
    finally:
        for llm in (on, off):
            llm.engine.eos = frozenset(llm.engine.steps.eos_token_ids)
    same(got, ref)
    assert got[0].token_ids == a[: k + 1] and got[0].finish_reason == "stop"
    assert got[1].token_ids == b and got[1].finish_reason == "length"
    assert stats.dropped_rows >= 1  # A's row in the step launched before its stop was seen
    assert len(released) == 2 and on.cache.used_blocks == 0


def test_async_scheduling_flag_is_checked():
    with pytest.raises(ConfigError, match="async_scheduling must be True or False, got 'yes'"):
        SchedulerConfig(async_scheduling="yes")


def test_async_steps_follow_the_same_schedule_when_requests_wait(pair):
    """More requests than seats: a seat that frees on a length limit (known before the token is read) is taken
    as soon as without asynchronous scheduling, so both run the same steps."""
    on, off = pair
    reqs = prompts([3, 5, 4, 6, 3, 7, 5, 4, 6, 3], seed=9)
    params = [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True) for n in (2, 9, 4, 12, 3, 7, 5, 2, 8, 6)]
    same(on.generate(reqs, params, use_tqdm=False), off.generate(reqs, params, use_tqdm=False))
    assert on.last_stats.ahead_steps > 0
    assert on.last_stats.decode_steps == off.last_stats.decode_steps and on.last_stats.dropped_rows == 0
