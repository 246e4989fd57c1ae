"""The MoE FFN shared by V4 and V4.1: route (top-k on score + bias, or V4's hash table), run the routed experts
and the one shared expert, add."""

from __future__ import annotations

from typing import Callable

import torch

from deepinfer.model.side_stream import branch, join
from deepinfer.model.weights import MoE
from tilekernels import OpTable


def moe(ops: OpTable, w: MoE, x: torch.Tensor, top_k: int, scoring: str, route_scale: float, swiglu_limit: float,
        hash_ids: torch.Tensor | None = None, experts: Callable | None = None,
        side=None) -> torch.Tensor:
    """x [N, H] -> [N, H]. `hash_ids` (the input token ids) route through `w.tid2eid` instead of the gate's top-k.
    `experts(x, weights, indices, limit)`: what runs the routed experts when they are not `w`'s (several ranks: their
    exchange). `side`: the shared expert runs on it, beside the routing and the routed experts."""
    with branch(side):  # reads x, held by the caller until the join
        shared = ops.linear(ops.swiglu(ops.linear(x, w.shared_gate_up), swiglu_limit), w.shared_down)
    logits = ops.linear(x, w.gate)
    hashed = hash_ids is not None
    weights, indices = ops.moe_gate(logits, top_k, scoring, route_scale, bias=None if hashed else w.bias,
                                    hash_ids=hash_ids, tid2eid=w.tid2eid if hashed else None)
    if experts is None:
        routed = ops.moe_experts(x, weights, indices, w.gate_up, w.down, swiglu_limit)
    else:
        routed = experts(x, weights, indices, swiglu_limit)
    join(side)
    return routed + shared
