"""Lightning-indexer scores: s[t, e] = sum_h w[t, h] * ReLU(q[t, h] . k[e]) * scale, in fp32."""

import torch

from tilekernels.op import OpDecl


def reference(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    """q [S, nI, dI], keys [E, dI] (shared by every query) or [S, E, dI] (one key set per query),
    weights [S, nI] -> scores [S, E] fp32."""
    k = keys.float().transpose(-1, -2)
    scores = torch.matmul(q.float(), k if keys.dim() == 3 else k.unsqueeze(0))  # [S, nI, E]
    scores = torch.relu(scores) * scale
    return (scores * weights.float().unsqueeze(-1)).sum(dim=1)


OP = OpDecl("indexer_scores", "lightning indexer scoring (ReLU MQA logits, head-weighted)", reference)
