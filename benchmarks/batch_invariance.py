"""Which ops give a token different bits in a different batch: each op of V4 at V4-Flash's shapes (bf16), called on
the first r tokens of one batch for r from 1 to 2048, and each call's rows compared with the same rows of the
largest call; the attention and the indexer also in their prefill and decode forms (a longer row list, shared
keys against each query's own rows). Printed for the default op table and the batch-invariant one:

    python -m benchmarks.batch_invariance [--backend sm90|c] [--out FILE]

tests/gpu/test_batch_invariance_gpu.py asserts the invariant column is all zeros on the H200 (`CASES` is shared)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any, Callable

import torch

ROWS = (1, 3, 8, 33, 64, 65, 200, 511, 600, 2048)


@dataclass(frozen=True)
class Case:
    name: str
    op: str
    make: Callable[[int, torch.device], tuple]  # (tokens, device) -> the op's args for that many tokens
    tokens: tuple[int, ...]  # which args have a leading token dim (sliced to r rows)
    call: Callable[..., Any] | None = None  # (op table, *args) -> tensor(s); default ops.<op>(*args)


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed: int, device, dtype=torch.bfloat16, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=_g(seed)) * scale).to(device=device, dtype=dtype)


def _linear(n: int, k: int, fp8: bool = False):
    def make(r, dev):
        w = _randn(n, k, seed=1, device=dev, scale=k**-0.5)
        if fp8:
            from tilekernels.quant import quantize

            w = quantize(w.float(), "fp8", (128, 128))
        return (_randn(r, k, seed=2, device=dev), w)
    return make


def _experts(fp4: bool, backend: str):
    def make(r, dev):
        e, h, inter, k = 32, 4096, 2048, 6
        up = _randn(e, 2 * inter, h, seed=3, device=dev, scale=h**-0.5)
        down = _randn(e, h, inter, seed=4, device=dev, scale=inter**-0.5)
        if fp4:
            from tilekernels.ops.moe_experts import kernel_layout
            from tilekernels.quant import quantize

            import backends

            target = backends.get(backend) if backend != "reference" else None
            up, down = (quantize(w.float(), "fp4").with_exponent_bytes() for w in (up, down))
            if target is not None and target.kernels:
                up, down = kernel_layout(up, target), kernel_layout(down, target)
        scores = torch.rand(r, e, generator=_g(5))
        idx = scores.topk(k, dim=-1).indices.to(dev)
        wts = torch.softmax(torch.randn(r, k, generator=_g(6)), -1).to(dev)
        return (_randn(r, h, seed=7, device=dev), wts, idx, up, down, 10.0)
    return make


def _hc(r, dev, n=4, h=4096):
    mixes = (2 + n) * n
    return (_randn(r, n, h, seed=8, device=dev), _randn(mixes, n * h, seed=9, device=dev, dtype=torch.float32,
                                                        scale=(n * h) ** -0.5),
            _randn(mixes, seed=10, device=dev, dtype=torch.float32), _randn(3, seed=11, device=dev, dtype=torch.float32))


def _attention(r, dev, width: int = 640, extra: int = 0):
    """q [r, 64, 512] over a pool of 4096 rows; each query lists `width` rows (the last 7 empty), then `extra`
    empty slots (a decode step's longer list)."""
    pool = _randn(4096, 512, seed=12, device=dev)
    idx = torch.randint(0, 4096, (r, width), generator=_g(13))
    idx[:, -7:] = -1
    idx = torch.cat([idx, torch.full((r, extra), -1, dtype=idx.dtype)], 1).to(dev)
    return (_randn(r, 64, 512, seed=14, device=dev), pool, idx, _randn(64, seed=15, device=dev, dtype=torch.float32),
            512**-0.5)


def _scores_shared(r, dev):
    store = _randn(2000, 128, seed=16, device=dev)
    rows = torch.randint(0, 2000, (700,), generator=_g(17)).to(dev)
    return (_randn(r, 64, 128, seed=18, device=dev), store, _randn(r, 64, seed=19, device=dev, dtype=torch.float32,
                                                                    scale=0.125), 128**-0.5, rows)


def _scores_per_query(r, dev):
    q, store, w, scale, rows = _scores_shared(r, dev)
    return (q, store, w, scale, rows.view(1, -1).expand(r, -1).contiguous())


CASES = (
    Case("linear q_a 4096->1024", "linear", _linear(1024, 4096), (0,)),
    Case("linear o_b 8192->4096", "linear", _linear(4096, 8192), (0,)),
    Case("linear kv 4096->512", "linear", _linear(512, 4096), (0,)),
    Case("linear FP8 q_a", "linear", _linear(1024, 4096, fp8=True), (0,)),
    Case("linear FP8 o_b", "linear", _linear(4096, 8192, fp8=True), (0,)),
    Case("grouped_linear o_a 8x4096->1024", "grouped_linear",
         lambda r, dev: (_randn(r, 8, 4096, seed=20, device=dev), _randn(8192, 4096, seed=21, device=dev,
                                                                         scale=4096**-0.5)), (0,)),
    Case("hc_pre", "hc_pre", lambda r, dev: (*_hc(r, dev), 20, 1e-6, 1e-6), (0,)),
    Case("hc_post", "hc_post", lambda r, dev: (_randn(r, 4, 4096, seed=22, device=dev),
                                               _randn(r, 4096, seed=23, device=dev),
                                               _randn(r, 4, seed=24, device=dev, dtype=torch.float32),
                                               _randn(r, 4, 4, seed=25, device=dev, dtype=torch.float32)), (0, 1, 2, 3)),
    Case("hc_head", "hc_head", lambda r, dev: (_randn(r, 4, 4096, seed=26, device=dev),
                                               _randn(4, 4 * 4096, seed=27, device=dev, dtype=torch.float32,
                                                      scale=128**-1),
                                               _randn(4, seed=28, device=dev, dtype=torch.float32),
                                               _randn(1, seed=29, device=dev, dtype=torch.float32), 1e-6, 1e-6), (0,)),
    Case("rms_norm", "rms_norm", lambda r, dev: (_randn(r, 4096, seed=30, device=dev),
                                                 _randn(4096, seed=31, device=dev, dtype=torch.float32), 1e-6), (0,)),
    Case("rope", "rope", lambda r, dev: (_randn(r, 64, 512, seed=32, device=dev),
                                         torch.randint(0, 60000, (r,), generator=_g(33)).to(dev),
                                         1.0 / 10000 ** (torch.arange(0, 64, 2, device=dev).float() / 64), 1.0), (0, 1)),
    Case("act_quant", "act_quant", lambda r, dev: (_randn(r, 4096, seed=34, device=dev), 128, False), (0,)),
    Case("swiglu", "swiglu", lambda r, dev: (_randn(r, 4096, seed=35, device=dev, scale=3.0), 10.0), (0,)),
    Case("compress_pool", "compress_pool", lambda r, dev: (_randn(r, 8, 512, seed=36, device=dev),
                                                           _randn(r, 8, 512, seed=37, device=dev)), (0, 1)),
    Case("moe_gate", "moe_gate", lambda r, dev: (_randn(r, 256, seed=38, device=dev, dtype=torch.float32), 6,
                                                 "sqrtsoftplus", 1.5, _randn(256, seed=39, device=dev,
                                                                             dtype=torch.float32, scale=0.01)), (0,)),
    Case("moe_experts bf16", "moe_experts", _experts(False, "sm90"), (0, 1, 2)),
    Case("indexer_scores (prefill form)", "indexer_scores", _scores_shared, (0, 2)),
    Case("indexer_scores (decode form)", "indexer_scores", _scores_per_query, (0, 2, 4)),
    Case("sparse_attention (prefill list)", "sparse_attention", lambda r, dev: _attention(r, dev), (0, 2)),
    Case("sparse_attention (decode list)", "sparse_attention", lambda r, dev: _attention(r, dev, extra=384), (0, 2)),
)
FP4_CASE = Case("moe_experts FP4", "moe_experts", _experts(True, "sm90"), (0, 1, 2))
# the forms a token meets in prefill and decode: their outputs must agree too
PAIRS = (("indexer_scores (prefill form)", "indexer_scores (decode form)"),
         ("sparse_attention (prefill list)", "sparse_attention (decode list)"))


def outputs(ops, case: Case, device: torch.device, rows: tuple[int, ...] = ROWS) -> dict[int, torch.Tensor]:
    """Each row count's output of `case` (the op's tensors joined along their last dim, as fp32)."""
    full = case.make(max(rows), device)
    got = {}
    for r in rows:
        args = tuple(a[:r] if i in case.tokens else a for i, a in enumerate(full))
        out = getattr(ops, case.op)(*args)
        out = out if isinstance(out, tuple) else (out,)
        got[r] = torch.cat([o.float().reshape(r, -1) for o in out], dim=1)
    return got


def gaps(got: dict[int, torch.Tensor]) -> dict[int, float]:
    """Each row count's largest |difference| from the same rows of the largest call (0.0: the same bits;
    NaN never compares equal, so it counts as a difference)."""
    ref = got[max(got)]
    out = {}
    for r, t in got.items():
        same = torch.equal(t, ref[:r])
        out[r] = 0.0 if same else float((t - ref[:r]).abs().nan_to_num(float("inf")).max())
    return out


def pair_gap(ops, first: str, second: str, device: torch.device, rows: int = 64) -> float:
    """Largest |difference| between two forms of one computation (0.0: the same bits)."""
    a, b = (outputs(ops, next(c for c in CASES if c.name == n), device, (rows,))[rows] for n in (first, second))
    return 0.0 if torch.equal(a, b) else float((a - b).abs().nan_to_num(float("inf")).max())


def report(ops_by_mode: dict[str, Any], device: torch.device, cases=CASES) -> dict:
    """{case: {mode: {rows: gap}}} and {"A = B": {mode: gap}} for the prefill / decode pairs."""
    results: dict = {}
    for case in cases:
        for mode, ops in ops_by_mode.items():
            results.setdefault(case.name, {})[mode] = gaps(outputs(ops, case, device))
    for first, second in PAIRS:
        results[f"{first} = {second}"] = {mode: {0: pair_gap(ops, first, second, device)}
                                          for mode, ops in ops_by_mode.items()}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="sm90")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from deepinfer.env import Env
    from tilekernels.kernels import kernel_table

    device = torch.device("cuda" if args.backend in ("sm90", "sm100") else "cpu")
    cache = Env.read().cache_dir
    ops = {mode: kernel_table(args.backend, cache, invariant=mode == "invariant") for mode in ("default", "invariant")}
    results = report(ops, device, CASES + ((FP4_CASE,) if args.backend == "sm90" else ()))
    print("| op | default: largest gap over row counts | batch-invariant |\n|---|---|---|")
    for name, modes in results.items():
        print(f"| {name} | {max(modes['default'].values()):.3g} | {max(modes['invariant'].values()):.3g} |", flush=True)
    if args.out:
        from pathlib import Path

        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
