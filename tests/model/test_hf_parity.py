"""Logits against HF transformers' DeepseekV4ForCausalLM (5.23.0) on tiny random configs, fp32, batch 1."""

from __future__ import annotations

import pytest
import torch

from deepinfer.config import ModelConfig
from deepinfer.model.model import DeepseekV4
from deepinfer.model.state import ForwardBatch, SeqSlice, SequenceState
from deepinfer.model.weights import ModelWeights
from tests.helpers import TINY_A, TINY_B, canonical_state, hf_greedy, hf_model
from tilekernels import reference_table

TOL = 1e-4
PROMPT_LEN = 300  # crosses the 4- and 128-token windows; > 4 x index_topk, so the indexer's top-k selects
DECODE_STEPS = 40


def build(raw):
    hf = hf_model(raw)
    cfg = ModelConfig.from_dict(raw)
    return hf, DeepseekV4(cfg, ModelWeights.from_tensors(cfg, canonical_state(hf)), reference_table())


def step(model, state, ids, start):
    n = len(ids)
    batch = ForwardBatch(torch.as_tensor(ids), torch.arange(start, start + n), (SeqSlice(state, 0, n),))
    return model.forward(batch)


@pytest.mark.parametrize("raw", [TINY_A, TINY_B], ids=["sqrtsoftplus-w128", "sigmoid-w16-hc2"])
def test_prefill_and_decode_logits_match_hf(raw):
    hf, model = build(raw)
    ids = torch.randint(0, raw["vocab_size"], (PROMPT_LEN,))
    ref_prefill, ref_steps, ref_tokens = hf_greedy(hf, ids, DECODE_STEPS)

    state = SequenceState.empty(model.cfg)
    logits = step(model, state, ids.tolist(), 0)
    assert logits.shape == ref_prefill.shape
    assert (logits - ref_prefill).abs().max().item() <= TOL
    tokens = [int(logits[-1].argmax())]
    for i, ref in enumerate(ref_steps):
        out = step(model, state, [tokens[-1]], PROMPT_LEN + i)[0]
        assert (out - ref).abs().max().item() <= TOL, f"decode step {i}"
        tokens.append(int(out.argmax()))
    assert tokens == ref_tokens
    # the run exercised what it claims: compressed entries exist and the indexer had more than top-k to pick from
    layer_types = model.cfg.layer_types
    csa = layer_types.index("compressed_sparse_attention")
    hca = layer_types.index("heavily_compressed_attention")
    assert state.layers[csa].compressor.entry_count > 4 * model.cfg.index_topk
    assert state.layers[hca].compressor.entry_count >= 2


def test_chunked_prefill_equals_one_shot():
    _, model = build(TINY_A)
    ids = torch.randint(0, TINY_A["vocab_size"], (PROMPT_LEN,)).tolist()
    one = step(model, SequenceState.empty(model.cfg), ids, 0)
    state, parts, pos = SequenceState.empty(model.cfg), [], 0
    for n in [1, 1, 3, 32, 1, 26, 127, 1, 108]:
        parts.append(step(model, state, ids[pos : pos + n], pos))
        pos += n
    assert pos == PROMPT_LEN
    assert (torch.cat(parts) - one).abs().max().item() <= 1e-5


def test_two_sequences_in_one_batch_equal_each_alone():
    _, model = build(TINY_B)
    a = torch.randint(0, TINY_B["vocab_size"], (70,)).tolist()
    b = torch.randint(0, TINY_B["vocab_size"], (33,)).tolist()
    alone_a = step(model, SequenceState.empty(model.cfg), a, 0)
    alone_b = step(model, SequenceState.empty(model.cfg), b, 0)
    sa, sb = SequenceState.empty(model.cfg), SequenceState.empty(model.cfg)
    batch = ForwardBatch(
        torch.tensor(a + b),
        torch.cat([torch.arange(len(a)), torch.arange(len(b))]),
        (SeqSlice(sa, 0, len(a)), SeqSlice(sb, len(a), len(b))),
    )
    both = model.forward(batch)
    assert (both[: len(a)] - alone_a).abs().max().item() <= 1e-5
    assert (both[len(a) :] - alone_b).abs().max().item() <= 1e-5
