"""V41Config: a DeepSeek-V4.1 `config.json` parsed once into a typed, frozen, validated form.

Two spellings are read: the Hugging Face `config.json` (`model_type deepseek_v41`, the text model nested in
`text_config`, HF key names such as `kv_source_layer_ids`) and DeepSeek's `inference/config.json`
(`ModelArgs` names such as `kv_source_layers`, `dim`, `window_size`). The layer wiring follows DeepSeek's
reference `inference/model.py` at revision dba1be0 (tools/v41_reference/NOTES.md): layers with a compression
ratio read the compressed cache of the nearest kv-source layer at or before them (which must have the same
ratio) and the top-k of the nearest index-source layer; the candidate source (a ratio-1 kv and index source)
restricts the index sources after it. `read_config` tells a model directory's family (V4 or V4.1).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepinfer.config import ROPE_TYPES, ModelConfig, RopeConfig
from deepinfer.config_dspark import DSparkConfig
from deepinfer.errors import ConfigError

RATIOS = (0, 1, 2)
# HF config.json name -> DeepSeek inference/config.json name (the form parsed below)
_ALIASES = {
    "hidden_size": "dim", "moe_intermediate_size": "moe_inter_dim", "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads", "num_experts_per_tok": "n_activated_experts", "scoring_func": "score_func",
    "routed_scaling_factor": "route_scale", "qk_rope_head_dim": "rope_head_dim", "rms_norm_eps": "norm_eps",
    "sliding_window": "window_size", "kv_source_layer_ids": "kv_source_layers",
    "index_source_layer_ids": "index_source_layers", "candidate_source_layer_id": "candidate_source_layer",
    "engram_pad_token_id": "engram_pad_id", "num_nextn_predict_layers": "n_mtp_layers",
    "dspark_num_experts_per_tok": "dspark_n_activated_experts", "max_position_embeddings": "max_seq_len",
}
RELEASED_MAX_POSITIONS = 1048576  # max_position_embeddings of the released V4.1-Flash, when a config omits it


@dataclass(frozen=True)
class EngramConfig:
    layer_ids: tuple[int, ...]
    num_embeddings: tuple[int, ...]  # table rows per Engram layer
    max_ngram: int  # n-grams of 2..max_ngram tokens
    vocab_size: int  # hash moduli are primes counted up from here
    n_heads: int  # hash heads per n-gram size
    head_dim: int
    pad_id: int
    compressed_vocab_size: int  # normalized token classes


@dataclass(frozen=True)
class V41Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    rms_norm_eps: float
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    sliding_window: int
    compress_ratios: tuple[int, ...]  # one per backbone layer
    draft_compress_ratios: tuple[int, ...]  # one per draft layer
    kv_source_layers: tuple[int, ...]
    index_source_layers: tuple[int, ...]
    candidate_source_layer: int | None
    candidate_topk_blocks: int
    candidate_block_size: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rope_main: RopeConfig  # ratio-0 layers: rope_theta, no YaRN
    rope_compress: RopeConfig  # ratio >= 1 layers, their latents and indexer: compress_rope_theta with YaRN
    engram: EngramConfig | None
    dspark: DSparkConfig | None
    num_nextn_predict_layers: int
    image_token_id: int | None
    eos_token_ids: tuple[int, ...]
    max_position_embeddings: int  # HF max_position_embeddings, DeepSeek's max_seq_len
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def kv_source(self, layer: int) -> int | None:
        """The layer whose compressed cache `layer` attends to (itself for a source; None: window only)."""
        if self.compress_ratios[layer] == 0:
            return None
        return max(s for s in self.kv_source_layers if s <= layer)

    def index_source(self, layer: int) -> int | None:
        """The layer whose indexer picks `layer`'s compressed positions."""
        if self.compress_ratios[layer] == 0:
            return None
        return max(s for s in self.index_source_layers if s <= layer)

    def layer_kind(self, layer: int) -> str:
        """A short description: window, ratio-R source / reader, + index source, + candidates, + engram."""
        ratio = self.compress_ratios[layer]
        parts = ["window" if ratio == 0 else f"ratio-{ratio} " + ("source" if layer in self.kv_source_layers
                                                                    else f"reader of {self.kv_source(layer)}")]
        if layer in self.index_source_layers:
            parts.append("index source")
        if layer == self.candidate_source_layer:
            parts.append("candidate source")
        if self.engram is not None and layer in self.engram.layer_ids:
            parts.append("engram")
        return " + ".join(parts)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> V41Config:
        return parse(raw, source)


def _flatten(raw: dict[str, Any]) -> dict[str, Any]:
    """The text model's keys in DeepSeek's inference spelling (HF `text_config` unnested, aliases renamed)."""
    text = dict(raw.get("text_config") or {})
    merged = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}
    merged.update(text)
    out = dict(merged)
    for hf, ds in _ALIASES.items():
        if hf in merged and ds not in merged:
            out[ds] = merged[hf]
    scaling = merged.get("rope_scaling") or {}
    if "original_seq_len" not in out and scaling.get("original_max_position_embeddings"):
        out["original_seq_len"] = scaling["original_max_position_embeddings"]
    for key in ("factor", "beta_fast", "beta_slow"):
        target = "rope_factor" if key == "factor" else key
        if target not in out and key in scaling:
            out[target] = scaling[key]
    return out


def parse(raw: dict[str, Any], source: str = "config") -> V41Config:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type not in (None, "deepseek_v41"):
        raise ConfigError(f"{source}: model_type is {model_type!r}; a DeepSeek-V4.1 config has 'deepseek_v41'")
    c = _flatten(raw)

    def get(key: str, kind: type, default: Any = ..., minimum: float | None = None) -> Any:
        if key not in c or c[key] is None:
            if default is ...:
                raise ConfigError(f"{source}: missing required key {key!r}")
            return default
        value = c[key]
        ok = isinstance(value, kind) and not isinstance(value, bool) if kind is not bool else isinstance(value, bool)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok or (minimum is not None and value < minimum):
            want = kind.__name__ + (f" >= {minimum}" if minimum is not None else "")
            raise ConfigError(f"{source}: {key} is {value!r}; expected {want}")
        return value

    def ints(key: str, default: Any = ...) -> tuple[int, ...]:
        value = c.get(key, default)
        if value is ...:
            raise ConfigError(f"{source}: missing required key {key!r}")
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                           for v in value):
            raise ConfigError(f"{source}: {key} is {value!r}; expected a list of integers")
        return tuple(value)

    layers = get("n_layers", int, minimum=1)
    drafts = get("n_mtp_layers", int, 0, minimum=0)
    ratios = ints("compress_ratios")
    if len(ratios) != layers + drafts:
        raise ConfigError(f"{source}: compress_ratios has {len(ratios)} entries; expected one per layer and draft "
                          f"layer ({layers} + {drafts})")
    bad = sorted({r for r in ratios if r not in RATIOS})
    if bad:
        raise ConfigError(f"{source}: compress_ratios holds {bad}; accepted ratios: {RATIOS}")
    backbone = ratios[:layers]
    kv, index = ints("kv_source_layers", ()), ints("index_source_layers", ())
    for name, ids in (("kv_source_layers", kv), ("index_source_layers", index)):
        wrong = [i for i in ids if not 0 <= i < layers or backbone[i] == 0]
        if wrong:
            raise ConfigError(f"{source}: {name} {list(wrong)} are not backbone layers with a compression ratio")
    for layer, ratio in enumerate(backbone):
        if ratio == 0:
            continue
        owners = [s for s in kv if s <= layer]
        if not owners or backbone[max(owners)] != ratio:
            raise ConfigError(f"{source}: layer {layer} has ratio {ratio} but no kv source layer of that ratio at "
                              f"or before it (kv_source_layers {list(kv)})")
        if not any(s <= layer for s in index):
            raise ConfigError(f"{source}: layer {layer} has ratio {ratio} but no index source layer at or before it")
    candidate = get("candidate_source_layer", int, -1)
    candidate = None if candidate < 0 else candidate
    if candidate is not None and (candidate not in kv or candidate not in index or backbone[candidate] != 1):
        raise ConfigError(f"{source}: candidate_source_layer {candidate} must be a ratio-1 kv and index source layer")
    blocks = get("candidate_topk_blocks", int, 0, minimum=0)
    block_size = get("candidate_block_size", int, 0, minimum=0)
    if candidate is not None and (blocks < 1 or block_size < 1):
        raise ConfigError(f"{source}: a candidate source needs candidate_topk_blocks and candidate_block_size >= 1")

    rope_type = "yarn" if get("original_seq_len", int, 0) > 0 else "default"
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{source}: rope type {rope_type!r} is not one of {ROPE_TYPES}")
    main = RopeConfig(theta=get("rope_theta", float, 10000.0))
    compress = RopeConfig(theta=get("compress_rope_theta", float, 160000.0), rope_type=rope_type,
                          factor=get("rope_factor", float, 1.0), original_max_position_embeddings=get(
                              "original_seq_len", int, 0), beta_fast=get("beta_fast", float, 32.0),
                          beta_slow=get("beta_slow", float, 1.0))

    engram = None
    engram_ids = ints("engram_layer_ids", ())
    if engram_ids:
        rows = ints("engram_num_embeddings")
        if len(rows) != len(engram_ids) or not all(0 <= i < layers for i in engram_ids):
            raise ConfigError(f"{source}: engram_layer_ids {list(engram_ids)} must be backbone layers, one "
                              f"engram_num_embeddings entry each (got {list(rows)})")
        engram = EngramConfig(engram_ids, rows, get("engram_max_ngram_size", int, minimum=2),
                              get("engram_vocab_size", int, minimum=1), get("engram_n_heads", int, minimum=1),
                              get("engram_head_dim", int, minimum=1), get("engram_pad_id", int, 2, minimum=0),
                              get("engram_compressed_vocab_size", int, minimum=1))
    dspark = None
    if get("dspark_block_size", int, 0, minimum=0) > 0:
        targets = ints("dspark_target_layer_ids")
        if not targets or not all(0 <= t < layers for t in targets):
            raise ConfigError(f"{source}: dspark_target_layer_ids {list(targets)} must be backbone layers")
        dspark = DSparkConfig(c["dspark_block_size"], get("dspark_noise_token_id", int, minimum=0), targets,
                              get("dspark_markov_rank", int, 256, minimum=1),
                              # 0 or absent: the backbone's (the reference's get_moe_config)
                              get("dspark_n_routed_experts", int, 0, minimum=0) or get("n_routed_experts", int),
                              get("dspark_n_activated_experts", int, 0, minimum=0) or get("n_activated_experts", int))
    heads, groups = get("n_heads", int, minimum=1), get("o_groups", int, minimum=1)
    if heads % groups:
        raise ConfigError(f"{source}: n_heads {heads} is not a multiple of o_groups {groups}")
    head_dim, rope_dim = get("head_dim", int, minimum=1), get("rope_head_dim", int, minimum=0)
    if rope_dim > head_dim or rope_dim % 2:
        raise ConfigError(f"{source}: rope_head_dim {rope_dim} must be even and at most head_dim {head_dim}")
    experts, top_k = get("n_routed_experts", int, minimum=1), get("n_activated_experts", int, minimum=1)
    if top_k > experts:
        raise ConfigError(f"{source}: n_activated_experts {top_k} exceeds n_routed_experts {experts}")
    if get("n_shared_experts", int, 1) != 1:
        raise ConfigError(f"{source}: n_shared_experts is {c['n_shared_experts']}; the reference supports exactly 1")
    score = get("score_func", str, "sqrtsoftplus")
    if score not in ("sqrtsoftplus", "sigmoid", "softmax"):
        raise ConfigError(f"{source}: score_func {score!r}; accepted: sqrtsoftplus, sigmoid, softmax")
    eos = c.get("eos_token_id", 1)
    image = c.get("image_token_id")
    return V41Config(
        vocab_size=get("vocab_size", int, minimum=1), hidden_size=get("dim", int, minimum=1), num_hidden_layers=layers,
        num_attention_heads=heads, head_dim=head_dim, rope_head_dim=rope_dim,
        q_lora_rank=get("q_lora_rank", int, minimum=1), o_groups=groups, o_lora_rank=get("o_lora_rank", int, minimum=1),
        rms_norm_eps=get("norm_eps", float, 1e-20, minimum=0.0), n_routed_experts=experts,
        num_experts_per_tok=top_k, moe_intermediate_size=get("moe_inter_dim", int, minimum=1), scoring_func=score,
        routed_scaling_factor=get("route_scale", float, 1.0), swiglu_limit=get("swiglu_limit", float, 0.0, minimum=0.0),
        sliding_window=get("window_size", int, minimum=1), compress_ratios=backbone, draft_compress_ratios=ratios[layers:],
        kv_source_layers=kv, index_source_layers=index, candidate_source_layer=candidate,
        candidate_topk_blocks=blocks, candidate_block_size=block_size,
        index_n_heads=get("index_n_heads", int, minimum=1), index_head_dim=get("index_head_dim", int, minimum=1),
        index_topk=get("index_topk", int, minimum=1), hc_mult=get("hc_mult", int, 4, minimum=1),
        hc_sinkhorn_iters=get("hc_sinkhorn_iters", int, 20, minimum=1), hc_eps=get("hc_eps", float, 1e-6, minimum=0.0),
        rope_main=main, rope_compress=compress, engram=engram, dspark=dspark, num_nextn_predict_layers=drafts,
        image_token_id=image if isinstance(image, int) else None,
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (eos,),
        max_position_embeddings=get("max_seq_len", int, RELEASED_MAX_POSITIONS, minimum=2), raw=dict(raw),
    )


def is_v41(raw: dict[str, Any]) -> bool:
    """A V4.1 config: HF `model_type deepseek_v41`, or DeepSeek's inference spelling (no model_type, the V4.1
    layer wiring `kv_source_layers`)."""
    return raw.get("model_type") == "deepseek_v41" or ("model_type" not in raw and "kv_source_layers" in raw)


def read_config(model_dir: str | Path) -> ModelConfig | V41Config:
    """A model directory's config, V4 or V4.1 (a missing or unreadable config.json: V4's error naming it)."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        raw = None
    if isinstance(raw, dict) and is_v41(raw):
        return parse(raw, str(path))
    return ModelConfig.from_model_dir(model_dir)
