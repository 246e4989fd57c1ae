"""The tensors of a DeepSeek-V4 model: their canonical names and shapes (`tensor_specs`), and the typed
containers the forward pass reads (`ModelWeights.from_tensors`).

Canonical names are HF transformers' in-memory names without the leading `model.` (e.g.
`layers.3.self_attn.q_a_proj.weight`); `deepinfer.weights.names` maps every checkpoint spelling onto them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from deepinfer.config import CSA, HASH_MOE, HCA, ModelConfig
from deepinfer.errors import WeightsError
from tilekernels.quant import BlockQuantized, cat_rows, dense

# What dtype a tensor is kept in: the compute dtype, always fp32 (norms, mHC, sinks, biases), or int64.
MODEL, FP32, INT = "model", "fp32", "int"


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    kind: str  # MODEL | FP32 | INT


def tensor_specs(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Every tensor the model needs, by canonical name."""
    h, v, n = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    nh, d = cfg.num_attention_heads, cfg.head_dim
    specs: dict[str, TensorSpec] = {
        "embed_tokens.weight": TensorSpec((v, h), MODEL),
        "lm_head.weight": TensorSpec((v, h), MODEL),
        "norm.weight": TensorSpec((h,), FP32),
        "hc_head.hc_fn": TensorSpec((n, n * h), FP32),
        "hc_head.hc_base": TensorSpec((n,), FP32),
        "hc_head.hc_scale": TensorSpec((1,), FP32),
    }
    mixes = (2 + n) * n
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        a = p + "self_attn."
        specs.update(
            {
                p + "input_layernorm.weight": TensorSpec((h,), FP32),
                p + "post_attention_layernorm.weight": TensorSpec((h,), FP32),
                a + "sinks": TensorSpec((nh,), FP32),
                a + "q_a_proj.weight": TensorSpec((cfg.q_lora_rank, h), MODEL),
                a + "q_a_norm.weight": TensorSpec((cfg.q_lora_rank,), FP32),
                a + "q_b_proj.weight": TensorSpec((nh * d, cfg.q_lora_rank), MODEL),
                a + "kv_proj.weight": TensorSpec((d, h), MODEL),
                a + "kv_norm.weight": TensorSpec((d,), FP32),
                a + "o_a_proj.weight": TensorSpec((cfg.o_groups * cfg.o_lora_rank, cfg.group_in_dim), MODEL),
                a + "o_b_proj.weight": TensorSpec((h, cfg.o_groups * cfg.o_lora_rank), MODEL),
            }
        )
        for hc in ("attn_hc", "ffn_hc"):
            specs[p + hc + ".fn"] = TensorSpec((mixes, n * h), FP32)
            specs[p + hc + ".base"] = TensorSpec((mixes,), FP32)
            specs[p + hc + ".scale"] = TensorSpec((3,), FP32)
        kind = cfg.layer_types[i]
        if kind in (CSA, HCA):
            c = a + "compressor."
            width = 2 * d if kind == CSA else d
            rate = cfg.compress_rate(i)
            specs.update(
                {
                    c + "kv_proj.weight": TensorSpec((width, h), MODEL),
                    c + "gate_proj.weight": TensorSpec((width, h), MODEL),
                    c + "position_bias": TensorSpec((rate, width), FP32),
                    c + "kv_norm.weight": TensorSpec((d,), FP32),
                }
            )
        if kind == CSA:
            x = a + "compressor.indexer."
            di = cfg.index_head_dim
            specs.update(
                {
                    x + "kv_proj.weight": TensorSpec((2 * di, h), MODEL),
                    x + "gate_proj.weight": TensorSpec((2 * di, h), MODEL),
                    x + "position_bias": TensorSpec((cfg.compress_rate_csa, 2 * di), FP32),
                    x + "kv_norm.weight": TensorSpec((di,), FP32),
                    x + "q_b_proj.weight": TensorSpec((cfg.index_n_heads * di, cfg.q_lora_rank), MODEL),
                    x + "scorer.weights_proj.weight": TensorSpec((cfg.index_n_heads, h), MODEL),
                }
            )
        m = p + "mlp."
        e, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
        specs[m + "gate.weight"] = TensorSpec((e, h), MODEL)
        if cfg.mlp_layer_types[i] == HASH_MOE:
            specs[m + "gate.tid2eid"] = TensorSpec((v, cfg.num_experts_per_tok), INT)
        else:
            specs[m + "gate.e_score_correction_bias"] = TensorSpec((e,), FP32)
        specs.update(
            {
                m + "experts.gate_up_proj": TensorSpec((e, 2 * inter, h), MODEL),
                m + "experts.down_proj": TensorSpec((e, h, inter), MODEL),
                m + "shared_experts.gate_proj.weight": TensorSpec((inter, h), MODEL),
                m + "shared_experts.up_proj.weight": TensorSpec((inter, h), MODEL),
                m + "shared_experts.down_proj.weight": TensorSpec((h, inter), MODEL),
            }
        )
    return specs


# ------------------------------------------------------------------------------------------------
# typed containers


@dataclass(frozen=True)
class HyperConnection:
    fn: torch.Tensor
    base: torch.Tensor
    scale: torch.Tensor


@dataclass(frozen=True)
class Compressor:
    kv_proj: torch.Tensor
    gate_proj: torch.Tensor
    position_bias: torch.Tensor
    kv_norm: torch.Tensor


@dataclass(frozen=True)
class Indexer:
    compressor: Compressor
    q_b_proj: torch.Tensor
    weights_proj: torch.Tensor


@dataclass(frozen=True)
class Attention:
    sinks: torch.Tensor
    q_a_proj: torch.Tensor
    q_a_norm: torch.Tensor
    q_b_proj: torch.Tensor
    kv_proj: torch.Tensor
    kv_norm: torch.Tensor
    o_a_proj: torch.Tensor
    o_b_proj: torch.Tensor
    compressor: Compressor | None
    indexer: Indexer | None


@dataclass(frozen=True)
class MoE:
    gate: torch.Tensor
    bias: torch.Tensor | None
    tid2eid: torch.Tensor | None
    gate_up: torch.Tensor | None  # the routed experts [E, 2I, H], [E, H, I]; None on a rank of several when the
    down: torch.Tensor | None  # experts are split (`deepinfer.parallel.experts.ExpertShard` holds its share)
    shared_gate_up: torch.Tensor  # [2I, H]: the shared expert's gate and up projections stacked
    shared_down: torch.Tensor


@dataclass(frozen=True)
class Layer:
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    attn_hc: HyperConnection
    ffn_hc: HyperConnection
    attn: Attention
    moe: MoE


@dataclass(frozen=True)
class ModelWeights:
    embed: torch.Tensor
    lm_head: torch.Tensor
    norm: torch.Tensor
    hc_head: HyperConnection
    layers: tuple[Layer, ...]

    @classmethod
    def from_tensors(cls, cfg: ModelConfig, tensors: Mapping[str, torch.Tensor]) -> ModelWeights:
        """Validate a canonical-name tensor map against `tensor_specs(cfg)` and pack it."""
        check_tensors(cfg, tensors)
        t = tensors
        layers = []
        for i in range(cfg.num_hidden_layers):
            p, a, m = f"layers.{i}.", f"layers.{i}.self_attn.", f"layers.{i}.mlp."
            compressor = indexer = None
            if cfg.layer_types[i] in (CSA, HCA):
                compressor = _compressor(t, a + "compressor.")
            if cfg.layer_types[i] == CSA:
                x = a + "compressor.indexer."
                indexer = Indexer(_compressor(t, x), t[x + "q_b_proj.weight"], t[x + "scorer.weights_proj.weight"])
            attn = Attention(
                sinks=t[a + "sinks"],
                q_a_proj=t[a + "q_a_proj.weight"],
                q_a_norm=t[a + "q_a_norm.weight"],
                q_b_proj=t[a + "q_b_proj.weight"],
                kv_proj=t[a + "kv_proj.weight"],
                kv_norm=t[a + "kv_norm.weight"],
                o_a_proj=t[a + "o_a_proj.weight"],
                o_b_proj=t[a + "o_b_proj.weight"],
                compressor=compressor,
                indexer=indexer,
            )
            moe = MoE(
                gate=t[m + "gate.weight"],
                bias=t.get(m + "gate.e_score_correction_bias"),
                tid2eid=_int32(t.get(m + "gate.tid2eid")),  # converted once here, not per call
                gate_up=t[m + "experts.gate_up_proj"],
                down=t[m + "experts.down_proj"],
                shared_gate_up=_join_rows(t[m + "shared_experts.gate_proj.weight"], t[m + "shared_experts.up_proj.weight"],
                                          t["embed_tokens.weight"].dtype),
                shared_down=t[m + "shared_experts.down_proj.weight"],
            )
            layers.append(
                Layer(
                    input_norm=t[p + "input_layernorm.weight"],
                    post_attention_norm=t[p + "post_attention_layernorm.weight"],
                    attn_hc=_hc(t, p + "attn_hc."),
                    ffn_hc=_hc(t, p + "ffn_hc."),
                    attn=attn,
                    moe=moe,
                )
            )
        return cls(
            embed=t["embed_tokens.weight"],
            lm_head=t["lm_head.weight"],
            norm=t["norm.weight"],
            hc_head=HyperConnection(t["hc_head.hc_fn"], t["hc_head.hc_base"], t["hc_head.hc_scale"]),
            layers=tuple(layers),
        )


def check_tensors(cfg: ModelConfig, tensors: Mapping[str, torch.Tensor]) -> None:
    """Raise `WeightsError` naming every missing tensor or the first one of the wrong shape or range."""
    specs = tensor_specs(cfg)
    check_present(specs, tensors)
    for name, spec in specs.items():
        check_shape(name, tensors[name].shape, spec)
        if spec.kind == INT:
            table = tensors[name]
            if table.numel() and not table.is_meta and (int(table.min()) < 0 or int(table.max()) >= cfg.n_routed_experts):
                raise WeightsError(
                    f"tensor {name} routes to expert ids in [{int(table.min())}, {int(table.max())}], "
                    f"outside [0, {cfg.n_routed_experts - 1}]"
                )


def check_specs(specs: Mapping[str, TensorSpec], tensors: Mapping[str, object], what: str = "the config") -> None:
    """Raise `WeightsError` naming every tensor of `specs` that `tensors` lacks, or the first one of another shape
    (`what`: the config as the message names it)."""
    check_present(specs, tensors, what)
    for name, spec in specs.items():
        check_shape(name, tensors[name].shape, spec, what)


def check_present(specs: Mapping[str, TensorSpec], names, what: str = "the config", where: str = "") -> None:
    """Raise `WeightsError` naming (the first eight of) the tensors of `specs` not in `names`; `where` leads the
    message (a loader's checkpoint directory)."""
    missing = [name for name in specs if name not in names]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise WeightsError(f"{where}the checkpoint lacks {len(missing)} tensor(s) {what} requires: {shown}")


def check_shape(label: str, shape, spec: TensorSpec, what: str = "the config") -> None:
    """Raise `WeightsError` when tensor `label` (plain or block-quantized: its logical shape) is not `spec`'s."""
    if tuple(shape) != spec.shape:
        raise WeightsError(f"tensor {label} has shape {list(shape)}, but {what} requires {list(spec.shape)}")


def _join_rows(gate, up, dtype: torch.dtype):
    """gate [I, H] over up [I, H] -> [2I, H]; block-quantized halves stay quantized when the join falls on a block
    boundary, else both become `dtype` (the model's)."""
    if isinstance(gate, BlockQuantized) and isinstance(up, BlockQuantized) and gate.format == up.format \
            and gate.block == up.block and gate.shape[-2] % gate.block[0] == 0:
        return cat_rows([gate, up])
    return torch.cat([dense(gate, dtype), dense(up, dtype)], dim=0)


def _hc(t: Mapping[str, torch.Tensor], prefix: str) -> HyperConnection:
    return HyperConnection(t[prefix + "fn"], t[prefix + "base"], t[prefix + "scale"])


def _compressor(t: Mapping[str, torch.Tensor], prefix: str) -> Compressor:
    return Compressor(
        t[prefix + "kv_proj.weight"], t[prefix + "gate_proj.weight"], t[prefix + "position_bias"], t[prefix + "kv_norm.weight"]
    )


def _int32(table: torch.Tensor | None) -> torch.Tensor | None:
    """The hash-routing table in the gate kernel's index type (the reference ops index with it as well)."""
    return None if table is None else table.to(torch.int32)
