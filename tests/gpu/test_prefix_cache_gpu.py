"""The prefix cache on the H200 (sm90 kernels, bf16, CUDA-graph decode): in exact mode, with the batch-invariant
kernels, a hit gives the bits of a run without the cache (tokens and logprobs), for a shared system prompt and a
conversation replayed turn by turn whose outputs cross block boundaries in decode (snapshots taken after graph
replays); approximate mode completes and shares blocks. Run with `pytest -m gpu` on the GPU host."""

from __future__ import annotations

import pytest
import torch

import deepinfer
from deepinfer.runtime.sampling import SamplingParams

pytestmark = pytest.mark.gpu
BT = 128


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 1000, (n,), generator=g).tolist()


def run(llm, prompts, params):
    outs = llm.generate([{"token_ids": p} for p in prompts], params)
    assert llm.cache.used_blocks == 0
    return outs


def signature(outs):
    return [(o.token_ids, [(e.token_id, e.logprob, e.top) for e in o.logprobs]) for o in outs]


@pytest.fixture(scope="module")
def invariant(cuda):
    kw = dict(backend="nvidia", dtype="bfloat16", max_num_seqs=8, batch_invariant=True)
    return {mode: deepinfer.LLM(prefix_cache=mode, **kw) for mode in ("off", "exact")}


def test_exact_hits_give_the_bits_of_no_cache(invariant):
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True, logprobs=5)
    system = tokens(3 * BT + 30, 1)
    prompts = [system + tokens(n, 10 + n) for n in (3, 70, 150, 200)]
    want = signature(run(invariant["off"], prompts, params))
    exact = invariant["exact"]
    got = [run(exact, [p], params)[0] for p in prompts]
    assert signature(got) == want
    assert all(o.num_cached_tokens >= 3 * BT for o in got[2:]), [o.num_cached_tokens for o in got]
    batch = run(exact, prompts, params)
    assert signature(batch) == want and all(o.num_cached_tokens >= 3 * BT for o in batch)


def test_exact_conversation_turn_by_turn(invariant):
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True, logprobs=2)
    runs = {}
    for mode, llm in invariant.items():
        prompt, outs = tokens(100, 2), []
        for turn in range(4):
            o = run(llm, [prompt], params)[0]
            outs.append(o)
            prompt = prompt + o.token_ids + tokens(90 + 13 * turn, 30 + turn)
        runs[mode] = outs
    assert signature(runs["exact"]) == signature(runs["off"])
    cached = [o.num_cached_tokens for o in runs["exact"]]
    assert cached[0] == 0 and all(b > a for a, b in zip(cached[1:], cached[2:])) and cached[1] >= BT, cached


def test_approximate_mode_runs_and_shares(cuda):
    llm = deepinfer.LLM(backend="nvidia", dtype="bfloat16", max_num_seqs=8, prefix_cache="approximate")
    params = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    system = tokens(4 * BT + 10, 3)
    run(llm, [system + [5]], params)
    outs = run(llm, [system + tokens(20 + i, 40 + i) for i in range(6)], params)
    assert all(o.num_cached_tokens == 4 * BT and len(o.token_ids) == 16 for o in outs)
    assert llm.last_stats.replayed_tokens == 6 * 128
