"""One module per op; `DECLARED` maps each op name to its declaration (the module's `OP`)."""

import importlib

OP_MODULES = (
    "act_quant",
    "candidate_blocks",
    "compress_pool",
    "compress_ring",
    "embedding",
    "engram_gate",
    "engram_lookup",
    "fp4_act_qdq",
    "fp4_gather",
    "fp4_pack",
    "grouped_linear",
    "hc_collapse",
    "hc_head",
    "hc_mid",
    "hc_mixes",
    "hc_post",
    "hc_pre",
    "indexer_scores",
    "indexer_scores_fp4",
    "indexer_topk",
    "linear",
    "moe_experts",
    "moe_gate",
    "rms_norm",
    "rms_norm_unweighted",
    "rope",
    "sparse_attention",
    "swiglu",
)

# Ops only DeepSeek-V4.1 models launch (V4's plans use every other kernel; V4.1's single-pass mHC splits hc_pre)
V41_OPS = ("candidate_blocks", "engram_gate", "engram_lookup", "fp4_act_qdq", "fp4_gather", "fp4_pack", "hc_collapse", "hc_mixes",
           "indexer_scores_fp4")

DECLARED = {decl.name: decl for decl in (importlib.import_module(f"{__name__}.{m}").OP for m in OP_MODULES)}
