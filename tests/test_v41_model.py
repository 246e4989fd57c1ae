"""deepinfer's own V4.1 invariants on the fixture checkpoints (the reference cannot check these: it prefills only
from position 0 and runs a batch in lockstep): chunked prefill equals one-shot, a sequence in a batch (ragged
lengths, prefill beside decode) equals the same sequence alone, one-token steps (the batched decode path) equal
one-shot prefill, and bad calls are named errors.

Tolerances: those of test_v41_parity. Two deepinfer runs differ only where the GEMMs see other row counts (fp32
reassociation, FP32_TOL) and, rarely, where such an ulp lands an FP8/FP4 rounding one grid step apart (FLIP_TOL;
observed: a batch decode step 7e-4 from its run alone). The index top-k breaks ties by entry, so its picks do
not depend on a chunk's length (without that rule, chunking moved logits by 1.0 on config b); a near tie that an
ulp of another row count tips still can, at a few positions on some CPUs (test_v41_parity: selection flips)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.errors import ConfigError
from deepinfer.model.engram_hash import from_classes
from deepinfer.model.v41 import DeepseekV41
from deepinfer.model.v41_compress import Chunk
from tests.v41_fixture import MAX_LEN, assert_logits_close, fixture
from tilekernels import reference_table


def decode_steps(model, cache, tokens, slot, steps):
    return torch.stack([model.decode(cache, tokens[s: s + 1], [slot])[0] for s in range(steps)])


@pytest.mark.parametrize("name,sizes", [("a", (1, 6, 13)), ("a", (9, 9, 9)), ("b", (2, 5)), ("b", (20,))])
def test_chunked_prefill_equals_one_shot(name, sizes):
    """Chunks of odd and even lengths, shorter and longer than the window (a: 8, b: 6), ending mid ratio-2
    group and mid candidate block; then decode steps from both caches."""
    fx = fixture(name)
    model = fx.model()
    tokens, p = fx.ref["tokens"][0], fx.prompt_len
    one_cache, chunk_cache = model.new_cache(1, MAX_LEN), model.new_cache(1, MAX_LEN)
    one = model.prefill(one_cache, tokens[:p], 0)
    parts, at = [], 0
    for size in sizes + (p - sum(sizes),):
        parts.append(model.prefill(chunk_cache, tokens[at: at + size], 0))
        at += size
    assert_logits_close(torch.cat(parts), one)
    assert chunk_cache.num_tokens == [p]
    follow = tokens[p: p + 6]
    assert_logits_close(decode_steps(model, chunk_cache, follow, 0, 6), decode_steps(model, one_cache, follow, 0, 6))


@pytest.mark.parametrize("name", ["a", "b"])
def test_a_sequence_in_a_batch_equals_it_alone(name):
    """One forward holds sequence 0's whole prompt and sequence 1's first 11 tokens (ragged prefill); the next holds
    sequence 0's first decode step beside sequence 1's remaining prompt; then both decode in one batch, sequence
    0 one position ahead of sequence 1."""
    fx = fixture(name)
    model = fx.model()
    t, p = fx.ref["tokens"], fx.prompt_len
    alone = []
    for i in range(2):
        cache = model.new_cache(1, MAX_LEN)
        alone.append(torch.cat([model.prefill(cache, t[i, :p], 0), decode_steps(model, cache, t[i, p:], 0, 7)]))
    cache = model.new_cache(2, MAX_LEN)
    got = model.forward(cache, torch.cat([t[0, :p], t[1, :11]]), [Chunk(0, 0, p, 0), Chunk(1, p, 11, 0)],
                        torch.arange(p + 11))
    out0, out1 = [got[:p]], [got[p:]]
    got = model.forward(cache, torch.cat([t[0, p: p + 1], t[1, 11:p]]), [Chunk(0, 0, 1, p), Chunk(1, 1, p - 11, 11)],
                        torch.arange(1 + p - 11))
    out0.append(got[:1])
    out1.append(got[1:])
    for s in range(6):
        got = model.decode(cache, torch.stack([t[0, p + 1 + s], t[1, p + s]]), [0, 1])
        out0.append(got[:1])
        out1.append(got[1:])
    assert cache.num_tokens == [p + 7, p + 6]
    assert_logits_close(torch.cat(out0), alone[0])
    assert_logits_close(torch.cat(out1), alone[1][: p + 6])


@pytest.mark.parametrize("name", ["a", "b"])
def test_one_token_steps_from_the_start_equal_one_shot_prefill(name):
    """Forwards of one-token chunks only take the batched decode path (`v41_decode`): two sequences fed token by
    token from position 0 (no compressed entry yet, ratio-2 groups opening and closing, sequence 1 one position
    behind) give the rows of their one-shot prefills."""
    fx = fixture(name)
    model = fx.model()
    t, p = fx.ref["tokens"], fx.prompt_len
    want = [model.prefill(model.new_cache(1, MAX_LEN), t[i, :p], 0) for i in range(2)]
    cache = model.new_cache(2, p)  # exactly the prompt: b's 27 positions end in an open ratio-2 group
    rows = [[model.forward(cache, t[0, :1], [Chunk(0, 0, 1, 0)])[0]], []]
    for s in range(1, p):
        got = model.forward(cache, torch.stack([t[0, s], t[1, s - 1]]), [Chunk(0, 0, 1, s), Chunk(1, 1, 1, s - 1)])
        rows[0].append(got[0])
        rows[1].append(got[1])
    assert_logits_close(torch.stack(rows[0]), want[0])
    assert_logits_close(torch.stack(rows[1]), want[1][: p - 1])


def test_bad_calls_are_named():
    fx = fixture("a")
    model = fx.model()
    cache = model.new_cache(2, 16)
    ids = fx.ref["tokens"][0, :4]
    with pytest.raises(ValueError, match="starts at 3, but the slot holds 0"):
        model.forward(cache, ids, [Chunk(0, 0, 4, 3)])
    with pytest.raises(ValueError, match="name one cache slot twice"):
        model.forward(cache, ids, [Chunk(1, 0, 2, 0), Chunk(1, 2, 2, 0)])
    with pytest.raises(ValueError, match=r"\(start, length\) \[\(0, 3\)\] must cover the 4 ids in order"):
        model.forward(cache, ids, [Chunk(0, 0, 3, 0)])
    with pytest.raises(ValueError, match="holds 0 tokens; a chunk holds at least one"):
        model.forward(cache, ids[:0], [Chunk(0, 0, 0, 0)])
    with pytest.raises(ValueError, match="cache slot 2 is outside"):
        model.prefill(cache, ids, 2)
    model.prefill(cache, ids, 0)
    with pytest.raises(ValueError, match="slot 0 holds 4 tokens; 13 more exceed the cache's max_len 16"):
        model.prefill(cache, fx.ref["tokens"][0, :13], 0)
    assert cache.num_tokens == [4, 0]  # a refused call changes nothing


def test_engram_needs_the_matching_hasher():
    fx = fixture("a")
    e = fx.cfg.engram
    with pytest.raises(ConfigError, match="needs their n-gram hasher"):
        DeepseekV41(fx.cfg, fx.weights, reference_table(), None)
    classes = fx.ref["token_map"].clone()
    classes[classes == classes.max()] = 0  # one class fewer than the config declares
    bad = from_classes(e.layer_ids, e.max_ngram, e.n_heads, e.vocab_size, e.pad_id, classes)
    with pytest.raises(ConfigError, match=f"{e.compressed_vocab_size - 1} token classes .* declares "
                                          f"{e.compressed_vocab_size} classes"):
        DeepseekV41(fx.cfg, fx.weights, reference_table(), bad)


def test_an_index_source_of_another_ratio_after_the_candidate_source_is_refused():
    from deepinfer.config_v41 import V41Config

    raw = dict(fixture("b").cfg.raw)
    raw.update(compress_ratios=[0, 1, 1, 2, 2, 2, 2, 2], kv_source_layers=[1, 3], index_source_layers=[1, 3],
               candidate_source_layer=1, engram_layer_ids=[])
    with pytest.raises(ConfigError, match=r"index source layers \[3\] follow candidate source 1 but have another"):
        DeepseekV41(V41Config.from_dict(raw), fixture("b").weights, reference_table(), None)
