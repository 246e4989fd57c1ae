"""The compressors' decode pooling straight from their buffer rings (tilekernels/ops/compress_ring.py): the reference
against the gather-then-pool it replaces, and the op's input checks (its kernel on the `c` target:
tests/tilekernels/test_cpu_kernels.py)."""

import pytest
import torch

from tilekernels.errors import ShapeError
from tilekernels.ops import compress_pool, compress_ring

CSA = compress_ring.Variant(4, 8, 12, 128, "float32")

def test_no_rows_launch_nothing():
    args = compress_ring.example(CSA, 0, "cpu")
    assert compress_ring.run(lambda *a: pytest.fail("launched"), *args).shape == (0, 64)


@pytest.mark.parametrize("overlap", [True, False])
def test_reference_is_the_gathered_windows_pooled(overlap):
    """What `compress_decode` computed before this op, written out: the window's ring rows (and the prior window's
    first series with overlap, -inf gates for an empty prior) gathered, biased and pooled."""
    torch.manual_seed(int(overlap))
    rate, ring, d = 4, 12, 16
    width = 2 * d if overlap else d
    buf_kv, buf_gate = torch.randn(3, ring, width), torch.randn(3, ring, width)
    bias = torch.randn(rate, width)
    owner, pos = torch.tensor([2, 0, 1]), torch.tensor([3, 9, 17])
    now = ((pos // rate * rate).view(-1, 1) + torch.arange(rate)) % ring
    o = owner.view(-1, 1)
    kv, gate = buf_kv[o, now], buf_gate[o, now] + bias
    rows = now
    if overlap:
        before = (now - rate) % ring
        empty = (pos // rate == 0).view(-1, 1, 1)
        prior_gate = (buf_gate[o, before][..., :d] + bias[:, :d]).masked_fill(empty, float("-inf"))
        kv = torch.cat([buf_kv[o, before][..., :d], kv[..., d:]], dim=1)
        gate = torch.cat([prior_gate, gate[..., d:]], dim=1)
        rows = torch.cat([torch.where(empty.view(-1, 1), -1, before), now], dim=1)
    want = compress_pool.reference(kv, gate)
    assert torch.equal(compress_ring.reference(buf_kv, buf_gate, bias, owner, rows), want)


@pytest.mark.parametrize("change, message", [
    (dict(bias=torch.zeros(4, 64)), "bias must be [rate, 128]"),
    (dict(rows=torch.zeros(5, 6, dtype=torch.long)), "rows must be [B, 4] or [B, 8]"),
    (dict(owner=torch.zeros(4, dtype=torch.long)), "owner must be [5]"),
    (dict(buf_gate=torch.zeros(3, 12, 64)), "buf_gate must be buf_kv's shape"),
])
def test_names_the_inputs_it_cannot_take(change, message):
    names = ("buf_kv", "buf_gate", "bias", "owner", "rows")
    args = dict(zip(names, compress_ring.example(CSA, 5, "cpu")))
    args.update(change)
    with pytest.raises(ShapeError, match=message.replace("[", r"\[")):
        compress_ring.run(lambda *a: None, *(args[n] for n in names))
