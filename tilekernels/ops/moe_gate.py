"""MoE routing: score the router logits, pick experts (top-k with correction bias, or a hash table), and
normalise the picked scores to sum 1 times the routed scaling factor."""

import torch

from tilekernels.op import OpDecl


def score(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    if scoring == "sqrtsoftplus":
        return torch.nn.functional.softplus(logits).sqrt()
    if scoring == "sigmoid":
        return torch.sigmoid(logits)
    raise ValueError(f"unknown scoring function {scoring!r}; accepted: sqrtsoftplus, sigmoid")


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


OP = OpDecl("moe_gate", "MoE gating: sqrtsoftplus/sigmoid top-k with bias, or hash routing", reference)
