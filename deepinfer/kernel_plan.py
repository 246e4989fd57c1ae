"""The kernel variants a DeepSeek-V4 model needs, derived from its config (what `deepinfer compile` builds)."""

from __future__ import annotations

from typing import Any

from deepinfer.config import CSA, HASH_MOE, HCA, ModelConfig
from tilekernels.ops import hc_post, hc_pre, linear, moe_experts, moe_gate, rms_norm, rope, sparse_attention, swiglu

Item = tuple[str, str, Any]  # (op, kernel, variant)


def kernel_plan(cfg: ModelConfig, dtype: str = "bfloat16") -> list[Item]:
    """Every (op, kernel, variant) the forward pass of `cfg` launches, without duplicates, in a stable order."""
    h, d, r = cfg.hidden_size, cfg.head_dim, cfg.rope_head_dim
    nh, ql, inter, e = cfg.num_attention_heads, cfg.q_lora_rank, cfg.moe_intermediate_size, cfg.n_routed_experts
    di, ni = cfg.index_head_dim, cfg.index_n_heads
    kinds = set(cfg.layer_types)
    items: list[Item] = []

    def add(op: str, kernel: str, variant: Any) -> None:
        if (op, kernel, variant) not in items:
            items.append((op, kernel, variant))

    for dim, weighted in ((h, True), (ql, True), (d, True), (d, False)) + (((di, True),) if CSA in kinds else ()):
        add("rms_norm", "rms_norm", rms_norm.Variant(dim, dtype, weighted))
    for heads, dim in ((nh, d), (1, d)) + (((ni, di), (1, di)) if CSA in kinds else ()):
        add("rope", "rope", rope.Variant(heads, dim, r, dtype))
    add("rope", "rope", rope.Variant(nh, d, r, dtype, inverse=True))
    projections = [(ql, h), (nh * d, ql), (d, h), (h, cfg.o_groups * cfg.o_lora_rank), (e, h), (2 * inter, h),
                   (h, inter), (cfg.vocab_size, h)]
    if CSA in kinds:
        projections += [(2 * d, h), (2 * di, h), (ni * di, ql), (ni, h)]
    if HCA in kinds:
        projections += [(d, h)]
    projections = [(n, k, 1) for n, k in projections] + [(cfg.o_lora_rank, cfg.group_in_dim, cfg.o_groups)]
    for n, k, groups in projections:
        for rows in (1, linear.ROW_BUCKETS[0] + 1, linear.ROW_BUCKETS[1] + 1):  # one variant per row bucket
            narrow, split = linear.plan(rows, n, k, groups)
            add("linear", "gemm", linear.Variant(n, k, dtype, groups=groups, split_k=split, narrow=narrow))
    add("swiglu", "swiglu", swiglu.Variant(inter, dtype))
    for hashed in sorted({t == HASH_MOE for t in cfg.mlp_layer_types}):
        add("moe_gate", "moe_gate", moe_gate.Variant(e, cfg.num_experts_per_tok, cfg.scoring_func, dtype, hashed))
    add("moe_experts", "grouped_gemm", moe_experts.Variant(2 * inter, h, e, dtype))
    add("moe_experts", "grouped_gemm", moe_experts.Variant(h, inter, e, dtype))
    add("hc_pre", "hc_pre", hc_pre.Variant(cfg.hc_mult, h, cfg.hc_sinkhorn_iters, dtype))
    add("hc_post", "hc_post", hc_post.Variant(cfg.hc_mult, h, dtype))
    padded_heads = -(-nh // 16) * 16
    splits = 1
    while splits <= sparse_attention.MAX_SPLITS:
        v = sparse_attention.Variant(padded_heads, d, dtype, splits=splits)
        add("sparse_attention", "split", v)
        add("sparse_attention", "combine", v)
        splits *= 2
    return items
