"""MoE routing: score the router logits, pick experts (top-k with correction bias, or a hash table), and
normalise the picked scores to sum 1 times the routed scaling factor."""

from dataclasses import dataclass

import torch

from tilekernels import dtypes
from tilekernels.op import Kernel, OpDecl, require

SCORINGS = ("sqrtsoftplus", "sigmoid")


def score(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    if scoring == "sqrtsoftplus":
        return torch.nn.functional.softplus(logits).sqrt()
    if scoring == "sigmoid":
        return torch.sigmoid(logits)
    raise ValueError(f"unknown scoring function {scoring!r}; accepted: {', '.join(SCORINGS)}")


def _normalise(scores: torch.Tensor, indices: torch.Tensor, scale: float) -> torch.Tensor:
    weights = scores.gather(1, indices)
    return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * scale


def reference(
    logits: torch.Tensor,
    top_k: int,
    scoring: str,
    routed_scaling: float,
    bias: torch.Tensor | None = None,
    hash_ids: torch.Tensor | None = None,
    tid2eid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] -> (weights [N, k], expert indices [N, k] int64).

    Top-k routing selects by `score + bias` (the bias only affects selection). Hash routing (`tid2eid` given)
    selects `tid2eid[hash_ids]` and has no bias.
    """
    scores = score(logits, scoring)
    if tid2eid is not None:
        indices = tid2eid[hash_ids].long()
    else:
        sel = scores if bias is None else scores + bias
        indices = torch.topk(sel, top_k, dim=-1, sorted=False).indices
    return _normalise(scores, indices, routed_scaling), indices


@dataclass(frozen=True)
class Variant:
    experts: int
    top_k: int
    scoring: str
    dtype: str  # of the logits
    hashed: bool = False  # hash routing (tid2eid) instead of top-k


@dataclass(frozen=True)
class Config:
    threads: int = 128


def body(P, v: Variant, cfg: Config):
    T = P.T
    E, K, dtype = v.experts, v.top_k, v.dtype
    EP = P.padded(E, cfg.threads)  # register width; the padding never wins a max and weighs 0
    M = T.dynamic("M")
    V = T.dynamic("V")

    def activate(x):
        if v.scoring == "sigmoid":
            return 1.0 / (1.0 + T.exp(-x))
        return T.sqrt(T.if_then_else(x > 20.0, x, T.log(1.0 + T.exp(x))))

    def real(j, value, pad):  # `value` for a real expert, `pad` in the padding (no code when E == EP)
        return value if EP == E else T.if_then_else(j < E, value, pad)

    def at(j):  # an in-bounds index into the E-wide staging tiles
        return j if EP == E else T.min(j, E - 1)

    @T.macro
    def route(L, Bias, Ids, Table, Wt, Idx, scale):
        with P.kernel(M, cfg.threads) as pid:
            l_io = P.alloc_io((E,), dtype)
            b_io = P.alloc_io((E,), "float32")
            w_io = P.alloc_io((K,), "float32")
            i_io = P.alloc_io((K,), "int32")
            if not v.hashed:
                T.copy(Bias[0:E], b_io)
            for row in P.tiles(M, pid):
                T.copy(L[row, 0:E], l_io)
                with P.vector(cfg.threads):
                    sc = P.alloc_reg((EP,), "float32")
                    sel = P.alloc_reg((EP,), "float32")
                    cand = P.alloc_reg((EP,), "float32")
                    red = P.alloc_reg((1,), "float32")
                    tot = P.alloc_reg((1,), "float32")
                    for j in T.Parallel(EP):
                        sc[j] = real(j, activate(T.cast(l_io[at(j)], "float32")), 0.0)
                        if not v.hashed:
                            sel[j] = real(j, sc[j] + b_io[at(j)], -T.infinity("float32"))
                    tot[0] = 0.0
                    for r in T.serial(K):
                        if v.hashed:
                            red[0] = T.cast(Table[Ids[row], r], "float32")
                        else:
                            T.reduce_max(sel, red, dim=0)
                            for j in T.Parallel(EP):
                                cand[j] = T.if_then_else(sel[j] == red[0], T.cast(j, "float32"), T.cast(EP, "float32"))
                            T.reduce_min(cand, red, dim=0)
                        for j in T.Parallel(EP):
                            cand[j] = T.if_then_else(T.cast(j, "float32") == red[0], sc[j], 0.0)
                            if not v.hashed:
                                sel[j] = T.if_then_else(T.cast(j, "float32") == red[0], -T.infinity("float32"), sel[j])
                        i_io[r] = T.cast(red[0], "int32")
                        T.reduce_sum(cand, red, dim=0)
                        w_io[r] = red[0]
                        tot[0] = tot[0] + red[0]
                    for r in T.Parallel(K):
                        w_io[r] = w_io[r] / (tot[0] + 1e-20) * scale
                T.copy(w_io, Wt[row, 0:K])
                T.copy(i_io, Idx[row, 0:K])

    if v.hashed:
        @T.prim_func
        def kernel(L: T.Tensor((M, E), dtype), Ids: T.Tensor((M,), "int32"), Table: T.Tensor((V, K), "int32"),
                   Wt: T.Tensor((M, K), "float32"), Idx: T.Tensor((M, K), "int32"), scale: T.float32):
            route(L, None, Ids, Table, Wt, Idx, scale)
    else:
        @T.prim_func
        def kernel(L: T.Tensor((M, E), dtype), Bias: T.Tensor((E,), "float32"),
                   Wt: T.Tensor((M, K), "float32"), Idx: T.Tensor((M, K), "int32"), scale: T.float32):
            route(L, Bias, None, None, Wt, Idx, scale)
    return kernel


KERNEL = Kernel("moe_gate", body, configs={"default": Config(), "c": Config(threads=1)})


def variant(logits: torch.Tensor, top_k: int, scoring: str, tid2eid: torch.Tensor | None = None) -> Variant:
    """The kernel variant `run` launches for these inputs (no tensor values are read: meta tensors work)."""
    require(scoring in SCORINGS, "moe_gate", f"scoring {scoring!r} is not supported; accepted: {', '.join(SCORINGS)}")
    return Variant(experts=logits.shape[-1], top_k=top_k, scoring=scoring, dtype=dtypes.name(logits.dtype),
                   hashed=tid2eid is not None)


def run(launch, logits, top_k, scoring, routed_scaling, bias=None, hash_ids=None, tid2eid=None):
    v = variant(logits, top_k, scoring, tid2eid)
    rows = logits.reshape(-1, v.experts).contiguous()
    weights = torch.empty(rows.shape[0], top_k, dtype=torch.float32, device=logits.device)
    indices = torch.empty(rows.shape[0], top_k, dtype=torch.int32, device=logits.device)
    if v.hashed:
        launch("moe_gate", v)(rows, hash_ids.reshape(-1).to(torch.int32), tid2eid.to(torch.int32), weights, indices,
                              float(routed_scaling))
    else:
        if bias is None:
            bias = torch.zeros(v.experts, dtype=torch.float32, device=logits.device)
        launch("moe_gate", v)(rows, bias.float().contiguous(), weights, indices, float(routed_scaling))
    return weights, indices.long()


def example(v: Variant, rows: int, device) -> tuple:
    logits = torch.randn(rows, v.experts, device=device).to(dtypes.torch_dtype(v.dtype))
    if v.hashed:
        table = torch.randint(0, v.experts, (1000, v.top_k), device=device)
        return (logits, v.top_k, v.scoring, 1.5, None, torch.randint(0, 1000, (rows,), device=device), table)
    return (logits, v.top_k, v.scoring, 1.5, 0.1 * torch.randn(v.experts, device=device))


OP = OpDecl(
    "moe_gate", "MoE gating: sqrtsoftplus/sigmoid top-k with bias, or hash routing", reference,
    kernels=(KERNEL,),
    tolerance={"float32": (1e-5, 1e-5), "bfloat16": (2e-2, 2e-2)},
    run=run, example=example,
)
