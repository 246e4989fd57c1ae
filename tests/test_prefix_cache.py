"""The prefix cache (DeepSeek-V4, `--prefix-cache approximate|exact|off`): block names, sharing, reference counts
and eviction; in exact mode the same greedy tokens as without it (a shared system prompt, a conversation replayed
turn by turn, prefixes ending on and off block boundaries, preemption under a tiny cache, eviction between turns)
and first-token logprobs within chunked prefill's own distance from one-shot prefill; approximate mode runs, and
with a replay reaching position 0 it is exact too."""

from __future__ import annotations

import pytest
import torch

import deepinfer
from deepinfer.env import Env
from deepinfer.errors import ConfigError
from deepinfer.runtime.blocks import SlotBlocks
from deepinfer.runtime.cache_layout import CacheSpec
from deepinfer.runtime.prefix import PrefixMode, block_names
from deepinfer.runtime.sampling import SamplingParams

BT = 128
GREEDY = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 1000, (n,), generator=g).tolist()


def run(llm, prompts: list[list[int]], params=GREEDY):
    outs = llm.generate([{"token_ids": p} for p in prompts], params)
    assert llm.cache.used_blocks == 0, "a run left blocks referenced"
    if llm.cache.prefix is not None:
        assert not any(llm.cache.prefix.refs), "reference counts did not return to zero"
    return outs


@pytest.fixture(scope="module")
def llms():
    kw = dict(backend="reference", max_num_seqs=4)
    return {mode: deepinfer.LLM(prefix_cache=mode, **kw) for mode in ("off", "exact", "approximate")}


# ---- names and the index ----
def test_block_names_chain_over_the_whole_prefix():
    a, salt = tokens(3 * BT + 5, 1), b"model|dtype"
    names = block_names(a, BT, salt)
    assert len(names) == 3 and len(set(names)) == 3
    assert block_names(a, BT, salt, 2, names[1]) == names[2:]  # incremental = whole
    b = list(a)
    b[0] += 1  # a different first token renames every later block
    assert not set(block_names(b, BT, salt)) & set(names)
    assert block_names(a, BT, b"other model") != names


def test_shared_blocks_are_counted_cached_and_evicted_least_recently_used_first():
    cache = SlotBlocks(CacheSpec(num_blocks=6, max_seqs=3, max_blocks_per_seq=6))
    cache.enable_prefix(PrefixMode("approximate"), b"salt")
    p = tokens(2 * BT + 10, 2)
    first = cache.admit()
    assert cache.grow(first, len(p)) and len(first.blocks) == 3
    first.num_tokens = len(p)
    cache.publish(first, p)
    assert cache.cached_blocks == 2  # the partial third block is not published
    hit = cache.lookup(cache.names_of(p + [7]))
    assert hit.tokens == 2 * BT and hit.blocks == first.blocks[:2]
    second = cache.admit()
    assert cache.start(second, hit, p + [7]) == 2 * BT - 128  # approximate: the window's tokens again
    assert cache.used_blocks == 3 and cache.prefix.refs[first.blocks[0]] == 2
    shared, private = first.blocks[:2], first.blocks[2]
    cache.release(first)
    assert cache.prefix.refs[shared[0]] == 1 and cache.free_blocks == 6 - 2  # the private block is free again
    cache.release(second)
    assert cache.used_blocks == 0 and cache.cached_blocks == 2 and cache.free_blocks == 6
    # a new sequence needing every block evicts the cached ones (oldest first) once the free ones are gone
    third = cache.admit()
    assert cache.grow(third, 4 * BT)
    assert cache.cached_blocks == 2 and private in third.blocks
    assert cache.grow(third, 5 * BT) and cache.cached_blocks == 1
    # a released sequence's blocks go idle tail first, so the tail is evicted first: the prefix stays usable
    assert cache.lookup(cache.names_of(p + [7])).tokens == BT
    assert cache.grow(third, 6 * BT) and cache.cached_blocks == 0 and cache.lookup(cache.names_of(p + [7])).tokens == 0
    cache.release(third)


# ---- exact mode: the same tokens as without the cache ----
def test_exact_shared_system_prompt_gives_the_tokens_of_no_cache(llms):
    system = tokens(300, 3)
    prompts = [system + tokens(n, 10 + n) for n in (5, 40, 140, 1)]
    want = [o.token_ids for o in run(llms["off"], prompts)]
    exact = llms["exact"]
    one_by_one = [run(exact, [p])[0] for p in prompts]
    assert [o.token_ids for o in one_by_one] == want
    # the second request snapshots where the first one's blocks end; the later ones hit there
    assert [o.num_cached_tokens for o in one_by_one][2:] == [256, 256]
    batch = run(exact, prompts)
    assert [o.token_ids for o in batch] == want
    assert [o.num_cached_tokens for o in batch] == [256, 256, 384, 256]  # the third finds its own last block
    assert exact.last_stats.cached_tokens == 4 * 256 + 128 and exact.last_stats.input_tokens == sum(map(len, prompts))


def test_exact_conversation_replayed_turn_by_turn(llms):
    """Each turn's prompt is the previous turn's prompt, its output and new tokens; the outputs cross block
    boundaries during decode (snapshots taken by decode steps)."""
    params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    history, outputs = {}, {}
    for mode in ("off", "exact"):
        llm, prompt, outs = llms[mode], tokens(120, 5), []
        for turn in range(4):
            o = run(llm, [prompt], params)[0]
            outs.append(o)
            prompt = prompt + o.token_ids + tokens(100 + 17 * turn, 50 + turn)
        history[mode], outputs[mode] = prompt, outs
    assert [o.token_ids for o in outputs["exact"]] == [o.token_ids for o in outputs["off"]]
    cached = [o.num_cached_tokens for o in outputs["exact"]]
    assert cached[0] == 0 and all(c >= BT for c in cached[1:]), cached
    assert all(b > a for a, b in zip(cached[1:], cached[2:])), cached  # the hit grows with the history


def test_exact_prefixes_on_and_off_block_boundaries(llms):
    base = tokens(2 * BT + 3, 7)
    cases = [base[: 2 * BT], base[: 2 * BT] + [5], base[: 2 * BT - 1], base[: BT + 1], base]
    want = [o.token_ids for o in run(llms["off"], cases)]
    exact = llms["exact"]
    run(exact, [base + tokens(BT, 8)])  # publishes 4 blocks, a snapshot at its last full block (512) only
    got = [run(exact, [p])[0] for p in cases]
    assert [o.token_ids for o in got] == want
    # the first case finds no snapshot (a miss) and leaves them at 128 and 256 on the cached blocks it recomputed;
    # a prompt must keep one token to prefill (its logits give the first token)
    assert [o.num_cached_tokens for o in got] == [0, 2 * BT, BT, BT, 2 * BT]


def test_exact_first_token_logprobs_within_chunked_prefill_tolerance(llms):
    params = SamplingParams(temperature=0, max_new_tokens=1, logprobs=20)
    system = tokens(3 * BT + 40, 9)
    prompt = system + tokens(50, 11)
    one_shot = run(llms["off"], [prompt], params)[0].logprobs[0]
    chunked_llm = deepinfer.LLM(backend="reference", max_num_seqs=4, prefix_cache="off", max_prefill_tokens=64)
    chunked = run(chunked_llm, [prompt], params)[0].logprobs[0]
    exact = llms["exact"]
    run(exact, [system + tokens(30, 12)])
    run(exact, [system + tokens(31, 13)])  # snapshots where the shared blocks end
    hit = run(exact, [prompt], params)[0]
    assert hit.num_cached_tokens == 3 * BT

    def distance(a, b) -> float:
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        return max(abs(x - y) for (_, x), (_, y) in zip(a.top, b.top))

    tol = 4 * distance(chunked, one_shot) + 1e-5  # fp32: chunking alone moves the logits this much
    assert distance(hit.logprobs[0], one_shot) <= tol


def test_exact_hits_with_chunked_prefill(llms):
    """Prefill in 50-token chunks: snapshots are taken inside chunks, hits resume mid-chunk-schedule."""
    system = tokens(2 * BT + 40, 24)
    prompts = [system + tokens(n, 30 + n) for n in (20, 90, 7)]
    want = [o.token_ids for o in run(llms["off"], prompts)]
    llm = deepinfer.LLM(backend="reference", max_num_seqs=4, prefix_cache="exact", max_prefill_tokens=50)
    got = [run(llm, [p])[0] for p in prompts] + run(llm, prompts)
    assert [o.token_ids for o in got] == want + want
    # the first leaves a snapshot at its last full block (256); the second its own at 384, which it finds again
    assert [o.num_cached_tokens for o in got] == [0, 2 * BT, 2 * BT, 2 * BT, 3 * BT, 2 * BT]


# ---- preemption, eviction ----
def test_exact_preemption_under_a_tiny_cache_keeps_tokens_and_counts():
    """Four requests on a shared 2-block prefix each grow to 4 blocks while decoding: 2 shared + 8 private blocks
    do not fit in 7, so decode preempts requests that made progress; they come back on their own cached blocks."""
    system = tokens(2 * BT + 100, 14)
    prompts = [system + tokens(10 + 5 * i, 20 + i) for i in range(4)]  # 366-381 tokens: the 4th block in decode
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    kw = dict(backend="reference", max_num_seqs=4, num_blocks=7)
    want = [o.token_ids for o in run(deepinfer.LLM(prefix_cache="off", **kw), prompts, params)]
    llm = deepinfer.LLM(prefix_cache="exact", **kw)
    run(llm, prompts[:1], params)
    outs = run(llm, prompts, params)
    assert [o.token_ids for o in outs] == want
    stats = llm.last_stats
    assert stats.preemptions > 0 and sum(o.preemptions for o in outs) == stats.preemptions
    # a preempted request's prompt and tokens are found again: far fewer tokens prefilled than recomputing them
    recomputed = stats.prompt_tokens - (stats.input_tokens - stats.cached_tokens)
    assert 0 <= recomputed < stats.preemptions * BT, (recomputed, stats)


def test_a_hit_never_reads_an_evicted_block():
    kw = dict(backend="reference", max_num_seqs=2, num_blocks=6)
    llm, off = deepinfer.LLM(prefix_cache="exact", **kw), deepinfer.LLM(prefix_cache="off", **kw)
    convo = tokens(3 * BT + 10, 15)
    first = run(llm, [convo])[0]
    assert llm.cache.cached_blocks == 3
    names = set(llm.cache.prefix.block_of)
    run(llm, [tokens(5 * BT, 16)])  # an unrelated long request takes every block: the cached ones are evicted
    assert not names & set(llm.cache.prefix.block_of)
    again = run(llm, [convo + first.token_ids + tokens(20, 17)])[0]
    assert again.num_cached_tokens == 0
    assert again.token_ids == run(off, [convo + first.token_ids + tokens(20, 17)])[0].token_ids


# ---- approximate mode ----
def test_approximate_replays_the_window_and_reports_it(llms):
    system = tokens(3 * BT + 7, 18)
    llm = llms["approximate"]
    run(llm, [system + [3]])
    out = run(llm, [system + tokens(9, 19)])[0]
    assert out.num_cached_tokens == 3 * BT and llm.last_stats.replayed_tokens == 128
    assert llm.last_stats.prompt_tokens == len(system) + 9 - 3 * BT + 128


def test_approximate_with_a_replay_from_position_zero_is_exact(monkeypatch):
    monkeypatch.setenv("DEEPINFER_SWA_REPLAY_TOKENS", "4096")
    llm = deepinfer.LLM(backend="reference", max_num_seqs=2, prefix_cache="approximate")
    assert llm.prefix_cache.replay_tokens == 4096
    system = tokens(2 * BT + 50, 21)
    prompts = [system + tokens(60, 22), system + tokens(61, 23)]
    got = [run(llm, [p])[0] for p in prompts]
    assert got[1].num_cached_tokens == 2 * BT
    off = deepinfer.LLM(backend="reference", max_num_seqs=2, prefix_cache="off")
    assert [o.token_ids for o in got] == [o.token_ids for o in run(off, prompts)]


# ---- options ----
def test_prefix_cache_options_are_checked(monkeypatch):
    with pytest.raises(ConfigError, match="prefix_cache"):
        deepinfer.LLM(backend="reference", prefix_cache="sometimes")
    with pytest.raises(ConfigError, match="DEEPINFER_SWA_REPLAY_TOKENS='-3'"):
        Env.read({"DEEPINFER_SWA_REPLAY_TOKENS": "-3"})
    assert Env.read({}).swa_replay_tokens == 128
    with pytest.raises(ConfigError, match="mode 'both'"):
        PrefixMode("both")
    assert deepinfer.LLM(backend="reference", max_num_seqs=1).prefix_cache.mode == "approximate"
    invariant = deepinfer.LLM(backend="reference", max_num_seqs=1, batch_invariant=True)
    assert invariant.prefix_cache.mode == "exact" and invariant.cache.spec.snapshots == 4
