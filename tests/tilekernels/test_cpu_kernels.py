"""Every op with kernels, run through its wrapper on TileLang's `c` target in fp32, against its reference;
then the whole tiny model through the kernel op table against the reference op table."""

from __future__ import annotations

import pytest
import torch

from codegen.driver import record_run
from tilekernels import reference_table
from tilekernels.kernels import kernel_table
from tilekernels.ops import DECLARED


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cpu-kernels")


@pytest.fixture(scope="module")
def ops(cache):
    return kernel_table("cpu", cache)


def inv_freq(r: int) -> torch.Tensor:
    return 1.0 / (10000 ** (torch.arange(0, r, 2).float() / r))


def sorted_routes(weights, indices):
    order = weights.argsort(dim=-1)
    return weights.gather(1, order), indices.long().gather(1, order)


CASES = {
    "rms_norm": lambda: (torch.randn(5, 64), 1 + 0.1 * torch.randn(64), 1e-6),
    "rms_norm_unweighted": lambda: (torch.randn(5, 4, 32), 1e-6),
    "rope": lambda: (torch.randn(6, 4, 32), torch.randint(0, 5000, (6,)), inv_freq(8), 1.0, False),
    "rope-inverse": lambda: (torch.randn(6, 4, 32), torch.randint(0, 5000, (6,)), inv_freq(8), 1.0, True),
    "rope-kv": lambda: (torch.randn(6, 32), torch.randint(0, 5000, (6,)), inv_freq(8), 0.5, False),
    "linear": lambda: (torch.randn(37, 48), torch.randn(32, 48)),
    "linear-splitk": lambda: (torch.randn(3, 1024), torch.randn(32, 1024) / 32),
    "grouped_linear": lambda: (torch.randn(7, 2, 48), torch.randn(32, 48)),
    "swiglu": lambda: (6 * torch.randn(5, 128), 10.0),
    "moe_gate": lambda: (torch.randn(9, 16), 3, "sqrtsoftplus", 1.5, 0.1 * torch.randn(16)),
    "moe_gate-sigmoid": lambda: (torch.randn(9, 16), 3, "sigmoid", 2.5, 0.1 * torch.randn(16)),
    "moe_gate-hash": lambda: (torch.randn(9, 16), 3, "sqrtsoftplus", 1.5, None, torch.randint(0, 50, (9,)),
                              torch.randint(0, 16, (50, 3))),
    "moe_experts": lambda: (torch.randn(10, 48), torch.rand(10, 2), torch.randint(0, 4, (10, 2)),
                            torch.randn(4, 32, 48) / 7, torch.randn(4, 48, 16) / 4, 10.0),
    "hc_pre": lambda: (torch.randn(5, 4, 64), 0.05 * torch.randn(24, 256), 0.5 * torch.randn(24),
                       1 + 0.1 * torch.randn(3), 20, 1e-6, 1e-6),
    "hc_post": lambda: (torch.randn(5, 4, 64), torch.randn(5, 64), 2 * torch.rand(5, 4),
                        torch.softmax(torch.randn(5, 4, 4), -1)),
    "sparse_attention": lambda: (torch.randn(3, 16, 32), torch.randn(300, 32), _indices(3, 300, 200),
                                 torch.randn(16), 32**-0.5),
    "sparse_attention-4heads": lambda: (torch.randn(2, 4, 32), torch.randn(90, 32), _indices(2, 90, 70),
                                        torch.randn(4), 32**-0.5),
}


def _indices(queries: int, rows: int, k: int) -> torch.Tensor:
    idx = torch.randint(0, rows, (queries, k))
    idx[:, -9:] = -1
    idx[0, :] = -1
    idx[0, 3] = 5  # a query with a single valid row
    return idx


def test_every_kernel_op_is_covered():
    with_kernels = {name for name, op in DECLARED.items() if op.run is not None}
    assert with_kernels == {c.split("-")[0] for c in CASES}


@pytest.mark.parametrize("case", sorted(CASES))
def test_op_matches_reference_in_fp32(case, ops, cache):
    name = case.split("-")[0]
    args = CASES[case]()
    got, want = getattr(ops, name)(*args), DECLARED[name].reference(*args)
    if name == "moe_gate":
        got, want = sorted_routes(*got), sorted_routes(*want)
    got, want = (got,) if isinstance(got, torch.Tensor) else got, (want,) if isinstance(want, torch.Tensor) else want
    atol, rtol = DECLARED[name].tolerance["float32"]
    for g, w in zip(got, want):
        assert g.shape == w.shape
        if g.dtype in (torch.int32, torch.int64):
            assert torch.equal(g.long(), w.long())
        else:
            torch.testing.assert_close(g.float(), w.float(), atol=atol, rtol=rtol)
    record_run(cache, name, "cpu", "fp32 on TileLang's c target matched the reference")


def test_tiny_model_through_kernels_equals_reference_path(cache):
    from deepinfer.config import ModelConfig
    from deepinfer.model.weights import ModelWeights
    from tests.helpers import TINY_A, Runner, canonical_state, hf_model

    cfg = ModelConfig.from_dict(TINY_A)
    weights = ModelWeights.from_tensors(cfg, canonical_state(hf_model(TINY_A)))
    ids = torch.randint(0, cfg.vocab_size, (150,))

    def logits(table):
        run = Runner(cfg, weights, table, tokens=256, seqs=2)
        a, b = run.new_seq(), run.new_seq()
        out = [run.prefill(a, ids[:140]), run.prefill(b, ids[:23])]
        for i in range(140, 150):  # decode steps, both sequences in one batch
            out.append(run.decode([a, b], [int(ids[i]), int(ids[i - 117])]))
        return torch.cat(out)

    assert (logits(kernel_table("cpu", cache)) - logits(reference_table())).abs().max().item() <= 1e-4


@pytest.mark.parametrize("case, message", [
    (lambda: ("linear", torch.randn(3, 48), torch.randn(40, 48)), "N=40 must be a multiple of the tile 16"),
    (lambda: ("hc_post", torch.randn(2, 4, 100), torch.randn(2, 100), torch.rand(2, 4), torch.rand(2, 4, 4)),
     "H=100 must be a multiple of the tile 64"),
])
def test_a_shape_the_target_tiles_cannot_cover_is_refused(case, message, ops):
    """The tile check uses the config the kernel is built with (the `c` target's 16-wide GEMM tiles, 64-wide
    chunks), not a default: such shapes used to run and return wrong values."""
    from tilekernels.errors import ShapeError

    name, *args = case()
    with pytest.raises(ShapeError, match=message):
        getattr(ops, name)(*args)
