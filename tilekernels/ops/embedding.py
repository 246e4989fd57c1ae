"""Token embedding lookup (no scaling in V4)."""

import torch

from tilekernels.op import OpDecl


def reference(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """ids [N] int64, table [V, H] -> [N, H] in the table's dtype."""
    return torch.nn.functional.embedding(ids, table)


OP = OpDecl("embedding", "token embedding lookup", reference)
