"""DSpark block drafting (model/dspark.py, runtime/drafters.py `DSparkDrafts`) on TINY_DSPARK.

- The drafter against a dense re-computation written here from DeepSeek's reference `DSparkBlock` semantics:
  the context KV rebuilt from a fresh whole-context prefill (not the rings the drafter filled chunk by chunk),
  attention as an explicit softmax over [window ; whole block] plus the sink, the Markov bias of the token
  before each draw, the confidence head; two requests in one pass, one past the window (its ring has wrapped),
  one shorter than it.
- Speculative decoding with DSpark drafts gives plain decoding's tokens: greedy and seeded, fixed and
  confidence-sized verification, mixed prompt lengths, preemption, structured output; stats.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import deepinfer
from deepinfer.config import ModelConfig
from deepinfer.model.attention import finish, project
from deepinfer.model.dspark import DSparkDrafter
from deepinfer.model.mtp import draft_share
from deepinfer.model.moe import moe
from deepinfer.runtime.sampling import SamplingParams
from deepinfer.tiny import TINY_CONFIG, random_tensors
from tests.helpers import TINY_DSPARK, save_model_dir

VOCAB = TINY_DSPARK["vocab_size"]
GREEDY = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    cfg = ModelConfig.from_dict(TINY_DSPARK)
    return save_model_dir(tmp_path_factory.mktemp("dspark") / "tiny-dspark", TINY_DSPARK, random_tensors(cfg, seed=3))


@pytest.fixture(scope="module")
def plain(model_dir):
    return deepinfer.LLM(model_dir, max_num_seqs=4, speculative_tokens=0, prefix_cache="off")


@pytest.fixture(scope="module")
def spec(model_dir):
    llm = deepinfer.LLM(model_dir, max_num_seqs=4, prefix_cache="off")
    assert llm.speculative_tokens == 4 and type(llm.engine.speculator.drafts).__name__ == "DSparkDrafts"
    return llm


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"token_ids": torch.randint(2, VOCAB, (n,), generator=g).tolist()} for n in lengths]


# ---- the drafter against a dense re-computation ---------------------------------------------------------------

def dense_draft(llm, ids: list[int]) -> tuple[list[int], list[float]]:
    """Greedy drafts after context `ids` (its last token is the anchor), from scratch: one prefill of the context
    on a fresh slot for the tapped streams, the window's KV from them, dense attention."""
    model, cache = llm.model, llm.cache
    cfg, ops, w, ds, eps = model.cfg, model.ops, model.weights.dspark, model.cfg.dspark, model.cfg.rms_norm_eps
    context, anchor, n = ids[:-1], ids[-1], len(ids) - 1
    seq = cache.admit()
    cache.grow(seq, n)
    try:
        _, taps = model.prefill(cache, torch.tensor(context), torch.arange(n), [(seq, 0, n)], hidden=True)
    finally:
        cache.release(seq)
    rope = model.main_rope
    lo = max(0, n - cfg.sliding_window)  # the window: positions n - W .. n - 1 (those that exist)
    main = ops.rms_norm(ops.linear(taps[lo:], w.main_proj), w.main_norm, eps)
    ctx_pos = torch.arange(lo, n, dtype=torch.int32)
    b = ds.block_size
    block_pos = torch.arange(n, n + b, dtype=torch.int32)
    drafter = DSparkDrafter(model)
    streams = ops.embedding(torch.tensor([anchor] + [ds.noise_token_id] * (b - 1)), model.weights.embed)
    streams = streams.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
    for block in w.blocks:
        a = block.attn
        ctx_kv = ops.rope(ops.rms_norm(ops.linear(main, a.kv_proj), a.kv_norm, eps), ctx_pos, rope.inv_freq,
                          rope.attention_factor)

        def attend(h, a=a, ctx_kv=ctx_kv):
            p = project(drafter.ctx, a, h, block_pos)
            keys = torch.cat([ctx_kv, p.kv]).float()  # every query: the window and the whole block
            scores = torch.einsum("shd,kd->shk", p.q.float(), keys) * cfg.head_dim**-0.5
            sink = a.sinks.float().view(1, -1, 1).expand(b, -1, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
            return finish(drafter.ctx, a, torch.einsum("shk,kd->shd", probs, keys).to(p.q.dtype), block_pos)

        def ffn(h, block=block):
            return moe(ops, block.moe, h, ds.num_experts_per_tok, cfg.scoring_func, cfg.routed_scaling_factor,
                       cfg.swiglu_limit)

        streams = model.block(block, streams, attend, ffn)
    hc = w.hc_head
    collapsed = ops.hc_head(streams, hc.fn, hc.base, hc.scale, cfg.hc_eps, eps).float()
    base = ops.linear(ops.rms_norm(collapsed.to(streams.dtype), w.norm, eps), model.weights.lm_head).float()
    drafts, confidence, prev = [], [], anchor
    for i in range(b):
        e = w.markov_embed[prev].float()
        corrected = base[i] + e @ w.markov_head.float().T
        confidence.append(torch.sigmoid(torch.cat([collapsed[i], e]) @ w.confidence.float()[0]).item())
        prev = int(corrected.argmax())
        drafts.append(prev)
    return drafts, confidence


def test_drafter_matches_dense_recomputation(spec):
    """Two contexts, one past the window (ring wrapped; read in chunks of a prefill and verify-sized steps), one
    shorter than the window, drafted in one pass: each equals the dense re-computation."""
    model, cache = spec.model, spec.cache
    drafter = DSparkDrafter(model)
    g = torch.Generator().manual_seed(1)
    contexts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (170, 23)]
    shares = []
    for ids in contexts:
        seq = cache.admit()
        n = len(ids) - 1
        cache.grow(seq, n)
        share = draft_share(seq, 0)
        # the target's rows arrive in pieces: a prefill chunk, then steps of 1-3 kept rows
        cuts = sorted({0, n, *range(min(n, 90), n, 3)}) if n > 90 else [0, n]
        for s, e in zip(cuts, cuts[1:]):
            _, taps = model.prefill(cache, torch.tensor(ids[s:e]), torch.arange(s, e), [(seq, 0, e - s)],
                                    hidden=True)
            drafter.read(cache, taps, torch.arange(s, e), [(share, 0, e - s)])
        assert share.num_tokens == n
        shares.append((seq, share))
    try:
        tokens, confidence = drafter.draft(cache, torch.tensor([ids[-1] for ids in contexts]),
                                           torch.tensor([len(ids) - 1 for ids in contexts]),
                                           [share for _, share in shares], lambda logits, i: logits.argmax(-1))
    finally:
        for seq, _ in shares:
            cache.release(seq)
    for row, ids in enumerate(contexts):
        want_tokens, want_conf = dense_draft(spec, ids)
        assert tokens[row].tolist() == want_tokens, f"context of {len(ids)}"
        torch.testing.assert_close(confidence[row], torch.tensor(want_conf), atol=1e-5, rtol=1e-4)
        assert ((confidence[row] > 0) & (confidence[row] < 1)).all()


def test_confidence_and_drafts_depend_on_the_context(spec):
    """Different contexts give different base logits: the drafter reads the rings (not a constant)."""
    a, _ = dense_draft(spec, prompts([40], seed=7)[0]["token_ids"])
    b, _ = dense_draft(spec, prompts([40], seed=8)[0]["token_ids"])
    c, _ = dense_draft(spec, prompts([40], seed=9)[0]["token_ids"])
    assert not (a == b == c)


# ---- speculative decoding with DSpark drafts ------------------------------------------------------------------

def test_greedy_equals_plain_mixed_lengths(plain, spec):
    batch = prompts([5, 150, 33, 1])
    want = [o.token_ids for o in plain.generate(batch, GREEDY, use_tqdm=False)]
    got = spec.generate(batch, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in got] == want
    stats = spec.last_stats.spec
    assert stats.steps > 0 and 0 < len(stats.reached) <= 4 and stats.drafts > 0


def test_seeded_equals_plain_and_batch(plain, spec):
    batch = prompts([12, 60, 7], seed=2)
    want = [o.token_ids for o in plain.generate(batch, SEEDED, use_tqdm=False)]
    assert [o.token_ids for o in spec.generate(batch, SEEDED, use_tqdm=False)] == want
    assert spec.generate(batch[1:2], SEEDED, use_tqdm=False)[0].token_ids == want[1]  # alone, other verify lengths


def test_confidence_sized_verification(model_dir, plain):
    llm = deepinfer.LLM(model_dir, max_num_seqs=4, prefix_cache="off", speculative_varlen=True,
                        speculative_tokens=3)
    batch = prompts([9, 40, 17], seed=4)
    assert [o.token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)] == [o.token_ids for o in plain.generate(batch, GREEDY, use_tqdm=False)]
    assert llm.last_stats.spec.request_steps > 0


def test_preemption(model_dir, plain):
    """A cache too small for every request at once: requests are preempted and prefilled again (the drafter's
    share starts over), tokens unchanged."""
    batch = prompts([150, 230, 90, 250, 40], seed=6)
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)  # 880 positions, 6 x 128 held
    want = [o.token_ids for o in plain.generate(batch, params, use_tqdm=False)]
    llm = deepinfer.LLM(model_dir, max_num_seqs=4, num_blocks=6, max_prefill_tokens=64, prefix_cache="off")
    assert [o.token_ids for o in llm.generate(batch, params, use_tqdm=False)] == want
    assert llm.last_stats.preemptions > 0


def test_structured_output(tmp_path):
    raw = dict(TINY_CONFIG, num_nextn_predict_layers=2, compress_ratios=[0, 4, 128, 4, 0, 0], dspark_block_size=3,
               dspark_noise_token_id=128799, dspark_target_layer_ids=[2, 3], dspark_markov_rank=8)  # V4 vocabulary
    path = save_model_dir(tmp_path / "tiny-v4-dspark", raw, random_tensors(ModelConfig.from_dict(raw), seed=2))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yy"]}},
              "required": ["a", "b"], "additionalProperties": False}
    items = [{"messages": [{"role": "user", "content": f"r{i}"}], "so_args": so} for i, so in
             enumerate([{"json_schema": schema}, {"regex": "(cat|dog)s? [0-9]{3}"}, None])]
    params = [SamplingParams(temperature=0.8, seed=i, max_new_tokens=30) for i in range(3)]
    want = deepinfer.LLM(path, max_num_seqs=4, speculative_tokens=0).generate(items, params, use_tqdm=False)
    spec = deepinfer.LLM(path, max_num_seqs=4)
    assert spec.speculative_tokens == 3
    got = spec.generate(items, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def replaying(fn):
    """A stand-in for a graph capture on the CPU: the replay runs fn again into the first run's output buffers."""
    out = fn()

    def replay():
        for buffer, fresh in zip(out, fn()):
            buffer.copy_(fresh)
    return out, replay


def test_block_pass_through_graphs(plain, spec):
    """The block pass through `DSparkGraphs` (static staged inputs, padded buckets; greedy drafts from the graph,
    sampled ones redrawn from its base logits): the same drafts as the eager pass (same acceptance), and the same
    tokens as plain decoding."""
    from deepinfer.runtime.drafters import DSparkDrafts
    from deepinfer.runtime.speculative import Speculator

    engine = spec.engine
    eager = engine.speculator
    batch = prompts([5, 150, 33], seed=9)
    try:
        for params in (GREEDY, SEEDED):
            want = [o.token_ids for o in plain.generate(batch, params, use_tqdm=False)]
            engine.speculator = eager
            assert [o.token_ids for o in spec.generate(batch, params, use_tqdm=False)] == want
            stats = spec.last_stats.spec
            source = DSparkDrafts(spec.model, spec.cache, replaying)
            engine.speculator = Speculator(engine.steps, 4, source)
            assert [o.token_ids for o in spec.generate(batch, params, use_tqdm=False)] == want
            assert spec.last_stats.spec == stats and set(source.graphs._passes) <= {1, 2, 4}
    finally:
        engine.speculator = eager


def test_the_cache_budget_keeps_room_for_dsparks_graph_buffers():
    """On a device, speculative decoding's captured graphs (the verify buckets' logits; DSpark's block passes' base
    logits [requests, block, V]) are kept beyond the activations: the cache's blocks come out of what is left, and
    a budget too small names them."""
    from deepinfer.errors import ConfigError
    from deepinfer.options import cache_spec, draft_graph_bytes

    cfg = ModelConfig.from_dict(TINY_DSPARK)
    reserve = draft_graph_bytes(cfg, 64, 2, torch.bfloat16)
    assert reserve == 64 * cfg.vocab_size * (cfg.dspark.block_size * 2 + 8)
    # with 4 drafts a request the verify buckets go past plain decoding's (1 .. 64): 128, 256 and 320 rows of logits
    assert draft_graph_bytes(cfg, 64, 2, torch.bfloat16, 4) == reserve + (128 + 256 + 320) * cfg.vocab_size * 4
    assert draft_graph_bytes(cfg, 64, 0, torch.bfloat16, 4) == 0  # speculative decoding off: no graphs
    from deepinfer.runtime.cache import CacheLayout, CacheSpec

    layout = CacheLayout.build(cfg, CacheSpec(0, 64, 4, 128), torch.bfloat16)
    free = (2 << 30) + 65 * layout.slot_bytes + 101 * layout.block_bytes  # room for 100 blocks and the scratch one
    plain = cache_spec(cfg, (free, free), torch.bfloat16, 64, 512, None, 1.0)
    kept = cache_spec(cfg, (free, free), torch.bfloat16, 64, 512, None, 1.0, reserve=40 * layout.block_bytes)
    assert (plain.num_blocks, kept.num_blocks) == (100, 60)
    with pytest.raises(ConfigError, match="speculative graphs"):
        cache_spec(cfg, (free, free), torch.bfloat16, 64, 512, None, 1.0, reserve=100 * layout.block_bytes)
