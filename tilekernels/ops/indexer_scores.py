"""Lightning-indexer scores: s[t, e] = sum_h w[t, h] * ReLU(q[t, h] . k[e]) * scale, in fp32."""

import torch

from tilekernels.op import OpDecl


def reference(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    """q [S, nI, dI], keys [E, dI], weights [S, nI] -> scores [S, E] fp32."""
    scores = torch.matmul(q.float(), keys.float().transpose(0, 1).unsqueeze(0))  # [S, nI, E]
    scores = torch.relu(scores) * scale
    return (scores * weights.float().unsqueeze(-1)).sum(dim=1)


OP = OpDecl("indexer_scores", "lightning indexer scoring (ReLU MQA logits, head-weighted)", reference)
