"""Rollback of a tentative (verify) step: after `commit(seq, end)` the paged cache holds what a step that never saw
the rejected tokens leaves: the same window rows, compressor buffers, CSA overlap, compressed entries and
indexer keys for every position a later step can read, and the same logits on the next step. Checked on a
config with every layer type, a 16-token window and a 16-token HCA rate, at positions where the verified rows
wrap the window and close CSA and HCA windows, for every number of kept rows."""

from __future__ import annotations

import pytest
import torch

from deepinfer.config import ModelConfig
from deepinfer.model.rollback import commit
from deepinfer.model.weights import ModelWeights
from deepinfer.tiny import random_tensors
from tests.helpers import ODD_A, Runner
from tilekernels import reference_table

CFG = ModelConfig.from_dict(ODD_A)
WEIGHTS = ModelWeights.from_tensors(CFG, random_tensors(CFG, seed=5))


def _runner() -> Runner:
    return Runner(CFG, WEIGHTS, reference_table(), tokens=256, seqs=2)


def _readable(run: Runner, seq) -> dict[str, torch.Tensor]:
    """Every piece of the sequence's state a later step reads, by name."""
    end, out = seq.num_tokens, {}
    blocks = torch.tensor(seq.blocks)
    for i, layer in enumerate(run.cache.layers):
        lay = layer.layout
        window = torch.arange(max(0, end - lay.window), end)
        out[f"{i}.ring"] = layer.pool[lay.window_rows(seq.slot, window)]
        for name, comp in (("comp", layer.compressor), ("index", layer.indexer)):
            if comp is None:
                continue
            fill = end % comp.rate
            out[f"{i}.{name}.buf_kv"] = comp.buf_kv[seq.slot, :fill]
            out[f"{i}.{name}.buf_gate"] = comp.buf_gate[seq.slot, :fill]
            closed = end // comp.rate
            if comp.overlap and closed:
                out[f"{i}.{name}.ov_kv"] = comp.ov_kv[seq.slot]
                out[f"{i}.{name}.ov_gate"] = comp.ov_gate[seq.slot]
            out[f"{i}.{name}.entries"] = comp.store[comp.layout.entry_rows(blocks, torch.arange(closed))]
    return out


@pytest.mark.parametrize("prompt", [13, 45, 62])
def test_commit_leaves_the_cache_of_a_step_without_the_rejected_tokens(prompt):
    g = torch.Generator().manual_seed(prompt)
    ids = torch.randint(0, CFG.vocab_size, (prompt + 6,), generator=g)
    verify = ids[prompt:]  # the last token and 5 drafts
    for kept in range(1, verify.numel() + 1):
        spec, plain = _runner(), _runner()
        a, b = spec.new_seq(), plain.new_seq()
        spec.prefill(a, ids[:prompt])
        plain.prefill(b, ids[:prompt])
        assert spec.cache.grow(a, prompt + verify.numel())
        positions = torch.arange(prompt, prompt + verify.numel())
        spec.model.prefill(spec.cache, verify, positions, [(a, 0, verify.numel())], tentative=True)
        commit(a, prompt + kept)
        plain.prefill(b, verify[:kept])
        assert a.num_tokens == b.num_tokens == prompt + kept and a.undo is None
        got, want = _readable(spec, a), _readable(plain, b)
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-5, msg=f"{name}, {kept} kept")
        nxt = torch.tensor([7])
        torch.testing.assert_close(spec.decode([a], nxt), plain.decode([b], nxt), atol=1e-5, rtol=1e-5)


def test_rejected_rows_are_really_undone():
    """Without the commit the verified rows stay in the ring (so the comparison above can fail)."""
    spec, plain = _runner(), _runner()
    a, b = spec.new_seq(), plain.new_seq()
    ids = torch.arange(3, 3 + 20)
    spec.prefill(a, ids[:14])
    plain.prefill(b, ids[:14])
    assert spec.cache.grow(a, 20)
    spec.model.prefill(spec.cache, ids[14:20], torch.arange(14, 20), [(a, 0, 6)], tentative=True)
    a.undo, a.num_tokens = None, 15  # forgotten instead of committed: the rows of 15..19 stay written
    plain.prefill(b, ids[14:15])
    got, want = _readable(spec, a), _readable(plain, b)
    assert not torch.equal(got["0.ring"], want["0.ring"])
