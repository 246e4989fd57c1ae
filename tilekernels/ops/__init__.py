"""One module per op; `DECLARED` maps each op name to its declaration."""

from tilekernels.ops import (
    compress_pool,
    embedding,
    grouped_linear,
    hc_head,
    hc_post,
    hc_pre,
    indexer_scores,
    indexer_topk,
    linear,
    moe_experts,
    moe_gate,
    rms_norm,
    rms_norm_unweighted,
    rope,
    sparse_attention,
    swiglu,
)

_MODULES = (
    compress_pool,
    embedding,
    grouped_linear,
    hc_head,
    hc_post,
    hc_pre,
    indexer_scores,
    indexer_topk,
    linear,
    moe_experts,
    moe_gate,
    rms_norm,
    rms_norm_unweighted,
    rope,
    sparse_attention,
    swiglu,
)

DECLARED = {m.OP.name: m.OP for m in _MODULES}
