"""The sm90 overrides of the bf16 routed-expert GEMM on the H200 (tilekernels/ops/moe_bf16_sm90.py at decode sizes,
moe_bf16_prefill_sm90.py past them): the whole `moe_experts` op through the sm90 kernel table against its PyTorch
reference at decode sizes (16-row tiles, swapped-operand kernel) and past them (prefill tiles), at V4-Flash widths
and ragged ones (TMA copies; K rows of 200 / 72 bytes: cp.async copies), the GEMM alone against an fp32 reference
(the prefill kernel at both its tile heights), tiles of no expert left unwritten, and a CUDA-graph replay. Run with `pytest -m gpu tests/gpu/test_moe_bf16_sm90_gpu.py`
on the GPU host."""

import pytest
import torch

from tests.gpu.conftest import built_sm90_table
from tilekernels.ops import DECLARED, moe_bf16_prefill_sm90, moe_bf16_sm90, moe_experts

pytestmark = pytest.mark.gpu

TOKENS = (1, 3, 8, 64, 300)
SHAPES = {"v4-flash": (256, 4096, 2048), "ragged": (8, 96, 80), "odd": (8, 100, 36)}  # experts, hidden, inter
TOL = DECLARED["moe_experts"].tolerance["bfloat16"]


def layer(shape: str) -> moe_experts.Variant:
    """The gate_up variant whose `example` makes the layer's args."""
    experts, hidden, inter = SHAPES[shape]
    return moe_experts.Variant(2 * inter, hidden, experts, "bfloat16")


def planned() -> list[tuple]:
    """Every kernel the op launches at the tested sizes (recorded from `run` on meta tensors)."""
    from tilekernels.kernels import Recorder

    rec = Recorder()
    for shape in SHAPES:
        for tokens in TOKENS + (moe_experts.DECODE_TOKENS + 1,):
            moe_experts.run(rec.for_op("moe_experts"), *moe_experts.example(layer(shape), tokens, "meta"))
    return list(rec.seen)


@pytest.fixture(scope="module")
def ops(cuda, cache_dir):
    """The sm90 op table, its kernels built up front in parallel."""
    return built_sm90_table(planned(), cache_dir)


@pytest.fixture(scope="module")
def launch(ops, cache_dir):
    import backends
    from codegen import Compiler
    from tilekernels.kernels import Launcher

    return Launcher(Compiler(backends.get("sm90"), cache_dir)).for_op("moe_experts")


def test_the_overrides_take_the_bf16_variants_only():
    kernel = DECLARED["moe_experts"].kernel("grouped_gemm")
    decode = moe_experts.variant(4096, 4096, 256, "bfloat16", tokens=moe_experts.DECODE_TOKENS)
    prefill = moe_experts.variant(4096, 4096, 256, "bfloat16", tokens=moe_experts.DECODE_TOKENS + 1)
    fp32 = moe_experts.variant(4096, 4096, 256, "float32", tokens=moe_experts.DECODE_TOKENS + 1)
    assert decode.block_m == moe_experts.DECODE_BLOCK_M and prefill.block_m == moe_experts.PREFILL_BLOCK_M
    assert kernel.body_for("sm90", decode) is moe_bf16_sm90.body_decode
    assert kernel.body_for("sm90", prefill) is moe_bf16_prefill_sm90.body
    assert kernel.body_for("sm90", fp32) is kernel.body
    for target in ("sm100", "ascend", "c"):
        assert kernel.body_for(target, decode) is kernel.body and kernel.body_for(target, prefill) is kernel.body
    assert moe_experts.variant(4096, 4096, 256, "float32", tokens=1).block_m == moe_experts.BLOCK_M


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("tokens", TOKENS + (moe_experts.DECODE_TOKENS + 1,))
def test_op_matches_reference(tokens, shape, ops):
    torch.manual_seed(tokens)
    args = moe_experts.example(layer(shape), tokens, "cuda")
    got, want = ops.moe_experts(*args), moe_experts.reference(*args)
    assert got.shape == want.shape and got.dtype == want.dtype and bool(torch.isfinite(got).all())
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[0], rtol=TOL[1])


def check_gemm_alone(launch, v: moe_experts.Variant, tokens: int, seed: int) -> None:
    """The grouped GEMM's rows against fp32 products of each row's expert (1% of the largest output: bf16
    rounding of the output), and the rows of tiles without an expert left as they were."""
    n, k, experts = v.n, v.k, v.experts
    torch.manual_seed(seed)
    top_k = max(1, min(6, experts // 2))
    idx = torch.rand(tokens, experts, device="cuda").topk(top_k, dim=-1).indices
    w = (torch.randn(experts, n, k, device="cuda") / k**0.5).to(torch.bfloat16)
    dest, tiles = moe_experts.layout(idx, experts, v.block_m)
    a = torch.zeros(tiles.numel() * v.block_m, k, dtype=torch.bfloat16, device="cuda")
    a[dest] = torch.randn(dest.numel(), k, device="cuda").to(torch.bfloat16)
    c = torch.full((a.shape[0], n), 7.0, dtype=torch.bfloat16, device="cuda")
    launch("grouped_gemm", v)(a, w, tiles, c)
    flat = idx.reshape(-1)
    err = top = 0.0
    for e in flat.unique().tolist():
        rows = dest[flat == e]
        want = a[rows].float() @ w[e].float().T
        err, top = max(err, (c[rows].float() - want).abs().max().item()), max(top, want.abs().max().item())
    assert err <= 1e-2 * top, f"max abs err {err}, largest output {top}"
    unused = (tiles < 0).repeat_interleave(v.block_m)
    assert bool((c[unused] == 7.0).all()), "a tile of no expert was written"


def shape_nk(shape: str, which: str) -> tuple[int, int, int]:
    experts, hidden, inter = SHAPES[shape]
    return ((2 * inter, hidden) if which == "gate_up" else (hidden, inter)) + (experts,)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("which", ["gate_up", "down"])
@pytest.mark.parametrize("tokens", (1, 8, 64))
def test_gemm_alone_against_fp32(tokens, which, shape, launch):
    n, k, experts = shape_nk(shape, which)
    check_gemm_alone(launch, moe_experts.variant(n, k, experts, "bfloat16", tokens=tokens), tokens, 7 * tokens + n)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("which", ["gate_up", "down"])
@pytest.mark.parametrize("block_m", moe_bf16_prefill_sm90.ROWS)
def test_prefill_gemm_alone_against_fp32(block_m, which, shape, launch):
    """The prefill override at both tile heights, 300 tokens (ragged per-expert rows, some experts unused)."""
    n, k, experts = shape_nk(shape, which)
    v = moe_experts.Variant(n, k, experts, "bfloat16", block_m)
    assert DECLARED["moe_experts"].kernel("grouped_gemm").body_for("sm90", v) is moe_bf16_prefill_sm90.body
    check_gemm_alone(launch, v, 300, block_m + n)


def test_replays_from_a_cuda_graph(ops):
    torch.manual_seed(3)
    args = moe_experts.example(layer("v4-flash"), 8, "cuda")
    ops.moe_experts(*args)  # load the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.moe_experts(*args)
    x, weights, indices = args[:3]  # new activations, routing and routing weights into the captured inputs
    x.copy_(torch.randn_like(x, dtype=torch.float32))
    weights.copy_(torch.softmax(torch.randn_like(weights, dtype=torch.float32), -1))
    indices.copy_(torch.rand(indices.shape[0], layer("v4-flash").experts, device="cuda").topk(indices.shape[1], -1).indices)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), moe_experts.reference(*args).float(), atol=TOL[0], rtol=TOL[1])
