"""Rollback of a tentative (verify) step: after `commit(seq, end)` the paged cache holds what a step that never saw
the rejected tokens leaves: the same window rows, compressor buffers (the open window's rows and, for CSA, the
last closed window's), compressed entries and indexer keys for every position a later step can read, and the
same logits on the next step. Checked on a config with every layer type, a 16-token window and a 16-token HCA
rate, at positions where the verified rows wrap the window and close CSA and HCA windows, for every number of
kept rows, with the verify rows run as a prefill chunk and as decode rows (one per position, as the decode graphs
run them)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.config import ModelConfig
from deepinfer.model.decode import DecodeInputs
from deepinfer.model.rollback import commit
from deepinfer.model.weights import ModelWeights
from deepinfer.tiny import random_tensors
from tests.helpers import ODD_A, Runner
from tilekernels import reference_table

CFG = ModelConfig.from_dict(ODD_A)
WEIGHTS = ModelWeights.from_tensors(CFG, random_tensors(CFG, seed=5))


def _runner() -> Runner:
    return Runner(CFG, WEIGHTS, reference_table(), tokens=256, seqs=2, lookahead=5)


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
            open_rows = comp.rows(torch.arange(end - end % comp.rate, end))
            out[f"{i}.{name}.buf_kv"] = comp.buf_kv[seq.slot, open_rows]
            out[f"{i}.{name}.buf_gate"] = comp.buf_gate[seq.slot, open_rows]
            closed = end // comp.rate
            if comp.overlap and closed:  # the last closed window: its first series pools into the next entry
                last = torch.arange((closed - 1) * comp.rate, closed * comp.rate)
                out[f"{i}.{name}.prior_kv"] = comp.buf_kv[seq.slot, comp.rows(last)]
                out[f"{i}.{name}.prior_gate"] = comp.buf_gate[seq.slot, comp.rows(last)]
            out[f"{i}.{name}.entries"] = comp.store[comp.layout.entry_rows(blocks, torch.arange(closed))]
    return out


def _verify_rows(run: Runner, seq, ids: torch.Tensor) -> None:
    """The rows as a decode step runs them: one row per position, all of one sequence (static shapes)."""
    n = ids.numel()
    positions = torch.arange(seq.num_tokens, seq.num_tokens + n)
    table = run.cache.block_table([seq]).expand(n, -1)
    run.model.decode(run.cache, DecodeInputs(ids, positions, torch.full((n,), seq.slot), table))
    seq.num_tokens += n


@pytest.mark.parametrize("rows", ["prefill", "decode"])
@pytest.mark.parametrize("prompt", [13, 45, 62])
def test_commit_leaves_the_cache_of_a_step_without_the_rejected_tokens(prompt, rows):
    g = torch.Generator().manual_seed(prompt)
    ids = torch.randint(0, CFG.vocab_size, (prompt + 6,), generator=g)
    verify = ids[prompt:]  # the last token and 5 drafts
    for kept in range(1, verify.numel() + 1):
        spec, plain = _runner(), _runner()
        a, b = spec.new_seq(), plain.new_seq()
        spec.prefill(a, ids[:prompt])
        plain.prefill(b, ids[:prompt])
        assert spec.cache.grow(a, prompt + verify.numel())
        if rows == "prefill":
            positions = torch.arange(prompt, prompt + verify.numel())
            spec.model.prefill(spec.cache, verify, positions, [(a, 0, verify.numel())], tentative=True)
        else:
            _verify_rows(spec, a, verify)
        commit(a, prompt + kept)
        plain.prefill(b, verify[:kept])
        assert a.num_tokens == b.num_tokens == prompt + kept
        got, want = _readable(spec, a), _readable(plain, b)
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-5, msg=f"{name}, {kept} kept")
        nxt = torch.tensor([7])
        torch.testing.assert_close(spec.decode([a], nxt), plain.decode([b], nxt), atol=1e-5, rtol=1e-5)


def test_without_the_lookahead_rejected_rows_would_overwrite_kept_state():
    """The ring room is what makes rollback free: with none, a tentative chunk is refused, and the same rows
    written as a plain chunk do overwrite the window the kept positions need (so the comparison above can fail)."""
    tight, plain = Runner(CFG, WEIGHTS, reference_table(), tokens=256, seqs=2), _runner()
    a, b = tight.new_seq(), plain.new_seq()
    ids = torch.arange(3, 3 + 20)
    tight.prefill(a, ids[:14])
    plain.prefill(b, ids[:14])
    assert tight.cache.grow(a, 20)
    with pytest.raises(AssertionError, match="lookahead of 0"):
        tight.model.prefill(tight.cache, ids[14:20], torch.arange(14, 20), [(a, 0, 6)], tentative=True)
    tight.model.prefill(tight.cache, ids[14:20], torch.arange(14, 20), [(a, 0, 6)])
    commit(a, 15)
    plain.prefill(b, ids[14:15])
    got, want = _readable(tight, a), _readable(plain, b)
    assert not torch.equal(got["0.ring"], want["0.ring"])
