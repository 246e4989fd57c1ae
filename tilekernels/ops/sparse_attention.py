"""V4 attention core: every query head attends over one shared K=V head, at the KV rows its query lists
(sliding window + selected compressed entries), with a learned per-head sink in the softmax denominator."""

import torch

from tilekernels.op import OpDecl

_QUERY_BLOCK = 256  # bounds the gathered [block, K, D] tile of the reference


def reference(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [S, H, D], kv [P, D] (K == V), indices [S, K] int (rows of kv; -1 = none), sinks [H] -> [S, H, D].

    Logits, softmax and the weighted sum run in fp32; the output is cast to q's dtype."""
    out = torch.empty_like(q)
    for start in range(0, q.shape[0], _QUERY_BLOCK):
        idx = indices[start : start + _QUERY_BLOCK]
        qb = q[start : start + _QUERY_BLOCK].float()
        rows = kv[idx.clamp(min=0)].float()  # [s, K, D]
        logits = torch.einsum("shd,skd->shk", qb, rows) * scale
        logits = logits.masked_fill((idx < 0).unsqueeze(1), float("-inf"))
        sink = sinks.float().view(1, -1, 1).expand(qb.shape[0], -1, 1)
        full = torch.cat([logits, sink], dim=-1)
        full = full - full.max(dim=-1, keepdim=True).values
        probs = torch.softmax(full, dim=-1)[..., :-1]
        out[start : start + _QUERY_BLOCK] = torch.einsum("shk,skd->shd", probs, rows).to(q.dtype)
    return out


OP = OpDecl("sparse_attention", "MQA with sinks over per-query KV row lists (window + compressed)", reference)
