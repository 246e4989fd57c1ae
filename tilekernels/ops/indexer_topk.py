"""Lightning-indexer selection: the top-k visible compressed entries per query; -1 marks an empty pick."""

import torch

from tilekernels.op import OpDecl


def reference(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """scores [S, E] fp32, visible [S] int (entries e < visible[s] are causal) -> indices [S, min(k, E)] int64."""
    n_entries = scores.shape[-1]
    kk = min(k, n_entries)
    entry = torch.arange(n_entries, device=scores.device)
    future = entry.view(1, -1) >= visible.view(-1, 1)
    picks = scores.masked_fill(future, float("-inf")).topk(kk, dim=-1).indices
    return torch.where(picks >= visible.view(-1, 1), torch.full_like(picks, -1), picks)


OP = OpDecl("indexer_topk", "masked top-k of the indexer scores", reference)
