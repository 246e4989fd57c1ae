"""compress_ring's TileLang kernel (tilekernels/ops/compress_ring.py) on the H200 (sm_90a) against its PyTorch
reference at the V4-Flash decode shapes the bf16 plan launches (CSA's 8 slots of two 512-channel series, its indexer's
of two 128-channel series; bf16 rings as the cache keeps them) and at HCA's 128 slots of 512 (which the model pools
with compress_pool: compress_ring.GATHER_SLOTS), at decode batches; a row's result does not depend on its batch.

Run with `pytest -m gpu -s tests/gpu/test_compress_ring_gpu.py` on the GPU host."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from codegen.driver import record_run
from tests.gpu.conftest import built_sm90_table
from tilekernels import dtypes
from tilekernels.ops import DECLARED, compress_ring

pytestmark = pytest.mark.gpu

B = "bfloat16"
SHAPES = {  # rate, slots, ring rows, width
    "csa": compress_ring.Variant(4, 8, 8, 1024, B, B),
    "csa-indexer": compress_ring.Variant(4, 8, 8, 256, B, B),
    "hca": compress_ring.Variant(128, 128, 128, 512, B, B),
    "ragged-fp32-gate": compress_ring.Variant(4, 8, 12, 200, B),
}
FLASH = ("csa", "csa-indexer")  # HCA's 128 slots pool through compress_pool (compress_ring.GATHER_SLOTS)


def items() -> list[tuple]:
    from tilekernels.kernels import Recorder, table

    recorder = Recorder()
    for v in SHAPES.values():
        table(recorder).compress_ring(*(a.to("meta") for a in compress_ring.example(v, 2, "cpu")))
    return list(recorder.seen)


@pytest.fixture(scope="module")
def ops(cuda, cache_dir):
    return built_sm90_table(items(), cache_dir)


def test_the_v4_flash_plan_launches_the_tested_variants():
    from deepinfer.compile.plan import kernel_plan
    from deepinfer.config import ModelConfig

    raw = json.loads((Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "v4-flash.json").read_text())
    planned = {v for op, _, v in kernel_plan(ModelConfig.from_dict(raw), B) if op == "compress_ring"}
    assert planned == {SHAPES[s] for s in FLASH}


@pytest.mark.parametrize("rows", (1, 8, 64, 256))
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_kernel_matches_reference(shape, rows, ops, cuda, cache_dir):
    args = compress_ring.example(SHAPES[shape], rows, cuda)
    got, want = ops.compress_ring(*args), compress_ring.reference(*args)
    assert got.shape == want.shape and got.dtype == want.dtype and bool(torch.isfinite(got).all())
    atol, rtol = DECLARED["compress_ring"].tolerance[dtypes.name(want.dtype)]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)
    record_run(cache_dir, "compress_ring", "sm90", f"H200 {shape} at {rows} rows: matched the reference")


@pytest.mark.parametrize("shape", [*FLASH, "hca"])
def test_a_row_does_not_depend_on_the_batch(shape, ops, cuda):
    buf_kv, buf_gate, bias, owner, rows = compress_ring.example(SHAPES[shape], 256, cuda)
    many = ops.compress_ring(buf_kv, buf_gate, bias, owner, rows)
    for r in (0, 100, 255):
        one = ops.compress_ring(buf_kv, buf_gate, bias, owner[r : r + 1], rows[r : r + 1])
        assert torch.equal(one[0], many[r]), f"row {r}"
