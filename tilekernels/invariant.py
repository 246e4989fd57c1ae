"""Batch-invariant forms of the PyTorch references: a token's result the same bits whatever batch it is in.

A library matmul or reduction picks its algorithm (and so its summation order) from the whole tensor's shape:
MKL's row of a 1-row GEMM differs in the last bits from the same row of a 16-row one, cuBLAS and ATen's reduction
kernels choose split-K / split reductions by size. Called on pieces of one fixed shape, the same code runs for
every piece, and a row's arithmetic does not depend on where in a piece it sits (each row is reduced on its
own): so each op here runs its reference on `ROWS`-row pieces (zero-padded, fresh and contiguous). The ops whose
per-token work has a batch-dependent width take their own form: the attention attends over a query's valid rows
only (the same list, in the same order, in prefill and decode), the indexer scores fixed-size pieces of entries,
the experts run one (token, slot) at a time. Gathers and stable sorts are exact as they are.

`reference_impl(decl, invariant)` is what a backend's op table holds for an op that runs its reference."""

from __future__ import annotations

from typing import Any, Callable

import torch

from tilekernels.op import OpDecl
from tilekernels.quant import dense

ROWS = 16  # rows per piece (at least 8: MKL takes its GEMV path below that)
ENTRIES = 16  # indexer entries per piece

# op -> (positional args with a leading token dim, keyword args with one); ops not listed are exact or special
TOKEN_ARGS: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {
    "act_quant": ((0,), ()),
    "compress_pool": ((0, 1), ()),
    "compress_ring": ((3, 4), ()),
    "grouped_linear": ((0,), ()),
    "hc_head": ((0,), ()),
    "hc_mid": ((0, 1, 2, 3), ()),
    "hc_post": ((0, 1, 2, 3), ()),
    "hc_pre": ((0,), ()),
    "linear": ((0,), ()),
    "moe_gate": ((0,), ("hash_ids",)),
    "rms_norm": ((0,), ()),
    "rms_norm_unweighted": ((0,), ()),
    "rope": ((0, 1), ()),
    "swiglu": ((0,), ()),
}
EXACT = ("embedding", "indexer_topk")  # a gather; a stable sort (its result is unique)


def reference_impl(decl: OpDecl, invariant: bool) -> Callable[..., Any]:
    """`decl`'s reference, or with `invariant` its batch-invariant form; an op without one (DeepSeek-V4.1's)
    raises when called in that mode."""
    if not invariant or decl.name in EXACT:
        return decl.reference
    special = {"sparse_attention": sparse_attention, "indexer_scores": indexer_scores, "moe_experts": moe_experts}
    if decl.name in special:
        return special[decl.name]
    if decl.name in ("linear", "grouped_linear"):  # a block-quantized weight dequantized once, not once a piece
        run = pieces(decl.reference, *TOKEN_ARGS[decl.name])
        return lambda x, weight: run(x, dense(weight, x.dtype))
    if decl.name in TOKEN_ARGS:
        return pieces(decl.reference, *TOKEN_ARGS[decl.name])

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"op {decl.name!r} has no batch-invariant form: batch invariance covers "
                                  f"DeepSeek-V4's ops ({', '.join(sorted([*TOKEN_ARGS, *EXACT, *special]))})")

    return refuse


def _piece(t: torch.Tensor, start: int, n: int, rows: int) -> torch.Tensor:
    out = t.new_zeros((rows, *t.shape[1:]))
    out[:n] = t[start:start + n]
    return out


def pieces(fn: Callable[..., Any], args_at: tuple[int, ...], kwargs_at: tuple[str, ...] = (),
           rows: int = ROWS) -> Callable[..., Any]:
    """`fn` called on `rows`-row pieces of its token arguments (positional `args_at`, keyword `kwargs_at`), the
    last piece zero-padded; the results (a tensor or a tuple of them) cut back and joined."""

    def run(*args: Any, **kwargs: Any) -> Any:
        n = args[args_at[0]].shape[0]
        if n == 0:
            return fn(*args, **kwargs)
        outs = []
        for start in range(0, n, rows):
            m = min(rows, n - start)
            a = [(_piece(x, start, m, rows) if i in args_at else x) for i, x in enumerate(args)]
            k = {key: (_piece(x, start, m, rows) if key in kwargs_at and x is not None else x)
                 for key, x in kwargs.items()}
            out = fn(*a, **k)
            outs.append(tuple(o[:m] for o in out) if isinstance(out, tuple) else out[:m])
        if isinstance(outs[0], tuple):
            return tuple(torch.cat(parts) for parts in zip(*outs))
        return torch.cat(outs)

    return run


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One query at a time over its listed rows only (-1s dropped, order kept): the same rows in the same order
    for a token in a prefill chunk (its window in the chunk's pool) and in decode (the cache's)."""
    out = torch.empty_like(q)
    sink = sinks.float().view(-1, 1)
    for s in range(q.shape[0]):
        listed = indices[s]
        rows = kv[listed[listed >= 0]].float()  # [K, D], a fresh tensor
        logits = torch.cat([torch.matmul(q[s].float(), rows.T) * scale, sink], dim=1)  # [H, K + 1]: the sink last
        probs = torch.softmax(logits - logits.max(dim=1, keepdim=True).values, dim=1)[:, :-1]
        out[s] = torch.matmul(probs, rows).to(q.dtype)
    return out


def indexer_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, scale: float,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
    """Each query's scores in `ENTRIES`-entry pieces of its keys (zero-padded): the score of (query, entry) does not
    depend on how many entries the call lists (a prefill's closed entries, a decode step's block table)."""
    from tilekernels.ops.indexer_scores import reference

    if rows is not None:
        keys = keys[rows.long()]
    s, e = q.shape[0], keys.shape[-2]
    out = torch.empty(s, e, dtype=torch.float32, device=q.device)
    for i in range(s):
        mine = keys[i] if keys.dim() == 3 else keys
        qi, wi = q[i:i + 1].clone(), weights[i:i + 1].clone()
        for start in range(0, e, ENTRIES):
            m = min(ENTRIES, e - start)
            out[i, start:start + m] = reference(qi, _piece(mine, start, m, ENTRIES), wi, scale)[0, :m]
    return out


def moe_experts(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, gate_up, down,
                limit: float) -> torch.Tensor:
    """One (token, slot) at a time, slots summed in order: an expert's GEMM never depends on how many other
    tokens chose it."""
    from tilekernels.ops.swiglu import reference as swiglu

    experts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        row = x[t:t + 1].clone()
        acc = torch.zeros_like(row)
        for j in range(indices.shape[1]):
            e = int(indices[t, j])
            if e not in experts:
                experts[e] = (dense(gate_up[e], x.dtype), dense(down[e], x.dtype))
            w_up, w_down = experts[e]
            h = swiglu(torch.nn.functional.linear(row, w_up), limit)
            acc += (torch.nn.functional.linear(h, w_down) * weights[t, j:j + 1]).to(x.dtype)
        out[t] = acc[0]
    return out
