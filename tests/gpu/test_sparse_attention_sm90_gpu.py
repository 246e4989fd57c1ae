"""sparse_attention's sm90 `split` and `whole` overrides (tilekernels/ops/sparse_attention_sm90.py) on the H200 against the
PyTorch reference at V4-Flash decode shapes, and the portable fallback for a variant it does not take. Run
with `pytest -m gpu` on the GPU host."""

from __future__ import annotations

import pytest
import torch

from tilekernels.ops import DECLARED, sparse_attention, sparse_attention_sm90

pytestmark = pytest.mark.gpu

OP = DECLARED["sparse_attention"]
FLASH = sparse_attention.Variant(64, 512, "bfloat16")


def check(ops, args):
    atol, rtol = OP.tolerance["bfloat16"]
    got = ops.sparse_attention(*args)
    want = OP.reference(*args)
    assert torch.isfinite(got.float()).all()
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


def test_the_flash_variant_takes_the_override():
    split, whole = OP.kernel("split"), OP.kernel("whole")
    assert split.body_for("sm90", FLASH) is sparse_attention_sm90.body
    assert split.body_for("sm100", FLASH) is sparse_attention.split_body
    assert whole.body_for("sm90", FLASH) is sparse_attention_sm90.whole_body
    assert whole.body_for("sm100", FLASH) is sparse_attention.whole_body


@pytest.mark.parametrize("queries, rows", [(300, 640), (256, 128), (133, 2048)])
def test_whole_override_matches_reference_at_prefill_shapes(queries, rows, sm90_ops, cuda):
    """Enough queries for a plan of one split (about one CTA per SM or more): the `whole` kernel merges the sink
    and normalises in the kernel; a query with an empty first step and one with no valid row (output 0)."""
    assert sparse_attention.plan(queries, 64, rows, wide=True)[0] == 1
    q, kv, idx, sinks, scale = OP.example(FLASH, queries, cuda, kv_rows=rows)
    idx[1, :64] = -1
    idx[2, :] = -1
    check(sm90_ops, (q, kv, idx, sinks * 3, scale))


@pytest.mark.parametrize("rows", [640, 2048])
@pytest.mark.parametrize("queries", [1, 8, 64])
def test_override_matches_reference_at_flash_decode(queries, rows, sm90_ops, cuda):
    """The op's example (7 empty slots per query, query 0 with a single valid row, so at one query every split
    but one is empty), plus a query whose first 64-row split is all empty and one with no valid row at all."""
    q, kv, idx, sinks, scale = OP.example(FLASH, queries, cuda, kv_rows=rows)
    if queries > 1:
        idx[1, :64] = -1  # a whole split (plan: 64-row steps) empty, the rest valid
    if queries > 2:
        idx[2, :] = -1  # nothing to attend to: the sink alone (output 0)
    check(sm90_ops, (q, kv, idx, sinks, scale))


def test_override_with_128_heads_and_large_logits(sm90_ops, cuda):
    """Two 64-head groups per query; logits scaled up so that the running max moves between steps."""
    v = sparse_attention.Variant(128, 512, "bfloat16")
    q, kv, idx, sinks, _ = OP.example(v, 8, cuda, kv_rows=640)
    check(sm90_ops, (q, kv, idx, sinks * 4, 0.2))


def test_override_with_an_odd_block_count(sm90_ops, cuda, monkeypatch):
    """Splits of 3 index blocks (96 rows: the last 64-row step reads past its split's blocks, masked)."""
    monkeypatch.setattr(sparse_attention, "plan", lambda *a, **k: (4, 3))
    q, kv, idx, sinks, scale = OP.example(FLASH, 8, cuda, kv_rows=384)
    check(sm90_ops, (q, kv, idx, sinks, scale))


def test_override_with_more_blocks_than_one_index_chunk(sm90_ops, cuda, monkeypatch):
    """One split of 90 index blocks: the override stages indices in chunks of Tune.idx_chunk (64) blocks, so
    the second chunk holds 26 blocks (13 steps); 2880 listed rows, 17 of them empty."""
    monkeypatch.setattr(sparse_attention, "plan", lambda *a, **k: (1, 90))
    q, kv, idx, sinks, scale = OP.example(FLASH, 4, cuda, kv_rows=2880)
    idx[1, 2048:2100] = -1
    check(sm90_ops, (q, kv, idx, sinks, scale))


def test_portable_fallback_for_a_tiny_variant(sm90_ops, cuda):
    """5 heads of 20 (padded by run to 16 x 32): not the override's variant; the portable body runs."""
    q = torch.randn(8, 5, 20, device=cuda).to(torch.bfloat16)
    v = sparse_attention.variant(q)
    assert not sparse_attention_sm90.fits(v)
    assert OP.kernel("split").body_for("sm90", v) is sparse_attention.split_body
    kv = torch.randn(200, 20, device=cuda).to(torch.bfloat16)
    idx = torch.randint(0, 200, (8, 70), device=cuda)
    idx[:, -5:] = -1
    check(sm90_ops, (q, kv, idx, torch.randn(5, device=cuda), 20**-0.5))
    q, idx = torch.randn(300, 5, 20, device=cuda).to(torch.bfloat16), torch.randint(0, 200, (300, 70), device=cuda)
    assert sparse_attention.plan(300, 16, 70)[0] == 1  # the portable `whole` body
    check(sm90_ops, (q, kv, idx, torch.randn(5, device=cuda), 20**-0.5))
