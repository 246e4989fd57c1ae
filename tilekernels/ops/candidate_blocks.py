"""V4.1's first top-k level: per query, keep the `topk_blocks` best blocks of `block_size` consecutive
compressed positions (a block scores its best position); the block holding the query's newest visible
position is always kept. The later index sources pick their own top-k only inside these blocks."""

import torch

from tilekernels.op import OpDecl


def reference(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block_size: int) -> torch.Tensor:
    """scores [S, E] fp32 (-inf at positions the query cannot see), visible [S] int (positions < visible[s] are
    seen; 0: none) -> bool [S, E]: the positions of each query's kept blocks. A block with no finite score is
    never kept, except the one holding the query's newest visible position."""
    s, e = scores.shape
    blocks = -(-e // block_size)
    padded = torch.nn.functional.pad(scores.float(), (0, blocks * block_size - e), value=float("-inf"))
    best = padded.view(s, blocks, block_size).amax(-1)
    newest = (visible.view(-1, 1) - 1) // block_size
    best = best.masked_fill(torch.arange(blocks, device=scores.device).view(1, -1) == newest, float("inf"))
    top = best.topk(min(topk_blocks, blocks), dim=-1)
    keep = torch.zeros_like(best, dtype=torch.bool).scatter_(-1, top.indices, top.values > float("-inf"))
    return keep.repeat_interleave(block_size, dim=-1)[:, :e]


OP = OpDecl("candidate_blocks", "candidate-block pre-selection of the two-level top-k", reference)
