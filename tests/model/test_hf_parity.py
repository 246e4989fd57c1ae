"""Logits against HF transformers' DeepseekV4ForCausalLM (5.23.0) on tiny random configs, fp32, batch 1."""

from __future__ import annotations

import pytest
import torch

from deepinfer.config import ModelConfig
from deepinfer.model.weights import ModelWeights
from tests.helpers import TINY_A, TINY_B, Runner, canonical_state, hf_greedy, hf_model
from tilekernels import reference_table

TOL = 1e-4
PROMPT_LEN = 300  # crosses the 4- and 128-token windows; > 4 x index_topk, so the indexer's top-k selects
DECODE_STEPS = 40


def build(raw):
    hf = hf_model(raw)
    cfg = ModelConfig.from_dict(raw)
    return hf, Runner(cfg, ModelWeights.from_tensors(cfg, canonical_state(hf)), reference_table())


@pytest.mark.parametrize("raw", [TINY_A, TINY_B], ids=["sqrtsoftplus-w128", "sigmoid-w16-hc2"])
def test_prefill_and_decode_logits_match_hf(raw):
    hf, run = build(raw)
    ids = torch.randint(0, raw["vocab_size"], (PROMPT_LEN,))
    ref_prefill, ref_steps, ref_tokens = hf_greedy(hf, ids, DECODE_STEPS)

    seq = run.new_seq()
    logits = run.prefill(seq, ids)
    assert logits.shape == ref_prefill.shape
    assert (logits - ref_prefill).abs().max().item() <= TOL
    tokens = [int(logits[-1].argmax())]
    for i, ref in enumerate(ref_steps):
        out = run.decode([seq], [tokens[-1]])[0]
        assert (out - ref).abs().max().item() <= TOL, f"decode step {i}"
        tokens.append(int(out.argmax()))
    assert tokens == ref_tokens
    # the run exercised what it claims: the indexer had more than top-k entries to pick from, HCA windows closed
    cfg = run.model.cfg
    assert seq.num_tokens // cfg.compress_rate_csa > 4 * cfg.index_topk
    assert seq.num_tokens // cfg.compress_rate_hca >= 2


def test_chunked_prefill_equals_one_shot():
    _, run = build(TINY_A)
    ids = torch.randint(0, TINY_A["vocab_size"], (PROMPT_LEN,)).tolist()
    one = run.prefill(run.new_seq(), ids)
    seq, parts, pos = run.new_seq(), [], 0
    for n in [1, 1, 3, 32, 1, 26, 127, 1, 108]:
        parts.append(run.prefill(seq, ids[pos : pos + n]))
        pos += n
    assert pos == PROMPT_LEN
    assert (torch.cat(parts) - one).abs().max().item() <= 1e-5


def test_batched_decode_and_prefill_equal_each_sequence_alone():
    _, run = build(TINY_B)
    prompts = [torch.randint(0, TINY_B["vocab_size"], (n,)).tolist() for n in (70, 33, 5)]
    feeds = [torch.randint(0, TINY_B["vocab_size"], (6,)).tolist() for _ in prompts]
    alone = []
    for p, feed in zip(prompts, feeds):
        seq = run.new_seq()
        logits = [run.prefill(seq, p)[-1]]
        for t in range(6):
            logits.append(run.decode([seq], [feed[t]])[0])
        alone.append(torch.stack(logits))
        run.cache.release(seq)
    seqs = [run.new_seq() for _ in prompts]
    flat = torch.tensor(sum(prompts, []))
    pos = torch.cat([torch.arange(len(p)) for p in prompts])
    layout, start = [], 0
    for s, p in zip(seqs, prompts):
        run.cache.grow(s, len(p))
        layout.append((s, start, len(p)))
        start += len(p)
    ends = torch.tensor([start - 1 for start in torch.cumsum(torch.tensor([len(p) for p in prompts]), 0).tolist()])
    together = [run.model.prefill(run.cache, flat, pos, layout, ends)]
    for t in range(6):
        together.append(run.decode(seqs, [feed[t] for feed in feeds]))
    together = torch.stack(together, dim=1)  # [seqs, steps, V]
    for i in range(len(prompts)):
        assert (together[i] - alone[i]).abs().max().item() <= 1e-5
