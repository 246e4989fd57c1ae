"""ModelConfig: a DeepSeek-V4 `config.json` parsed once into a typed, frozen, validated form.

The parsing rules follow HF transformers' `DeepseekV4Config.__post_init__` (5.23.0), including the legacy
keys real checkpoints ship: `compress_ratios` (0/4/128 per layer), `num_hash_layers`, `qk_rope_head_dim`,
`rope_scaling`, `compress_rate_csa` / `compress_rate_hca`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepinfer.config_dspark import DSparkConfig, dspark_from_hf
from deepinfer.errors import ConfigError

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE = "hash_moe"
TOPK_MOE = "moe"
MLP_LAYER_TYPES = (HASH_MOE, TOPK_MOE)
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid")
ROPE_TYPES = ("default", "yarn")
_RATIO_TO_LAYER_TYPE = {0: SLIDING, 4: CSA, 128: HCA}


@dataclass(frozen=True)
class RopeConfig:
    """One RoPE flavour: 'main' (sliding layers) or 'compress' (CSA/HCA layers, compressors, indexer)."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    rope_head_dim: int
    sliding_window: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    compress_rate_csa: int
    compress_rate_hca: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    o_groups: int
    o_lora_rank: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    rms_norm_eps: float
    rope_main: RopeConfig
    rope_compress: RopeConfig
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    dtype: str = "bfloat16"
    num_nextn_predict_layers: int = 0
    dspark: DSparkConfig | None = None  # DSpark block drafting (its blocks are the mtp.* layers)
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ---- derived sizes -------------------------------------------------------------------------
    def compress_rate(self, layer: int) -> int:
        """Compression rate of a layer's compressor (0 for sliding-only layers)."""
        kind = self.layer_types[layer]
        return {SLIDING: 0, CSA: self.compress_rate_csa, HCA: self.compress_rate_hca}[kind]

    def rope(self, layer: int) -> RopeConfig:
        return self.rope_main if self.layer_types[layer] == SLIDING else self.rope_compress

    @property
    def has_mtp(self) -> bool:
        """The model has MTP (nextn) draft layers, `mtp.{j}.*`: sliding-window, top-k MoE blocks after the last."""
        return self.num_nextn_predict_layers > 0

    @property
    def group_in_dim(self) -> int:
        """Input width of one group of the grouped output projection (n_h * D / g)."""
        return self.num_attention_heads * self.head_dim // self.o_groups

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "config") -> ModelConfig:
        return _parse(dict(raw), source)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not Path(model_dir).is_dir():
            raise ConfigError(f"model directory {str(model_dir)!r} does not exist or is not a directory")
        if not path.is_file():
            raise ConfigError(
                f"{str(model_dir)!r} has no config.json: a DeepSeek-V4 model directory needs config.json "
                "next to its safetensors files"
            )
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a JSON object, got {type(raw).__name__}")
        return _parse(raw, str(path))


# ------------------------------------------------------------------------------------------------
# parsing


_DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280,
    "hidden_size": 4096,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "q_lora_rank": 1024,
    "sliding_window": 128,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "n_routed_experts": 256,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "max_position_embeddings": 1048576,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "hidden_act": "silu",
    "num_hash_layers": 3,
    "num_nextn_predict_layers": 0,  # absent: no MTP layers (HF's own default is 1)
}


def _get(raw: dict[str, Any], key: str) -> Any:
    value = raw.get(key)
    return _DEFAULTS[key] if value is None else value


def _int(raw: dict[str, Any], key: str, source: str, *, minimum: int = 1) -> int:
    value = _get(raw, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{source}: {key} must be an integer >= {minimum}, got {value!r}")
    return value


def _float(raw: dict[str, Any], key: str, source: str, *, positive: bool = False) -> float:
    value = _get(raw, key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
            positive and value <= 0):
        raise ConfigError(f"{source}: {key} must be a finite number{' > 0' if positive else ''}, got {value!r}")
    return float(value)


MAX_POSITIONS = 1 << 24  # no V4 config comes near; keeps cache arithmetic in range


def _parse(raw: dict[str, Any], source: str) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type == "deepseek_v41":
        raise ConfigError(f"{source}: model_type 'deepseek_v41' is a DeepSeek-V4.1 config, not a V4 one; this path "
                          "reads V4 configs only (deepinfer.LLM and `deepinfer run offline` read both: "
                          "deepinfer.config_v41.read_config)")
    if model_type != "deepseek_v4":
        raise ConfigError(
            f"{source}: model_type is {model_type!r}; deepinfer serves DeepSeek-V4 models (model_type "
            "'deepseek_v4') and DeepSeek-V4.1 models (model_type 'deepseek_v41')"
        )
    n_layers = _int(raw, "num_hidden_layers", source)
    kv_heads = _get(raw, "num_key_value_heads")
    if kv_heads != 1:
        raise ConfigError(f"{source}: num_key_value_heads must be 1 (V4 attention is shared-KV MQA), got {kv_heads!r}")
    act = _get(raw, "hidden_act")
    if act != "silu":
        raise ConfigError(f"{source}: hidden_act must be 'silu', got {act!r}")

    rates = dict(raw.get("compress_rates") or {})
    csa_rate = rates.get(CSA, raw.get("compress_rate_csa", 4))
    hca_rate = rates.get(HCA, raw.get("compress_rate_hca", 128))
    for name, rate in (("compressed_sparse_attention rate", csa_rate), ("heavily_compressed_attention rate", hca_rate)):
        if isinstance(rate, bool) or not isinstance(rate, int) or rate < 1:
            raise ConfigError(f"{source}: {name} must be a positive integer, got {rate!r}")

    layer_types = _layer_types(raw, n_layers, source)
    mlp_types = _mlp_layer_types(raw, n_layers, source)

    head_dim = _int(raw, "head_dim", source)
    prf = raw.get("partial_rotary_factor")
    if prf is None:
        legacy = raw.get("qk_rope_head_dim")
        prf = legacy / head_dim if legacy is not None else 64 / 512
    rope_dim = int(head_dim * prf)
    if rope_dim <= 0 or rope_dim % 2 or rope_dim > head_dim:
        raise ConfigError(
            f"{source}: the rotary width (qk_rope_head_dim / partial_rotary_factor * head_dim) is {rope_dim}; "
            f"it must be even and in (0, head_dim={head_dim}]"
        )
    rope_main, rope_compress = _rope(raw, source)

    if (scoring := _get(raw, "scoring_func")) not in SCORING_FUNCS:
        raise ConfigError(f"{source}: scoring_func {scoring!r} is not supported; accepted: {', '.join(SCORING_FUNCS)}")

    vocab = _int(raw, "vocab_size", source)
    eos = _get(raw, "eos_token_id")
    if not (eos_ids := tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)) or not all(isinstance(e, int) and not isinstance(e, bool) and 0 <= e < vocab for e in eos_ids):
        raise ConfigError(f"{source}: eos_token_id must be a token id or a list of token ids in [0, vocab_size="
                          f"{vocab}), got {eos!r}")
    bos = raw.get("bos_token_id", 0)
    if bos is not None and (not isinstance(bos, int) or isinstance(bos, bool) or not 0 <= bos < vocab):
        raise ConfigError(f"{source}: bos_token_id must be a token id in [0, {vocab}) or null, got {bos!r}")
    tie = raw.get("tie_word_embeddings", False)
    if tie is not None and not isinstance(tie, bool):
        raise ConfigError(f"{source}: tie_word_embeddings must be true or false, got {tie!r}")
    if (positions := _int(raw, "max_position_embeddings", source)) > MAX_POSITIONS:
        raise ConfigError(f"{source}: max_position_embeddings={positions} is beyond {MAX_POSITIONS}")
    dtype_name = raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
    if not isinstance(dtype_name, str):
        raise ConfigError(f"{source}: torch_dtype must be a dtype name such as 'bfloat16', got {dtype_name!r}")

    cfg = ModelConfig(
        vocab_size=vocab,
        hidden_size=_int(raw, "hidden_size", source),
        num_hidden_layers=n_layers,
        num_attention_heads=_int(raw, "num_attention_heads", source),
        head_dim=head_dim,
        q_lora_rank=_int(raw, "q_lora_rank", source),
        rope_head_dim=rope_dim,
        sliding_window=_int(raw, "sliding_window", source),
        layer_types=layer_types,
        mlp_layer_types=mlp_types,
        compress_rate_csa=csa_rate,
        compress_rate_hca=hca_rate,
        index_n_heads=_int(raw, "index_n_heads", source),
        index_head_dim=_int(raw, "index_head_dim", source),
        index_topk=_int(raw, "index_topk", source),
        o_groups=_int(raw, "o_groups", source),
        o_lora_rank=_int(raw, "o_lora_rank", source),
        hc_mult=_int(raw, "hc_mult", source),
        hc_sinkhorn_iters=_int(raw, "hc_sinkhorn_iters", source),
        hc_eps=_float(raw, "hc_eps", source, positive=True),
        n_routed_experts=_int(raw, "n_routed_experts", source),
        num_experts_per_tok=_int(raw, "num_experts_per_tok", source),
        moe_intermediate_size=_int(raw, "moe_intermediate_size", source),
        scoring_func=scoring,
        routed_scaling_factor=_float(raw, "routed_scaling_factor", source, positive=True),
        swiglu_limit=_float(raw, "swiglu_limit", source),
        rms_norm_eps=_float(raw, "rms_norm_eps", source, positive=True),
        rope_main=rope_main,
        rope_compress=rope_compress,
        max_position_embeddings=positions,
        bos_token_id=bos,
        eos_token_ids=eos_ids,
        dtype=dtype_name,
        num_nextn_predict_layers=(drafts := _int(raw, "num_nextn_predict_layers", source, minimum=0)),
        dspark=dspark_from_hf(raw, n_layers, drafts, _get(raw, "n_routed_experts"), _get(raw, "num_experts_per_tok"),
                              vocab, source),
        raw=raw,
    )
    _check_consistency(cfg, source)
    return cfg


def _layer_types(raw: dict[str, Any], n_layers: int, source: str) -> tuple[str, ...]:
    types = raw.get("layer_types")
    if types is None and raw.get("compress_ratios") is not None:
        types = []
        for i, ratio in enumerate(raw["compress_ratios"]):
            mtp = i >= n_layers  # an MTP layer's slot (cut below): that layer is sliding-window only
            if ratio not in ((0,) if mtp else _RATIO_TO_LAYER_TYPE):
                raise ConfigError(f"{source}: compress_ratios[{i}] is {ratio!r}; accepted ratios: " + (
                    f"0 only, at an MTP layer's slot (index >= num_hidden_layers={n_layers}: sliding-window only)"
                    if mtp else "0 (sliding), 4 (CSA), 128 (HCA)"))
            types.append(_RATIO_TO_LAYER_TYPE[ratio])
    if types is None:  # HF's built-in default: 2 x HCA, then HCA/CSA alternating
        types = [HCA] * min(n_layers, 2) + [CSA if i % 2 else HCA for i in range(max(n_layers - 2, 0))]
    return _checked(types, n_layers, "layer_types", LAYER_TYPES, source)


def _mlp_layer_types(raw: dict[str, Any], n_layers: int, source: str) -> tuple[str, ...]:
    types = raw.get("mlp_layer_types")
    if types is None:
        n_hash = _get(raw, "num_hash_layers")
        if isinstance(n_hash, bool) or not isinstance(n_hash, int) or n_hash < 0:
            raise ConfigError(f"{source}: num_hash_layers must be an integer >= 0, got {n_hash!r}")
        types = [HASH_MOE] * min(n_layers, n_hash) + [TOPK_MOE] * max(0, n_layers - n_hash)
    return _checked(types, n_layers, "mlp_layer_types", MLP_LAYER_TYPES, source)


def _checked(types, n_layers: int, key: str, accepted: tuple[str, ...], source: str) -> tuple[str, ...]:
    """The per-layer list cut to num_hidden_layers (HF drops the MTP slot this way), every entry known."""
    types = list(types)[:n_layers]
    if len(types) != n_layers:
        raise ConfigError(f"{source}: {key} has {len(types)} entries but num_hidden_layers is {n_layers}")
    for i, t in enumerate(types):
        if t not in accepted:
            raise ConfigError(f"{source}: {key}[{i}] is {t!r}, an unknown layer type; accepted: {', '.join(accepted)}")
    return tuple(types)


def _rope(raw: dict[str, Any], source: str) -> tuple[RopeConfig, RopeConfig]:
    rp = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rp, dict):
        raise ConfigError(f"{source}: rope_parameters / rope_scaling must be an object, got {rp!r}")
    theta = _float(raw, "rope_theta", source, positive=True)
    compress_theta = _float(raw, "compress_rope_theta", source, positive=True)
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, compress = dict(rp["main"]), dict(rp["compress"])
        main.setdefault("rope_theta", theta)
        compress.setdefault("rope_theta", compress_theta)
    else:
        flat = {k: v for k, v in rp.items() if k not in ("main", "compress")}
        main = {"rope_type": "default", "rope_theta": theta}
        compress = {**flat, "rope_theta": compress_theta}
        compress.setdefault("rope_type", compress.get("type", "default"))
        if compress["rope_type"] == "yarn":
            # HF (and the V4 reference) do not scale cos/sin by YaRN's mscale on the compressed branch.
            compress.setdefault("attention_factor", 1.0)
    return _rope_one(main, "main", raw, source), _rope_one(compress, "compress", raw, source)


def _rope_one(d: dict[str, Any], label: str, raw: dict[str, Any], source: str) -> RopeConfig:
    rope_type = d.get("rope_type", d.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{source}: the {label!r} RoPE type {rope_type!r} is not supported; accepted: {', '.join(ROPE_TYPES)}")
    theta = d["rope_theta"]
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
        raise ConfigError(f"{source}: the {label!r} RoPE's rope_theta must be a finite number > 0, got {theta!r}")
    theta = float(theta)
    if rope_type == "default":
        return RopeConfig(theta=theta)
    orig = d.get("original_max_position_embeddings")
    if orig is None:
        raise ConfigError(f"{source}: the {label!r} YaRN RoPE needs original_max_position_embeddings")
    factor = d.get("factor")
    if factor is None:
        factor = _get(raw, "max_position_embeddings") / orig
    attention_factor = d.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = d.get("mscale"), d.get("mscale_all_dim")
        attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) if mscale and mscale_all else _yarn_mscale(factor, 1.0)
    return RopeConfig(
        theta=theta,
        rope_type="yarn",
        factor=float(factor),
        original_max_position_embeddings=int(orig),
        beta_fast=float(d.get("beta_fast") or 32),
        beta_slow=float(d.get("beta_slow") or 1),
        attention_factor=float(attention_factor),
    )


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _check_consistency(cfg: ModelConfig, source: str) -> None:
    if (cfg.num_attention_heads * cfg.head_dim) % cfg.o_groups:
        raise ConfigError(
            f"{source}: num_attention_heads * head_dim ({cfg.num_attention_heads * cfg.head_dim}) must be divisible "
            f"by o_groups ({cfg.o_groups})"
        )
    if cfg.num_experts_per_tok > cfg.n_routed_experts:
        raise ConfigError(f"{source}: num_experts_per_tok ({cfg.num_experts_per_tok}) exceeds n_routed_experts "
                          f"({cfg.n_routed_experts})")
    if cfg.index_head_dim < cfg.rope_head_dim and CSA in cfg.layer_types:
        raise ConfigError(
            f"{source}: index_head_dim ({cfg.index_head_dim}) must be >= the rotary width ({cfg.rope_head_dim})"
        )
    if cfg.hc_mult < 1:
        raise ConfigError(f"{source}: hc_mult must be >= 1, got {cfg.hc_mult}")
