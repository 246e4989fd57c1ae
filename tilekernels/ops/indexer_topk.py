"""Lightning-indexer selection: the top-k visible compressed entries per query; -1 marks an empty pick.

Equal scores are taken lowest entry first, so a query's picks do not depend on how many entries lie past what it
can see (a prefill's chunking, a batch's padding): V4.1's FP4-rounded index queries and keys with few heads score
exact ties (all-negative dot products give 0 after the ReLU)."""

import torch

from tilekernels.op import OpDecl


def top_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the k largest entries along the last dim, ties broken toward the lower index."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def reference(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """scores [S, E] fp32, visible [S] int (entries e < visible[s] are causal) -> indices [S, min(k, E)] int64."""
    n_entries = scores.shape[-1]
    kk = min(k, n_entries)
    entry = torch.arange(n_entries, device=scores.device)
    future = entry.view(1, -1) >= visible.view(-1, 1)
    picks = top_indices(scores.masked_fill(future, float("-inf")), kk)
    return torch.where(picks >= visible.view(-1, 1), torch.full_like(picks, -1), picks)


OP = OpDecl("indexer_topk", "masked top-k of the indexer scores", reference)
