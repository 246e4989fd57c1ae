"""The tensors of a DeepSeek-V4 model: their canonical names and shapes (`tensor_specs`; the MTP draft layers':
`mtp_tensor_specs`), and the typed containers the forward pass reads (`ModelWeights.from_tensors`).

Canonical names are HF transformers' in-memory names without the leading `model.` (e.g.
`layers.3.self_attn.q_a_proj.weight`); `deepinfer.weights.names` maps every checkpoint spelling onto them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

import torch

from deepinfer.config import CSA, HASH_MOE, HCA, SLIDING, TOPK_MOE, ModelConfig
from deepinfer.errors import WeightsError
from deepinfer.model.stacked import Stacked, stack
from tilekernels.quant import BlockQuantized, cat_rows, dense

if TYPE_CHECKING:
    from deepinfer.model.dspark_weights import DSparkWeights

# What dtype a tensor is kept in: the compute dtype, always fp32 (norms, mHC, sinks, biases), or int64.
MODEL, FP32, INT = "model", "fp32", "int"


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    kind: str  # MODEL | FP32 | INT


def tensor_specs(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Every tensor the target model needs, by canonical name (the MTP layers': `mtp_tensor_specs`)."""
    h, v, n = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    specs: dict[str, TensorSpec] = {
        "embed_tokens.weight": TensorSpec((v, h), MODEL),
        "lm_head.weight": TensorSpec((v, h), MODEL),
        "norm.weight": TensorSpec((h,), FP32),
        "hc_head.hc_fn": TensorSpec((n, n * h), FP32),
        "hc_head.hc_base": TensorSpec((n,), FP32),
        "hc_head.hc_scale": TensorSpec((1,), FP32),
    }
    for i in range(cfg.num_hidden_layers):
        specs.update(block_specs(cfg, f"layers.{i}.", cfg.layer_types[i], cfg.mlp_layer_types[i]))
    return specs


def mtp_tensor_specs(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Every tensor of the config's MTP (nextn) draft layers, `mtp.{j}.*`: a sliding-window block with top-k MoE,
    the input projections and norms, its final norm and HyperHead (none when `num_nextn_predict_layers` is 0);
    with `cfg.dspark` the DSpark blocks' and heads' instead (`model/dspark_weights.py`)."""
    if cfg.dspark is not None:
        from deepinfer.model.dspark_weights import dspark_tensor_specs

        return dspark_tensor_specs(cfg)
    h, n = cfg.hidden_size, cfg.hc_mult
    specs: dict[str, TensorSpec] = {}
    for j in range(cfg.num_nextn_predict_layers):
        p = f"mtp.{j}."
        specs.update(block_specs(cfg, p, SLIDING, TOPK_MOE))
        specs.update({p + "e_proj.weight": TensorSpec((h, h), MODEL), p + "h_proj.weight": TensorSpec((h, h), MODEL)})
        specs.update({p + name: TensorSpec((h,), FP32) for name in ("enorm.weight", "hnorm.weight", "norm.weight")})
        specs.update({
            p + "hc_head.hc_fn": TensorSpec((n, n * h), FP32),
            p + "hc_head.hc_base": TensorSpec((n,), FP32),
            p + "hc_head.hc_scale": TensorSpec((1,), FP32),
        })
    return specs


def block_specs(cfg: ModelConfig, p: str, kind: str, mlp_kind: str, experts: int = 0) -> dict[str, TensorSpec]:
    """The tensors of one V4 block under prefix `p` (`layers.{i}.`, `mtp.{j}.`) of attention `kind` and MoE
    `mlp_kind`; `experts`: its routed experts when not the config's (DSpark blocks)."""
    h, v, n = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    nh, d = cfg.num_attention_heads, cfg.head_dim
    mixes = (2 + n) * n
    a = p + "self_attn."
    specs = {
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
    for hc in ("attn_hc", "ffn_hc"):
        specs[p + hc + ".fn"] = TensorSpec((mixes, n * h), FP32)
        specs[p + hc + ".base"] = TensorSpec((mixes,), FP32)
        specs[p + hc + ".scale"] = TensorSpec((3,), FP32)
    if kind in (CSA, HCA):
        c = a + "compressor."
        width = 2 * d if kind == CSA else d
        rate = cfg.compress_rate_csa if kind == CSA else cfg.compress_rate_hca
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
    e, inter = experts or cfg.n_routed_experts, cfg.moe_intermediate_size
    specs[m + "gate.weight"] = TensorSpec((e, h), MODEL)
    if mlp_kind == HASH_MOE:
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
    inputs: tuple[Stacked, ...] = ()  # the projections of the block's input stacked (`stacked.py`); fields are views


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
class MTPLayer:
    """One MTP (nextn) draft layer, `mtp.{j}.*`: a V4 block (sliding-window attention, top-k MoE) fed
    `e_proj(enorm(embed(next token))) + h_proj(hnorm(streams))` per residual stream, with its own HyperHead and
    final norm; the embedding and the LM head are the target's."""

    block: Layer
    e_proj: torch.Tensor  # [H, H]
    h_proj: torch.Tensor  # [H, H]
    enorm: torch.Tensor  # [H] fp32
    hnorm: torch.Tensor  # [H] fp32
    norm: torch.Tensor  # [H] fp32
    hc_head: HyperConnection


@dataclass(frozen=True)
class ModelWeights:
    embed: torch.Tensor
    lm_head: torch.Tensor
    norm: torch.Tensor
    hc_head: HyperConnection
    layers: tuple[Layer, ...]
    mtp: tuple[MTPLayer, ...] = ()  # the checkpoint's MTP draft layers (none when absent or not loaded)
    dspark: DSparkWeights | None = None  # its DSpark drafter instead, with `cfg.dspark` (None when not loaded)

    @property
    def draft_layers(self) -> int:
        """The draft layers loaded (each keeps a window ring per slot): DSpark's blocks, or the MTP layers."""
        return len(self.dspark.blocks) if self.dspark is not None else len(self.mtp)

    @classmethod
    def from_tensors(cls, cfg: ModelConfig, tensors: Mapping[str, torch.Tensor]) -> ModelWeights:
        """Validate a canonical-name tensor map against `tensor_specs(cfg)` and pack it; the MTP layers too when
        it holds their tensors (all of `mtp_tensor_specs(cfg)`, or none: `mtp` is then empty)."""
        check_tensors(cfg, tensors)
        t, dtype = tensors, tensors["embed_tokens.weight"].dtype
        layers = [layer_weights(t, f"layers.{i}.", cfg.layer_types[i], dtype) for i in range(cfg.num_hidden_layers)]
        mtp, dspark = [], None
        drafter = check_mtp(cfg, tensors)
        if drafter and cfg.dspark is not None:
            from deepinfer.model.dspark_weights import DSparkWeights

            dspark = DSparkWeights.from_tensors(cfg, t, dtype)
        elif drafter:
            for j in range(cfg.num_nextn_predict_layers):
                p = f"mtp.{j}."
                mtp.append(MTPLayer(
                    block=layer_weights(t, p, SLIDING, dtype),
                    e_proj=t[p + "e_proj.weight"],
                    h_proj=t[p + "h_proj.weight"],
                    enorm=t[p + "enorm.weight"],
                    hnorm=t[p + "hnorm.weight"],
                    norm=t[p + "norm.weight"],
                    hc_head=HyperConnection(t[p + "hc_head.hc_fn"], t[p + "hc_head.hc_base"], t[p + "hc_head.hc_scale"]),
                ))
        return cls(
            embed=t["embed_tokens.weight"],
            lm_head=t["lm_head.weight"],
            norm=t["norm.weight"],
            hc_head=HyperConnection(t["hc_head.hc_fn"], t["hc_head.hc_base"], t["hc_head.hc_scale"]),
            layers=tuple(layers),
            mtp=tuple(mtp),
            dspark=dspark,
        )


def layer_weights(t: Mapping[str, torch.Tensor], p: str, kind: str, dtype: torch.dtype) -> Layer:
    """The block under prefix `p` (`layers.{i}.`, `mtp.{j}.`) of attention `kind`; `dtype`: the model's."""
    a, m = p + "self_attn.", p + "mlp."
    c, x = a + "compressor.", a + "compressor.indexer."
    parts = [("q_a", a + "q_a_proj.weight"), ("kv", a + "kv_proj.weight")]
    if kind in (CSA, HCA):
        parts += [("comp_kv", c + "kv_proj.weight"), ("comp_gate", c + "gate_proj.weight")]
    if kind == CSA:
        parts += [("index_kv", x + "kv_proj.weight"), ("index_gate", x + "gate_proj.weight"),
                  ("index_weights", x + "scorer.weights_proj.weight")]
    inputs, v = stack([(key, t[name]) for key, name in parts])
    compressor = indexer = None
    if kind in (CSA, HCA):
        compressor = Compressor(v["comp_kv"], v["comp_gate"], t[c + "position_bias"], t[c + "kv_norm.weight"])
    if kind == CSA:
        indexer = Indexer(Compressor(v["index_kv"], v["index_gate"], t[x + "position_bias"], t[x + "kv_norm.weight"]),
                          t[x + "q_b_proj.weight"], v["index_weights"])
    attn = Attention(
        sinks=t[a + "sinks"],
        q_a_proj=v["q_a"],
        q_a_norm=t[a + "q_a_norm.weight"],
        q_b_proj=t[a + "q_b_proj.weight"],
        kv_proj=v["kv"],
        kv_norm=t[a + "kv_norm.weight"],
        o_a_proj=t[a + "o_a_proj.weight"],
        o_b_proj=t[a + "o_b_proj.weight"],
        compressor=compressor,
        indexer=indexer,
        inputs=inputs,
    )
    moe = MoE(
        gate=t[m + "gate.weight"],
        bias=t.get(m + "gate.e_score_correction_bias"),
        tid2eid=_int32(t.get(m + "gate.tid2eid")),  # converted once here, not per call
        gate_up=t[m + "experts.gate_up_proj"],
        down=t[m + "experts.down_proj"],
        shared_gate_up=_join_rows(t[m + "shared_experts.gate_proj.weight"], t[m + "shared_experts.up_proj.weight"], dtype),
        shared_down=t[m + "shared_experts.down_proj.weight"],
    )
    return Layer(
        input_norm=t[p + "input_layernorm.weight"],
        post_attention_norm=t[p + "post_attention_layernorm.weight"],
        attn_hc=_hc(t, p + "attn_hc."),
        ffn_hc=_hc(t, p + "ffn_hc."),
        attn=attn,
        moe=moe,
    )


def check_mtp(cfg: ModelConfig, tensors, where: str = "") -> bool:
    """Whether `tensors` (a name -> tensor map, or names alone) holds the config's MTP layers: True when it holds
    every tensor of `mtp_tensor_specs(cfg)` (of the right shapes, when tensors), False when none; a `WeightsError`
    naming the missing ones when only some (`where` leads the message)."""
    specs = mtp_tensor_specs(cfg)
    if not any(name in tensors for name in specs):
        return False
    kind = "DSpark draft block(s)" if cfg.dspark is not None else "MTP layer(s)"
    what = f"the config's {cfg.num_nextn_predict_layers} {kind} (their tensors come all or none)"
    check_present(specs, tensors, what, where)
    if isinstance(tensors, Mapping):
        for name, spec in specs.items():
            check_shape(name, tensors[name].shape, spec, what)
    return True


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


def _int32(table: torch.Tensor | None) -> torch.Tensor | None:
    """The hash-routing table in the gate kernel's index type (the reference ops index with it as well)."""
    return None if table is None else table.to(torch.int32)
