"""Checkpoint tensor names -> deepinfer's canonical names (HF in-memory names without `model.`).

Accepted spellings: HF's in-memory names (`model.layers.3.self_attn.q_a_proj.weight`), the names
`save_pretrained` writes (`model.layers.3.attn.wq_a.weight`, `head.weight`, per-expert `ffn.experts.5.w1`),
and DeepSeek's upstream names (`layers.3.attn.wq_a.weight`, `embed.weight`). Quantization scales are
`<weight>_scale_inv` / `<module>.weight_scale_inv` (HF) or `<module>.scale` (upstream). The MTP draft layers
(`mtp.N.*`) are spelled either way, their blocks as target layers' are.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Applied in order to a name with any leading `model.` removed (after HF's conversion_mapping for deepseek_v4).
_RENAMES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p), r)
    for p, r in (
        (r"^embed\.weight$", "embed_tokens.weight"),
        (r"^head\.weight$", "lm_head.weight"),
        (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"),
        (r"\.attn_norm\.", ".input_layernorm."),
        (r"\.ffn_norm\.", ".post_attention_layernorm."),
        (r"\.hc_attn_(fn|base|scale)$", r".attn_hc.\1"),
        (r"\.hc_ffn_(fn|base|scale)$", r".ffn_hc.\1"),
        (r"\.attn\.", ".self_attn."),
        (r"\.ffn\.", ".mlp."),
        (r"\.indexer\.compressor\.", ".compressor.indexer."),
        (r"\.attn_sink$", ".sinks"),
        (r"\.self_attn\.indexer\.weights_proj\.", ".self_attn.compressor.indexer.scorer.weights_proj."),
        (r"\.self_attn\.indexer\.wq_b\.", ".self_attn.compressor.indexer.q_b_proj."),
        (r"\.norm\.", ".kv_norm."),
        (r"\.ape$", ".position_bias"),
        (r"\.wq_a\.", ".q_a_proj."),
        (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
        (r"\.wkv\.", ".kv_proj."),
        (r"\.wgate\.", ".gate_proj."),
        (r"\.wo_a\.", ".o_a_proj."),
        (r"\.wo_b\.", ".o_b_proj."),
        (r"\.q_norm\.", ".q_a_norm."),
        (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
        (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
        (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
        (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
    )
)
_EXPERT = re.compile(r"^((?:layers|mtp)\.\d+\.mlp\.experts)\.(\d+)\.(w1|w2|w3)\.weight$")
_MTP = re.compile(r"^mtp\.(\d+)\.(.*)$")
# The MTP layers' own tensors, kept as they are (`norm` is no compressor's norm, `enorm`/`hnorm` no renamed ones)
_MTP_OWN = re.compile(r"^((e_proj|h_proj|enorm|hnorm|norm|main_proj|main_norm|confidence_head\.proj|"
                      r"markov_head\.(embed|head))\.weight|hc_head\.hc_(fn|base|scale))$")
_EXPERT_PART = {"w1": "gate", "w3": "up", "w2": "down"}


@dataclass(frozen=True)
class Target:
    """Where a checkpoint tensor goes.

    kind: "tensor" (the whole canonical tensor), "expert" (one expert's slice of a stacked expert tensor).
    `scale` is True when the tensor is the quantization scale of that target rather than its values.
    """

    kind: str
    name: str
    scale: bool = False
    expert: int = -1
    part: str = ""  # gate | up | down for expert slices


def is_mtp(name: str) -> bool:
    """Whether checkpoint tensor `name` belongs to an MTP (nextn) draft layer, `[model.]mtp.N.*`."""
    return name.removeprefix("model.").startswith("mtp.")


def canonical(name: str) -> str:
    """Canonical spelling of a (non-scale) tensor name. An MTP layer's block tensors (`mtp.N.attn.wq_a.weight`,
    `mtp.N.self_attn.q_a_proj.weight`, ...) are spelled as a target layer's with `layers.N.` for `mtp.N.`; its
    own ones as `mtp.N.e_proj.weight`, `mtp.N.norm.weight`, `mtp.N.hc_head.hc_fn` (upstream `mtp.N.hc_head_fn`);
    DSpark's as `mtp.N.main_proj.weight`, `mtp.N.markov_head.embed.weight` (DeepSpec: `markov_w1`), ..."""
    key = name[len("model.") :] if name.startswith("model.") else name
    if key == "norm.weight" or key.startswith("hc_head."):
        return key
    m = _MTP.match(key)
    if m:
        layer, rest = m.group(1), re.sub(r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1", m.group(2))
        rest = {"markov_head.markov_w1.weight": "markov_head.embed.weight",  # DeepSpec's names of the Markov head
                "markov_head.markov_w2.weight": "markov_head.head.weight"}.get(rest, rest)
        if _MTP_OWN.match(rest):
            return f"mtp.{layer}.{rest}"
        return f"mtp.{layer}." + canonical(f"layers.{layer}.{rest}")[len(f"layers.{layer}.") :]
    for pattern, repl in _RENAMES:
        key = pattern.sub(repl, key)
    return key


def classify(name: str, all_names: set[str]) -> Target:
    """Map one checkpoint name; `all_names` (every name in the checkpoint) tells a `.scale` of a quantized
    module from the `scale` parameter of an mHC block."""
    scale = False
    if name.endswith(".weight_scale_inv"):
        name, scale = name[: -len("_scale_inv")], True
    elif name.endswith("_scale_inv"):
        name, scale = name[: -len("_scale_inv")], True
    elif name.endswith(".scale") and name[: -len(".scale")] + ".weight" in all_names:
        name, scale = name[: -len(".scale")] + ".weight", True
    key = canonical(name)
    m = _EXPERT.match(key)
    if m:
        part = _EXPERT_PART[m.group(3)]
        fused = m.group(1) + (".down_proj" if part == "down" else ".gate_up_proj")
        return Target("expert", fused, scale=scale, expert=int(m.group(2)), part=part)
    return Target("tensor", key, scale=scale)
