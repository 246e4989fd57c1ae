"""The sm90 override of the mHC partials kernel (tilekernels/ops/hc_mixes_sm90.py: the mixing matvec as a bf16
tensor-core GEMM with Fn split into hi + lo bf16 halves) on the H200: `hc_pre` and `hc_mixes` through the sm90
kernel table against their PyTorch references (computed in fp32 on the CPU: no TF32) from 1 to 4096 tokens at
V4-Flash widths (N 4, H 4096: K 16384 in 16 parts), V4.1's (H 5120: K 20480 in 20 parts) and a ragged one (H 5000:
the last part ends inside a K step, zero-filled); the partials alone against float64 products (the lo half is
needed: bf16 Fn alone is off by 1e-2) with rows past M left unwritten; that the override is the body built; batch
invariance; a CUDA-graph replay. Run with `pytest -m gpu tests/gpu/test_hc_sm90_gpu.py` on the GPU host."""

import dataclasses

import pytest
import torch

from tests.gpu.conftest import built_sm90_table
from tilekernels.ops import DECLARED, hc_mixes, hc_mixes_sm90, hc_pre

pytestmark = pytest.mark.gpu

ROWS = (1, 7, 64, 65, 300, 4096)
SHAPES = {"v4-flash": (4, 4096), "v4.1": (4, 5120), "ragged": (4, 5000)}  # hc, hidden
OPS = ("hc_pre", "hc_mixes")
ITERS = 20
FP32_TOL = DECLARED["hc_mixes"].tolerance["bfloat16"]  # the mixes are fp32 whatever the streams' dtype
BF16_TOL = DECLARED["hc_pre"].tolerance["bfloat16"]  # hc_pre's collapsed streams, in bf16


def layer(shape: str) -> hc_pre.Variant:
    """The layer's variant, as both ops' examples take it (hc_pre's adds `norm`: off, the collapse as the sublayer
    reads it before its own norm)."""
    hc, hidden = SHAPES[shape]
    return hc_pre.Variant(hc, hidden, ITERS, "bfloat16")


def planned() -> list[tuple]:
    """Every kernel the two ops launch at the tested sizes (recorded from `run` on meta tensors)."""
    from tilekernels.kernels import Recorder

    rec = Recorder()
    for name in OPS:
        for shape in SHAPES:
            for rows in ROWS:
                DECLARED[name].run(rec.for_op(name), *DECLARED[name].example(layer(shape), rows, "meta"))
    return list(rec.seen)


@pytest.fixture(scope="module")
def ops(cuda, cache_dir):
    """The sm90 op table, its kernels built up front in parallel."""
    return built_sm90_table(planned(), cache_dir)


@pytest.fixture(scope="module")
def launcher(ops, cache_dir):
    import backends
    from codegen import Compiler
    from tilekernels.kernels import Launcher

    return Launcher(Compiler(backends.get("sm90"), cache_dir))


def on_cpu(args: tuple) -> tuple:
    return tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)


def compare(name: str, got: tuple, want: tuple) -> None:
    """fp32 outputs at hc_mixes' tolerance; hc_pre's collapsed streams (its last output, bf16) at its own."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype and bool(torch.isfinite(g).all())
        atol, rtol = BF16_TOL if (name == "hc_pre" and i == len(got) - 1) else FP32_TOL
        torch.testing.assert_close(g.cpu().float(), w.float(), atol=atol, rtol=rtol)


def test_the_override_takes_every_bf16_row_count():
    """One variant per layer at every row count, its partials kernel the override on sm90 only (fp32 streams: the
    portable body); the finishing kernel stays portable."""
    for name in OPS:
        split, finish = DECLARED[name].kernel(name + "_split"), DECLARED[name].kernel(name + "_finish")
        for hc, hidden in SHAPES.values():
            mod = hc_pre if name == "hc_pre" else hc_mixes
            variants = {mod.variant(torch.empty(rows, hc, hidden, dtype=torch.bfloat16, device="meta"), ITERS)
                        for rows in ROWS}
            assert len(variants) == 1 and next(iter(variants)).split > 1
            v = variants.pop()
            assert split.body_for("sm90", v) is hc_mixes_sm90.body
            assert finish.body_for("sm90", v) is finish.body
            for target in ("sm100", "ascend", "c"):
                assert split.body_for(target, v) is split.body
            f32 = mod.variant(torch.empty(1, hc, hidden, dtype=torch.float32, device="meta"), ITERS)
            assert split.body_for("sm90", f32) is split.body


def test_the_built_partials_kernel_is_the_gemm(ops, cache_dir):
    """What the sm90 cache holds for every planned partials kernel is the override's (TMA-fed bf16 wgmma)."""
    import backends
    from codegen import Compiler
    from tilekernels.kernels import request

    compiler = Compiler(backends.get("sm90"), cache_dir)
    items = [item for item in planned() if item[1].endswith("_split")]
    assert {op for op, _, _ in items} == set(OPS)
    for item in items:
        source = compiler.get(request(*item)).file("cuda").read_text()
        assert "wgmma_ss<tl::DataType::kBFloat16" in source and "tma_load" in source, item


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("name", OPS)
def test_op_matches_reference(name, rows, shape, ops):
    torch.manual_seed(rows + len(shape))
    args = DECLARED[name].example(layer(shape), rows, "cuda")
    got = getattr(ops, name)(*args)
    compare(name, got, DECLARED[name].reference(*on_cpu(args)))


@pytest.mark.parametrize("shape", sorted(SHAPES) + ["odd"])
@pytest.mark.parametrize("rows", (1, 65, 4096))
def test_partials_against_float64(rows, shape, launcher):
    """The partial dot products summed over the parts against float64 products of the streams with Fn, within
    4e-6 of the sum of |products| (hi + lo represents Fn to 2^-18 = 3.8e-6 relative; bf16 Fn alone, 2^-9, is off
    by 15-20 times that), the sums of squares to 1e-5 relative (fp32 sums); rows past M of the workspaces
    (a larger buffer's tail) stay unwritten. "odd": N 3 (15 mixes, zero rows up to 16 in each half of the B
    operand), K 120 forced into 3 parts of one 64-column step: a partial step and a part wholly past K."""
    torch.manual_seed(rows)
    odd = shape == "odd"
    shape_v = hc_mixes.Variant(3, 40, ITERS, "bfloat16") if odd else layer(shape)
    streams, fn = hc_mixes.example(shape_v, rows, "cuda")[:2]
    v = hc_pre.variant(streams, ITERS)
    v = dataclasses.replace(v, split=3) if odd else v
    s = streams.flatten(1).contiguous()
    mix, sp = fn.shape[0], v.split
    dots = torch.full((rows + 64, sp * mix), 7.0, device="cuda")
    sq = torch.full((rows + 64, sp), 7.0, device="cuda")
    launcher("hc_pre", "hc_pre_split", v)(s, fn.contiguous(), dots[:rows], sq[:rows])
    torch.cuda.synchronize()
    exact = s.double() @ fn.double().T
    bound = 4e-6 * (s.double().abs() @ fn.double().abs().T)
    err = (dots[:rows].view(rows, sp, mix).double().sum(1) - exact).abs()
    assert bool((err <= bound).all()), f"max err {err.max().item()}, bound there {bound.flatten()[err.argmax()].item()}"
    squares = s.double().square().sum(-1)
    assert torch.allclose(sq[:rows].double().sum(-1), squares, rtol=1e-5, atol=0)
    assert bool((dots[rows:] == 7.0).all()) and bool((sq[rows:] == 7.0).all()), "rows past M were written"


@pytest.mark.parametrize("name", OPS)
def test_a_row_does_not_depend_on_the_batch(name, ops):
    """Batch invariance: a token's outputs are bitwise the same alone and inside 4096 tokens (its tile's sums run
    over the same columns in the same order whatever the other rows)."""
    torch.manual_seed(11)
    args = DECLARED[name].example(layer("v4-flash"), 4096, "cuda")
    many = getattr(ops, name)(*args)
    for r in (0, 100, 4095):
        one = getattr(ops, name)(args[0][r : r + 1], *args[1:])
        for a, b in zip(one, many):
            assert torch.equal(a[0], b[r]), f"row {r}"


def test_replays_from_a_cuda_graph(ops):
    torch.manual_seed(3)
    args = hc_pre.example(layer("v4-flash"), 300, "cuda")
    ops.hc_pre(*args)  # load the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.hc_pre(*args)
    args[0].copy_(torch.randn_like(args[0], dtype=torch.float32))  # new streams into the captured input
    graph.replay()
    torch.cuda.synchronize()
    compare("hc_pre", out, hc_pre.reference(*on_cpu(args)))
