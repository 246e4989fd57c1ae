"""Every op's TileLang kernels on the H200 (sm_90a) at V4-Flash shapes in bf16 against the PyTorch reference,
eagerly and replayed from a CUDA graph. Run with `pytest -m gpu` on the GPU host."""

from __future__ import annotations

import pytest
import torch

from codegen.driver import record_run
from tilekernels.ops import DECLARED

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


def inv_freq(r: int, dev) -> torch.Tensor:
    return 1.0 / (160000 ** (torch.arange(0, r, 2, device=dev).float() / r))


def cases(dev, t: int) -> dict:
    """V4-Flash shapes for a batch of t tokens (each built only when asked for)."""
    def r(*shape, dtype=torch.float32, scale=1.0):
        return torch.randn(*shape, device=dev, dtype=dtype) * scale

    def indices():
        idx = torch.randint(0, 4096 + 128, (t, 640), device=dev)
        idx[:, -13:] = -1
        return idx

    return {
        "rms_norm": lambda: (r(t, 4096, dtype=BF16), 1 + 0.1 * r(4096), 1e-6),
        "rms_norm_unweighted": lambda: (r(t, 64, 512, dtype=BF16), 1e-6),
        "rope": lambda: (r(t, 64, 512, dtype=BF16), torch.randint(0, 65536, (t,), device=dev), inv_freq(64, dev), 1.0,
                         False),
        "linear": lambda: (r(t, 1024, dtype=BF16), r(32768, 1024, dtype=BF16, scale=1 / 32)),
        "grouped_linear": lambda: (r(t, 8, 4096, dtype=BF16), r(8192, 4096, dtype=BF16, scale=1 / 64)),
        "swiglu": lambda: (r(t, 4096, dtype=BF16, scale=4.0), 10.0),
        "moe_gate": lambda: (r(t, 256, dtype=BF16), 6, "sqrtsoftplus", 1.5, 0.01 * r(256)),
        "moe_experts": lambda: (r(t, 4096, dtype=BF16), torch.softmax(r(t, 6), -1),
                                torch.rand(t, 256, device=dev).topk(6, dim=-1).indices,
                                r(256, 4096, 4096, dtype=BF16, scale=1 / 64), r(256, 4096, 2048, dtype=BF16, scale=1 / 45),
                                10.0),
        "hc_pre": lambda: (r(t, 4, 4096, dtype=BF16), 0.01 * r(24, 16384), 0.5 * r(24), 1 + 0.1 * r(3), 20, 1e-6, 1e-6),
        "hc_post": lambda: (r(t, 4, 4096, dtype=BF16), r(t, 4096, dtype=BF16), 2 * torch.rand(t, 4, device=dev),
                            torch.softmax(r(t, 4, 4), -1)),
        "sparse_attention": lambda: (r(t, 64, 512, dtype=BF16), r(4096 + 128, 512, dtype=BF16), indices(), r(64),
                                     512**-0.5),
    }


def compare(name, got, want):
    if name == "moe_gate":  # compare the picked experts' weights, order-free (bf16 logits may tie)
        got = (got[0].sort(-1).values,)
        want = (want[0].float().sort(-1).values,)
    got = (got,) if isinstance(got, torch.Tensor) else got
    want = (want,) if isinstance(want, torch.Tensor) else want
    atol, rtol = DECLARED[name].tolerance["bfloat16"]
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("tokens", [8, 512])
@pytest.mark.parametrize("name", sorted(n for n, op in DECLARED.items() if op.run is not None))
def test_kernel_matches_reference_bf16(name, tokens, sm90_ops, cuda, cache_dir):
    torch.manual_seed(tokens)
    args = cases(cuda, tokens)[name]()
    compare(name, getattr(sm90_ops, name)(*args), DECLARED[name].reference(*args))
    record_run(cache_dir, name, "sm90", f"H200 bf16, {tokens} tokens: matched the reference")


@pytest.mark.parametrize("name", sorted(n for n, op in DECLARED.items() if op.run is not None))
def test_kernel_replays_from_a_cuda_graph(name, sm90_ops, cuda):
    torch.manual_seed(1)
    args = cases(cuda, 16)[name]()
    fn = getattr(sm90_ops, name)
    fn(*args)  # load the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    fresh = cases(cuda, 16)[name]()
    for static, new in zip(args, fresh):  # new data into the captured inputs
        if isinstance(static, torch.Tensor) and static.is_floating_point():
            static.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    compare(name, out, DECLARED[name].reference(*args))
