"""The runtime: paged cache accounting, preemption with recompute, and decode graphs (static buffers,
bucket padding) against plain eager decode."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import deepinfer
from deepinfer.errors import RequestError
from deepinfer.runtime.graph import DecodeGraphs
from deepinfer.runtime.sampling import SamplingParams
from tests.helpers import TINY_A, hf_model

GREEDY = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine") / "tiny"
    hf_model(TINY_A).save_pretrained(path)
    return path


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"token_ids": torch.randint(2, TINY_A["vocab_size"], (n,), generator=g).tolist()} for n in lengths]


def assert_cache_empty(llm):
    assert llm.cache.used_blocks == 0 and llm.cache.free_slots == llm.cache.spec.max_seqs


def test_preemption_under_a_tiny_page_budget_loses_nothing(saved):
    reqs = prompts([150, 230, 90, 250, 40])
    roomy = deepinfer.LLM(saved, max_num_seqs=4)
    alone = [roomy.generate(r, GREEDY)[0].token_ids for r in reqs]
    assert_cache_empty(roomy)
    tight = deepinfer.LLM(saved, max_num_seqs=4, num_blocks=6, max_prefill_tokens=64)  # 768 positions in all
    outs = tight.generate(reqs, GREEDY)
    assert tight.last_stats.preemptions > 0 and tight.last_stats.ahead_steps > 0  # asynchronous scheduling (default)
    assert [o.token_ids for o in outs] == alone
    # the same without asynchronous scheduling: same outputs, preempted as well
    tight.engine.config = dataclasses.replace(tight.engine.config, async_scheduling=False)
    sync = tight.generate(reqs, GREEDY)
    assert [o.token_ids for o in sync] == alone and tight.last_stats.preemptions > 0
    assert tight.last_stats.ahead_steps == 0
    assert all(o.finish_reason == "length" and o.num_generated_tokens == 40 for o in outs)
    assert sum(o.preemptions for o in outs) == tight.last_stats.preemptions
    # no admit-then-evict churn: a request is admitted only when its prefill fits, so little is recomputed
    assert tight.last_stats.prompt_tokens < 2 * sum(len(r["token_ids"]) for r in reqs)
    assert_cache_empty(tight)


def test_a_request_that_can_never_fit_is_refused(saved):
    llm = deepinfer.LLM(saved, num_blocks=2, max_num_seqs=2)
    with pytest.raises(RequestError, match="needs 300 positions, more than this cache can ever hold \\(256"):
        llm.generate(prompts([260]), SamplingParams(temperature=0, max_new_tokens=40))
    assert_cache_empty(llm)


class EmulatedCapture:
    """A CPU stand-in for CUDA graph capture: the step is recorded once and replayed into the same output
    buffer, so inputs reach it only through the static input tensors, as in a real graph."""

    def __init__(self):
        self.captures = 0

    def __call__(self, fn):
        self.captures += 1
        out = fn()
        return out, lambda: out.copy_(fn())


def test_decode_graphs_equal_eager_decode(saved):
    reqs = prompts([12, 140, 33], seed=3)  # 3 rows run in the 4-row bucket: one padding row
    params = [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True) for n in (30, 9, 21)]
    eager = deepinfer.LLM(saved, max_num_seqs=8)
    graphed = deepinfer.LLM(saved, max_num_seqs=8)
    capture = EmulatedCapture()
    graphed.engine.graphs = DecodeGraphs(graphed.model, graphed.cache, 8, capture)
    assert eager.engine.sampler is None and graphed.engine.sampler.capture is capture  # sampling follows the swap
    a, b = eager.generate(reqs, params), graphed.generate(reqs, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert capture.captures >= 2  # batch 3 (bucket 4), then 2 and 1 as requests finish
    assert_cache_empty(graphed)


def test_graph_padding_rows_do_not_touch_live_state(saved):
    llm = deepinfer.LLM(saved, max_num_seqs=8)
    graphs = DecodeGraphs(llm.model, llm.cache, 8, None)
    seq = llm.cache.admit()
    llm.cache.grow(seq, 20)
    ids = torch.arange(2, 21)
    llm.model.prefill(llm.cache, ids, torch.arange(19), [(seq, 0, 19)])
    llm.cache.grow(seq, 20)
    before = [t.clone() for t in llm.cache.tensors()]
    one = graphs.run([5], [19], [seq])  # runs in the 1-row bucket
    rings_one = [layer.ring[seq.slot].clone() for layer in llm.cache.layers]
    for t, old in zip(llm.cache.tensors(), before):  # restore, then rerun padded to 8 rows
        t.copy_(old)
    padded = graphs._static(8)
    inp = padded.inputs
    graphs.stage(padded, [5], [19], [seq])  # ids, positions, slots and the host-made rows
    inp.blocks.copy_(llm.cache.block_table([seq], rows=8))
    eight = llm.model.decode(llm.cache, inp)[:1]
    assert (one - eight).abs().max().item() <= 1e-5
    # the live sequence's window state is the same whether its step ran alone or padded
    for layer, ring in zip(llm.cache.layers, rings_one):
        assert (layer.ring[seq.slot] - ring).abs().max().item() <= 1e-6
