"""compress_pool's TileLang kernel (tilekernels/ops/compress_pool.py) on the H200 (sm_90a) against its PyTorch
reference: V4-Flash's compressors as the bf16 model pools them (bf16 kv, fp32 gates: CSA with its overlap, 8 slots
of head_dim 512, its indexer's 8 of 128, HCA's 128 of 512), V4.1's ratio 2 in fp32, fp32 kv at 128 slots (64 KiB
of staged tiles), an fp16 and a bf16-gate variant and a ragged channel count, at decode batches and prefill window
counts; empty slots and windows as the reference; batch invariance; a CUDA-graph replay (its time: benchmarks/kernels.py).

Run with `pytest -m gpu -s tests/gpu/test_compress_pool_gpu.py` on the GPU host."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import built_sm90_table
from codegen.driver import record_run
from tilekernels import dtypes
from tilekernels.ops import DECLARED, compress_pool

pytestmark = pytest.mark.gpu

B, F = "bfloat16", "float32"
SHAPES = {
    "csa": compress_pool.Variant(8, 512, B),
    "csa-indexer": compress_pool.Variant(8, 128, B),
    "hca": compress_pool.Variant(128, 512, B),
    "v41": compress_pool.Variant(2, 512, F),
    "hca-fp32": compress_pool.Variant(128, 512, F),
    "csa-fp16": compress_pool.Variant(8, 512, "float16"),
    "csa-bf16-gate": compress_pool.Variant(8, 512, B, B),
    "ragged": compress_pool.Variant(8, 100, B),
}
FLASH = ("csa", "csa-indexer", "hca")  # what the V4-Flash bf16 plan launches
WINDOWS = (1, 7, 64, 300, 2048)  # decode batches; prefill: a 8K-token chunk closes 2048 CSA windows


def items() -> list[tuple]:
    """The (op, kernel, variant) items these tests launch (recorded from `run` on meta tensors)."""
    from tilekernels.kernels import Recorder, table

    recorder = Recorder()
    for v in SHAPES.values():
        table(recorder).compress_pool(*(a.to("meta") for a in compress_pool.example(v, 2, "cpu")))
    return list(recorder.seen)


@pytest.fixture(scope="module")
def ops(cuda, cache_dir):
    """The sm90 op table, compress_pool's kernels built up front in parallel."""
    return built_sm90_table(items(), cache_dir)


def compare(got: torch.Tensor, want: torch.Tensor, equal_nan: bool = False) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    atol, rtol = DECLARED["compress_pool"].tolerance[dtypes.name(want.dtype)]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol, equal_nan=equal_nan)


def test_the_v4_flash_plan_launches_the_tested_variants():
    import json
    from pathlib import Path

    from deepinfer.compile.plan import kernel_plan
    from deepinfer.config import ModelConfig

    raw = json.loads((Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "v4-flash.json").read_text())
    planned = {v for op, _, v in kernel_plan(ModelConfig.from_dict(raw), B) if op == "compress_pool"}
    assert planned == {SHAPES[s] for s in FLASH}


@pytest.mark.parametrize("windows", WINDOWS)
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_kernel_matches_reference(shape, windows, ops, cuda, cache_dir):
    torch.manual_seed(windows)
    kv, gate = compress_pool.example(SHAPES[shape], windows, cuda)
    got = ops.compress_pool(kv, gate)
    assert bool(torch.isfinite(got).all())
    compare(got, compress_pool.reference(kv, gate))
    record_run(cache_dir, "compress_pool", "sm90", f"H200 {shape} at {windows} windows: matched the reference")


def test_empty_slots_and_windows_as_the_reference(ops, cuda):
    """Empty slots weigh 0; a channel or a whole window with every slot empty is NaN, as the reference (no caller
    builds one); zero windows launch nothing."""
    torch.manual_seed(5)
    kv, gate = compress_pool.example(SHAPES["csa"], 64, cuda)
    gate[:, :4] = float("-inf")  # CSA's first window: no predecessor
    gate[1, :, 7] = float("-inf")
    gate[2] = float("-inf")
    got, want = ops.compress_pool(kv, gate), compress_pool.reference(kv, gate)
    assert torch.equal(got.isnan(), want.isnan()) and int(want.isnan().sum()) == 513
    compare(got, want, equal_nan=True)
    assert ops.compress_pool(kv[:0], gate[:0]).shape == (0, 512)


@pytest.mark.parametrize("shape", FLASH)
def test_a_window_does_not_depend_on_the_batch(shape, ops, cuda):
    """Bitwise the same alone and among 2048 windows (a tile sums its own window's slots in a fixed order)."""
    torch.manual_seed(7)
    kv, gate = compress_pool.example(SHAPES[shape], 2048, cuda)
    many = ops.compress_pool(kv, gate)
    for w in (0, 1000, 2047):
        assert torch.equal(ops.compress_pool(kv[w : w + 1], gate[w : w + 1])[0], many[w]), f"window {w}"


def test_replays_from_a_cuda_graph(ops, cuda):
    torch.manual_seed(3)
    kv, gate = compress_pool.example(SHAPES["hca"], 16, cuda)
    ops.compress_pool(kv, gate)  # load the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.compress_pool(kv, gate)
    new_kv, new_gate = compress_pool.example(SHAPES["hca"], 16, cuda)
    kv.copy_(new_kv)
    gate.copy_(new_gate)
    graph.replay()
    torch.cuda.synchronize()
    compare(out, compress_pool.reference(kv, gate))
