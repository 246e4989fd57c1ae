"""The tensors of a DeepSeek-V4.1 model: their names and shapes (`tensor_specs`, from `V41Config`) and the
typed containers the forward pass reads (`V41Weights.from_tensors`).

Names are DeepSeek's upstream checkpoint names (`layers.3.attn.wq_a.weight`, `embed.weight`; a leading `model.`
is accepted by the loader): transformers has no V4.1 model, so there is no HF spelling to map. Quantization
scales (`<module>.scale`) are not listed: the loader pairs them with their weight. Routed experts are listed one
by one (`layers.L.ffn.experts.E.w1.weight`) and stacked into `MoE.gate_up` / `MoE.down` here, unless the map
already holds a layer's experts stacked (`layers.L.ffn.experts.gate_up_proj` [E, 2I, D] and `...down_proj`
[E, D, I], as `load_v41` builds them while reading, so the experts are never held twice). Any weight may be a
`BlockQuantized` (FP8 / FP4 kept from the checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from deepinfer.config_v41 import V41Config
from deepinfer.errors import WeightsError
from deepinfer.model.weights import FP32, MODEL, HyperConnection, MoE, TensorSpec, _join_rows, check_specs
from tilekernels.quant import BlockQuantized, dense

TABLE = "table"  # kept in its checkpoint format (the FP8 Engram tables: 384M rows in the release)
GATE_UP, DOWN = "experts.gate_up_proj", "experts.down_proj"  # a layer's routed experts stacked, after `ffn.`
V41_CONFIG = "the V4.1 config"  # as the weights errors name it


def key_owner(cfg: V41Config, layer: int) -> int:
    """The layer whose index keys index source `layer` scores against: the nearest kv source at or before it that
    is also an index source (itself when it is one). deepinfer follows this on every step (the fixed behaviour,
    docs/model-v41.md): the reference's decode reads whichever key cache was published last."""
    owners = [s for s in cfg.kv_source_layers if s in cfg.index_source_layers and s <= layer]
    if not owners or cfg.compress_ratios[max(owners)] != cfg.compress_ratios[layer]:
        raise WeightsError(f"index source layer {layer} (ratio {cfg.compress_ratios[layer]}) has no kv-and-index "
                           f"source of the same ratio at or before it to take index keys from "
                           f"(kv sources {list(cfg.kv_source_layers)}, index sources {list(cfg.index_source_layers)})")
    return max(owners)


def _block(specs: dict, p: str, cfg: V41Config, experts: int) -> None:
    """The tensors every block (backbone or draft) has."""
    d, h, hd, q = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    n, inter = cfg.hc_mult, cfg.moe_intermediate_size
    mix = (2 + n) * n
    a = p + "attn."
    specs.update({
        p + "attn_norm.weight": TensorSpec((d,), FP32), p + "ffn_norm.weight": TensorSpec((d,), FP32),
        a + "attn_sink": TensorSpec((h,), FP32),
        a + "wq_a.weight": TensorSpec((q, d), MODEL), a + "q_norm.weight": TensorSpec((q,), FP32),
        a + "wq_b.weight": TensorSpec((h * hd, q), MODEL),
        a + "wkv.weight": TensorSpec((hd, d), MODEL), a + "kv_norm.weight": TensorSpec((hd,), FP32),
        a + "wo_a.weight": TensorSpec((cfg.o_groups * cfg.o_lora_rank, h * hd // cfg.o_groups), MODEL),
        a + "wo_b.weight": TensorSpec((d, cfg.o_groups * cfg.o_lora_rank), MODEL),
        p + "ffn.gate.weight": TensorSpec((experts, d), MODEL), p + "ffn.gate.bias": TensorSpec((experts,), FP32),
    })
    for sub in ("attn", "ffn"):
        specs[f"{p}hc_{sub}_fn"] = TensorSpec((mix, n * d), FP32)
        specs[f"{p}hc_{sub}_base"] = TensorSpec((mix,), FP32)
        specs[f"{p}hc_{sub}_scale"] = TensorSpec((3,), FP32)
    for e in range(experts):
        x = f"{p}ffn.experts.{e}."
        specs.update({x + "w1.weight": TensorSpec((inter, d), MODEL), x + "w3.weight": TensorSpec((inter, d), MODEL),
                      x + "w2.weight": TensorSpec((d, inter), MODEL)})
    x = p + "ffn.shared_experts."
    specs.update({x + "w1.weight": TensorSpec((inter, d), MODEL), x + "w3.weight": TensorSpec((inter, d), MODEL),
                  x + "w2.weight": TensorSpec((d, inter), MODEL)})


def tensor_specs(cfg: V41Config) -> dict[str, TensorSpec]:
    """Every tensor the text model and its draft blocks need, by upstream name (vision tensors are not listed)."""
    d, v, hd = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    specs: dict[str, TensorSpec] = {"embed.weight": TensorSpec((v, d), MODEL), "head.weight": TensorSpec((v, d), MODEL),
                                    "norm.weight": TensorSpec((d,), FP32)}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        _block(specs, p, cfg, cfg.n_routed_experts)
        a = p + "attn."
        if i in cfg.kv_source_layers:
            pooled = cfg.compress_ratios[i] > 1  # projects and pools in fp32, as the reference does
            specs[a + "compressor.wkv.weight"] = TensorSpec((hd, d), FP32 if pooled else MODEL)
            specs[a + "compressor.norm.weight"] = TensorSpec((hd,), FP32)
            if pooled:
                specs[a + "compressor.wgate.weight"] = TensorSpec((hd, d), FP32)
        if i in cfg.index_source_layers:
            di = cfg.index_head_dim
            specs[a + "indexer.wq_b.weight"] = TensorSpec((cfg.index_n_heads * di, cfg.q_lora_rank), MODEL)
            specs[a + "indexer.weights_proj.weight"] = TensorSpec((cfg.index_n_heads, d), MODEL)
            if key_owner(cfg, i) == i:
                specs[a + "indexer.wk.weight"] = TensorSpec((di, hd), MODEL)
                specs[a + "indexer.k_norm.weight"] = TensorSpec((di,), FP32)
        if cfg.engram is not None and i in cfg.engram.layer_ids:
            e, k = cfg.engram, cfg.engram.layer_ids.index(i)
            cols = (e.max_ngram - 1) * e.n_heads * e.head_dim
            specs.update({
                p + "engram.embed.weight": TensorSpec((e.num_embeddings[k], e.head_dim), TABLE),
                p + "engram.wkv.weight": TensorSpec((d * (cfg.hc_mult + 1), cols), MODEL),
                p + "engram.q_weight": TensorSpec((cfg.hc_mult, d), FP32),
                p + "engram.k_weight": TensorSpec((cfg.hc_mult, d), FP32),
            })
    specs.update(draft_specs(cfg))
    return specs


def draft_specs(cfg: V41Config) -> dict[str, TensorSpec]:
    """The DSpark draft blocks (`mtp.{i}.*`): window-only blocks with their own experts, the main-hidden
    projection on the first, the final norm, Markov and confidence heads on the last (`model/v41_dspark.py`)."""
    ds, d = cfg.dspark, cfg.hidden_size
    if ds is None or cfg.num_nextn_predict_layers == 0:
        return {}
    bad = [r for r in cfg.draft_compress_ratios if r != 0]
    if bad:
        raise WeightsError(f"draft layers have compress ratios {list(cfg.draft_compress_ratios)}; DSpark draft "
                           f"blocks are window-only (ratio 0)")
    specs: dict[str, TensorSpec] = {}
    last = cfg.num_nextn_predict_layers - 1
    for i in range(cfg.num_nextn_predict_layers):
        _block(specs, f"mtp.{i}.", cfg, ds.n_routed_experts)
    specs["mtp.0.main_proj.weight"] = TensorSpec((d, d * len(ds.target_layer_ids)), MODEL)
    specs["mtp.0.main_norm.weight"] = TensorSpec((d,), FP32)
    specs[f"mtp.{last}.norm.weight"] = TensorSpec((d,), FP32)
    specs[f"mtp.{last}.markov_head.embed.weight"] = TensorSpec((cfg.vocab_size, ds.markov_rank), MODEL)
    specs[f"mtp.{last}.markov_head.head.weight"] = TensorSpec((cfg.vocab_size, ds.markov_rank), MODEL)
    specs[f"mtp.{last}.confidence_head.proj.weight"] = TensorSpec((1, d + ds.markov_rank), MODEL)
    return specs


# ------------------------------------------------------------------------------------------------ containers


@dataclass(frozen=True)
class Attention41:
    sink: torch.Tensor
    wq_a: torch.Tensor
    q_norm: torch.Tensor
    wq_b: torch.Tensor
    wkv: torch.Tensor
    kv_norm: torch.Tensor
    wo_a: torch.Tensor
    wo_b: torch.Tensor


@dataclass(frozen=True)
class Compressor41:
    wkv: torch.Tensor
    wgate: torch.Tensor | None  # ratio > 1 only
    norm: torch.Tensor


@dataclass(frozen=True)
class Indexer41:
    wq_b: torch.Tensor
    weights_proj: torch.Tensor
    wk: torch.Tensor | None  # key owners only
    k_norm: torch.Tensor | None


@dataclass(frozen=True)
class Engram41:
    table: BlockQuantized | torch.Tensor
    wkv: torch.Tensor
    q_weight: torch.Tensor
    k_weight: torch.Tensor


@dataclass(frozen=True)
class Layer41:
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    attn_hc: HyperConnection
    ffn_hc: HyperConnection
    attn: Attention41
    compressor: Compressor41 | None
    indexer: Indexer41 | None
    engram: Engram41 | None
    moe: MoE


@dataclass(frozen=True)
class V41Weights:
    embed: torch.Tensor
    head: torch.Tensor
    norm: torch.Tensor
    layers: tuple[Layer41, ...]
    drafts: Mapping[str, torch.Tensor]  # mtp.* by name
    dspark: DSpark41 | None = None  # the same tensors as the drafter reads them

    @property
    def draft_layers(self) -> int:
        return 0 if self.dspark is None else len(self.dspark.blocks)

    @classmethod
    def from_tensors(cls, cfg: V41Config, tensors: Mapping[str, torch.Tensor],
                     table_rows: Callable[[int], tuple[int, int]] | None = None) -> V41Weights:
        """Check a name -> tensor map against `tensor_specs(cfg)` and pack it; `table_rows`: the Engram tables hold
        those rows only (`load_v41`'s argument: one rank's part)."""
        check_tensors(cfg, tensors, table_rows)
        t = tensors
        layers = []
        for i in range(cfg.num_hidden_layers):
            p, a = f"layers.{i}.", f"layers.{i}.attn."
            compressor = indexer = engram = None
            if i in cfg.kv_source_layers:
                compressor = Compressor41(t[a + "compressor.wkv.weight"], t.get(a + "compressor.wgate.weight"),
                                          t[a + "compressor.norm.weight"])
            if i in cfg.index_source_layers:
                indexer = Indexer41(t[a + "indexer.wq_b.weight"], t[a + "indexer.weights_proj.weight"],
                                    t.get(a + "indexer.wk.weight"), t.get(a + "indexer.k_norm.weight"))
            if p + "engram.wkv.weight" in t:
                engram = Engram41(t[p + "engram.embed.weight"], t[p + "engram.wkv.weight"], t[p + "engram.q_weight"],
                                  t[p + "engram.k_weight"])
            layers.append(_layer(t, p, cfg.n_routed_experts, compressor, indexer, engram))
        drafts = {name: t[name] for name in draft_specs(cfg)}
        return cls(t["embed.weight"], t["head.weight"], t["norm.weight"], tuple(layers), drafts,
                   _dspark(cfg, t) if drafts else None)


@dataclass(frozen=True)
class DSpark41:
    """The DSpark drafter (`model/v41_dspark.py`): window-only blocks, the main-hidden projection and the heads."""

    blocks: tuple[Layer41, ...]
    main_proj: torch.Tensor  # [H, taps * H]
    main_norm: torch.Tensor
    norm: torch.Tensor
    markov_embed: torch.Tensor  # [V, rank]
    markov_head: torch.Tensor  # [V, rank]
    confidence: torch.Tensor  # [1, H + rank]


def _layer(t: Mapping[str, torch.Tensor], p: str, experts: int, compressor: Compressor41 | None = None,
           indexer: Indexer41 | None = None, engram: Engram41 | None = None) -> Layer41:
    a = p + "attn."
    return Layer41(
        attn_norm=t[p + "attn_norm.weight"], ffn_norm=t[p + "ffn_norm.weight"],
        attn_hc=_hc(t, p + "hc_attn_"), ffn_hc=_hc(t, p + "hc_ffn_"),
        attn=Attention41(*(t[a + n] for n in ("attn_sink", "wq_a.weight", "q_norm.weight", "wq_b.weight",
                                               "wkv.weight", "kv_norm.weight", "wo_a.weight", "wo_b.weight"))),
        compressor=compressor, indexer=indexer, engram=engram, moe=_moe(t, p + "ffn.", experts))


def _dspark(cfg: V41Config, t: Mapping[str, torch.Tensor]) -> DSpark41:
    n, last = cfg.num_nextn_predict_layers, f"mtp.{cfg.num_nextn_predict_layers - 1}."
    return DSpark41(tuple(_layer(t, f"mtp.{i}.", cfg.dspark.n_routed_experts) for i in range(n)),
                    t["mtp.0.main_proj.weight"], t["mtp.0.main_norm.weight"], t[last + "norm.weight"],
                    t[last + "markov_head.embed.weight"], t[last + "markov_head.head.weight"],
                    t[last + "confidence_head.proj.weight"])


def stacked_specs(cfg: V41Config, layer: int) -> dict[str, TensorSpec]:
    """Layer `layer`'s routed experts stacked: gate over up [E, 2I, D] and down [E, D, I]."""
    e, i, d, p = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size, f"layers.{layer}.ffn."
    return {p + GATE_UP: TensorSpec((e, 2 * i, d), MODEL), p + DOWN: TensorSpec((e, d, i), MODEL)}


def check_tensors(cfg: V41Config, tensors: Mapping[str, torch.Tensor],
                  table_rows: Callable[[int], tuple[int, int]] | None = None) -> None:
    """Raise `WeightsError` naming the missing tensors or the first one of the wrong shape (a layer's routed
    experts one by one, or stacked; the Engram tables' rows `table_rows(rows)[1]` when given)."""
    stacked, per_expert = {}, []  # layers given with stacked experts: those replace their experts one by one
    for layer in range(cfg.num_hidden_layers):
        layer_stacked = stacked_specs(cfg, layer)
        if any(name in tensors for name in layer_stacked):
            stacked.update(layer_stacked)
            per_expert.append(f"layers.{layer}.ffn.experts.")
    specs = {n: s for n, s in tensor_specs(cfg).items() if not n.startswith(tuple(per_expert))}
    if table_rows is not None:
        specs = {n: TensorSpec((table_rows(s.shape[0])[1], *s.shape[1:]), s.kind) if s.kind == TABLE else s
                 for n, s in specs.items()}
    check_specs({**specs, **stacked}, tensors, V41_CONFIG)


def _hc(t: Mapping[str, torch.Tensor], prefix: str) -> HyperConnection:
    return HyperConnection(t[prefix + "fn"], t[prefix + "base"], t[prefix + "scale"])


def _moe(t: Mapping[str, torch.Tensor], p: str, experts: int) -> MoE:
    """Upstream's per-expert w1 (gate) / w3 (up) / w2 (down) stacked as the MoE ops take them (or the layer's
    stacked experts as given); the shared expert's w1 over w3."""
    dtype = t[p + "gate.weight"].dtype  # the router stays plain: the model's dtype
    if p + GATE_UP in t:
        gate_up, down = t[p + GATE_UP], t[p + DOWN]
    else:
        e = [f"{p}experts.{i}." for i in range(experts)]
        gate_up = stack_experts([[t[x + "w1.weight"], t[x + "w3.weight"]] for x in e], dtype)
        down = stack_experts([[t[x + "w2.weight"]] for x in e], dtype)
    if isinstance(gate_up, BlockQuantized) != isinstance(down, BlockQuantized):  # the expert kernels take both or none
        gate_up, down = dense(gate_up, dtype), dense(down, dtype)
    s = p + "shared_experts."
    return MoE(gate=t[p + "gate.weight"], bias=t[p + "gate.bias"], tid2eid=None, gate_up=gate_up, down=down,
               shared_gate_up=_join_rows(t[s + "w1.weight"], t[s + "w3.weight"], dtype), shared_down=t[s + "w2.weight"])


def stack_experts(experts: list[list[torch.Tensor | BlockQuantized]],
                  dtype: torch.dtype) -> torch.Tensor | BlockQuantized:
    """Each expert's parts joined along rows (gate over up), stacked [E, rows, K] in one tensor filled part by
    part: block-quantized when every part is, in one format, block and dtype, with the joins on block boundaries;
    else every part dequantized / cast to `dtype`."""
    first = experts[0][0]
    if (all(isinstance(w, BlockQuantized) and _form(w) == _form(first) for parts in experts for w in parts)
            and all(w.shape[-2] % first.block[0] == 0 for w in experts[0][:-1])):
        return BlockQuantized(_fill(experts, lambda w: w.values), _fill(experts, lambda w: w.scales), first.block,
                              first.format)
    return _fill(experts, lambda w: dense(w, dtype))


def _form(w: BlockQuantized) -> tuple:
    return w.format, w.block, w.values.dtype, w.scales.dtype


def _fill(experts: list[list], get) -> torch.Tensor:
    head = [get(w) for w in experts[0]]
    out = torch.empty((len(experts), sum(h.shape[0] for h in head), *head[0].shape[1:]), dtype=head[0].dtype,
                      device=head[0].device)
    for i, parts in enumerate(experts):
        row = 0
        for w in parts:
            part = get(w)
            out[i, row: row + part.shape[0]] = part
            row += part.shape[0]
    return out
