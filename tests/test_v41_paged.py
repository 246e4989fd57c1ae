"""V4.1's paged cache (`V41Cache` with a block table, `V41SlotCache` handing out blocks) on the CPU reference
path: sequences whose blocks interleave in the pool, in chunks and decode steps, give the logits of a cache
where each owns its blocks in order, bit for bit; a released sequence's slot and blocks serve the next one
clean; the FP4 entries stored packed give the logits of the unpacked (rounded) ones; the cache's bytes are its
blocks' and slots' and what FP4 storage costs."""

from __future__ import annotations

import pytest
import torch

from deepinfer.errors import ConfigError
from deepinfer.model.v41_cache import INDEX_FP4, LATENT_FP4, V41Cache, unit_bytes
from deepinfer.model.v41_compress import Chunk
from deepinfer.runtime.cache_layout import CacheSpec
from deepinfer.runtime.v41_steps import V41SlotCache, V41Steps
from tests.v41_fixture import MAX_LEN, fixture

BLOCK = 8  # tokens per block: ratio-2 sources hold 4 entries a block, ratio-1 sources 8


def dense_schedule(model, prompts: list[list[int]], chunk: int, tokens: list[list[int]]) -> list[list[torch.Tensor]]:
    """The schedule below on a dense cache (each slot its own blocks, in order) through `DeepseekV41.forward`."""
    cache = model.new_cache(2, MAX_LEN)
    got = [[], []]
    for at in range(0, max(map(len, prompts)), chunk):
        parts = [(i, p[at: at + chunk]) for i, p in enumerate(prompts) if p[at: at + chunk]]
        starts = [sum(len(q) for _, q in parts[:k]) for k in range(len(parts))]
        chunks = [Chunk(i, st, len(q), at) for (i, q), st in zip(parts, starts)]
        logits = model.forward(cache, torch.tensor([t for _, q in parts for t in q]), chunks)
        for (i, _), row in zip(parts, logits):
            got[i].append(row)
    for k in range(len(tokens[0])):
        logits = model.forward(cache, torch.tensor([tokens[0][k], tokens[1][k]]),
                               [Chunk(i, i, 1, cache.num_tokens[i]) for i in range(2)])
        got[0].append(logits[0])
        got[1].append(logits[1])
    return got


@pytest.mark.parametrize("name", ["a", "b"])
def test_interleaved_blocks_equal_a_dense_cache_and_freed_ones_serve_the_next_sequence(name):
    model = fixture(name).model()
    cache = V41SlotCache(model.cfg, CacheSpec(num_blocks=10, max_seqs=2, max_blocks_per_seq=MAX_LEN // BLOCK,
                                              block_tokens=BLOCK), model.dtype, "cpu")
    steps = V41Steps(model, cache)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, model.cfg.vocab_size, (n,), generator=g).tolist() for n in (19, 13, 22)]
    chunk, tokens = 5, [[7, 9, 11, 13, 15], [8, 10, 12, 14, 16]]
    seqs = [cache.admit(), cache.admit()]
    got = [[], []]
    for at in range(0, 20, chunk):  # both prompts in chunks of 5, one forward each step: blocks interleave
        rows, batch, logit_rows = [], [], []
        for i, seq in enumerate(seqs):
            part = prompts[i][at: at + chunk]
            if not part:
                continue
            assert cache.grow(seq, seq.num_tokens + len(part))
            batch.append((seq, len(rows), len(part)))
            rows += part
            logit_rows.append(len(rows) - 1)
        logits = steps.prefill(rows, [p for seq, _, n in batch for p in range(seq.num_tokens, seq.num_tokens + n)],
                               batch, logit_rows)
        for (seq, _, _), row in zip(batch, logits):
            got[seqs.index(seq)].append(row)
    held = [list(s.blocks) for s in seqs]
    assert held[0] != list(range(held[0][0], held[0][0] + len(held[0])))  # interleaved, not in order
    for k in range(5):  # decode steps: the two sequences together, crossing block boundaries
        for seq in seqs:
            assert cache.grow(seq, seq.num_tokens + 1)
        logits = steps.decode([tokens[0][k], tokens[1][k]], [s.num_tokens for s in seqs], seqs)
        got[0].append(logits[0])
        got[1].append(logits[1])
    want = dense_schedule(model, prompts[:2], chunk, tokens)
    for i in range(2):
        assert all(torch.equal(a, b) for a, b in zip(got[i], want[i], strict=True)), i
    # the first sequence leaves; the third takes its slot and (some of) its blocks: its logits are its own
    cache.release(seqs[0])
    assert (cache.paged.tables[0] == cache.scratch_block).all()
    third = cache.admit()
    assert cache.grow(third, len(prompts[2]))
    assert set(third.blocks) & set(held[0])
    logits = steps.prefill(prompts[2], list(range(len(prompts[2]))), [(third, 0, len(prompts[2]))], [21])
    ids = torch.tensor(prompts[2])
    assert torch.equal(logits[0], model.forward(model.new_cache(1, MAX_LEN), ids, [Chunk(0, 0, len(ids), 0)])[0])


def test_packed_entries_give_the_unpacked_rounded_ones_logits():
    """A prefill, then decode steps across a block boundary (8-token blocks) and through open ratio-2 groups."""
    model = fixture("a").model()
    ids = torch.arange(3, 30)
    logits = []
    for packed in (True, False):
        cache = V41Cache.empty(model.cfg, 1, MAX_LEN, model.dtype, "cpu", BLOCK, packed=packed)
        rows = [model.prefill(cache, ids, 0)]
        rows += [model.decode(cache, torch.tensor([t]), [0]) for t in range(40, 47)]  # positions 27-33
        logits.append(torch.cat(rows))
    assert torch.equal(*logits)


def test_bytes_are_blocks_and_slots_and_fp4_storage():
    cfg = fixture("a").model().cfg
    dtype = torch.bfloat16
    block, slot = unit_bytes(cfg, MAX_LEN, BLOCK, dtype)
    c = V41Cache.empty(cfg, 3, MAX_LEN, dtype, "meta", BLOCK, num_blocks=5)
    assert c.num_bytes() == 6 * block + 3 * slot  # + the scratch block
    want = 0
    for src in cfg.kv_source_layers:
        entries = BLOCK // cfg.compress_ratios[src]
        want += entries * cfg.head_dim * (1 / 2 + 1 / LATENT_FP4[0])
        if src in cfg.index_source_layers:
            want += entries * cfg.index_head_dim * (1 / 2 + 1 / INDEX_FP4[0])
    assert block == want
    with pytest.raises(ConfigError, match="block_tokens=3 must be a positive multiple of every compression ratio"):
        V41Cache.empty(cfg, 1, MAX_LEN, dtype, "meta", 3)


def test_preemption_under_a_tiny_block_budget_loses_nothing(tmp_path):
    """The engine over a cache of 8-token blocks: four requests of up to 49 positions need 20 blocks at once;
    with 7 the scheduler preempts (and recomputes) running requests, whose greedy tokens stay those of a roomy
    cache; every block comes back."""
    import deepinfer
    from deepinfer.runtime.engine import Engine
    from deepinfer.runtime.sampling import SamplingParams
    from deepinfer.runtime.scheduler import SchedulerConfig
    from tests.v41_dirs import model_dir

    llm = deepinfer.LLM(model_dir(tmp_path), max_num_seqs=4)
    g = torch.Generator().manual_seed(5)
    prompts = [{"token_ids": torch.randint(3, 256, (n,), generator=g).tolist()} for n in (30, 17, 25, 9)]
    params = SamplingParams(temperature=0, max_new_tokens=18, ignore_eos=True)
    results = []
    for blocks in (32, 7):
        spec = CacheSpec(num_blocks=blocks, max_seqs=4, max_blocks_per_seq=MAX_LEN // BLOCK, block_tokens=BLOCK)
        llm.cache = V41SlotCache(llm.model.cfg, spec, llm.model.dtype, "cpu")
        llm.engine = Engine(V41Steps(llm.model, llm.cache), llm.cache, SchedulerConfig(4, 16), llm.grammars)
        results.append(([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)], llm.last_stats))
        assert llm.cache.used_blocks == 0 and llm.cache.free_slots == 4
    (roomy, roomy_stats), (tight, tight_stats) = results
    assert roomy_stats.preemptions == 0 and tight_stats.preemptions > 0
    assert tight == roomy
