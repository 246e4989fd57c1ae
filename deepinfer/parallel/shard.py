"""One rank's share of a DeepSeek-V4 or V4.1 model: its attention heads (tensor parallelism) and routed experts
(expert parallelism), cut from the whole model's weights, and the hooks the forward pass calls (`ModelParallel`).

Tensor parallelism splits each attention layer by output group: rank t of T keeps heads [t H/T, (t+1) H/T) of
the query projection (V4 `q_b_proj`, V4.1 `wq_b`) and the sinks, groups [t G/T, (t+1) G/T) of the grouped output
projection (`o_a_proj` / `wo_a`) and the matching input columns of the last one (`o_b_proj` / `wo_b`), so its
attention output is a partial sum over its groups that the tensor-parallel group adds up. Everything else (the
shared KV head and its cache, compressors, indexer, mHC, norms, the shared expert, the gate, V4.1's Engram
projections and DSpark draft blocks) is whole on every rank, except V4.1's Engram tables, split by rows over the
ranks whose forwards meet (`deepinfer/parallel/engram.py`). Block-quantized weights are cut on their scale-block
grid.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Callable

import torch

from deepinfer.config import ModelConfig
from deepinfer.config_v41 import V41Config
from deepinfer.errors import ConfigError
from deepinfer.model.engram_hash import EngramHasher
from deepinfer.model.v41_weights import V41Weights
from deepinfer.model.weights import ModelWeights
from deepinfer.parallel.comm import Comm
from deepinfer.parallel.config import Rank
from deepinfer.parallel.engram import EngramShard, table_split
from deepinfer.parallel.eplb import Placement
from deepinfer.parallel.experts import EplbConfig, ExpertShard, initial_placement, rows, slot_experts
from tilekernels import OpTable
from tilekernels.quant import BlockQuantized


@dataclass(frozen=True)
class ModelParallel:
    """What the forward pass of one rank does differently."""

    attention_cfg: ModelConfig  # this rank's heads and output groups (a V41Config for V4.1)
    attention_sum: Callable[[torch.Tensor], torch.Tensor] | None  # adds the attention output over the group
    experts: ExpertShard | None  # the routed experts over the ranks (None: all on this rank)
    engram: EngramShard | None = None  # V4.1's Engram tables over the ranks (None: whole on this rank)


def expert_placement(cfg: ModelConfig, comm: Comm, eplb_cfg: EplbConfig | None) -> Placement | None:
    """Where the routed experts start (None: every rank holds all of them)."""
    if not comm.rank.parallel.enable_expert_parallel:
        return None
    return initial_placement(cfg.num_hidden_layers, cfg.n_routed_experts, comm.rank.parallel.world, eplb_cfg)


def experts_to_read(placement: Placement, rank: int) -> Callable[[str], list[int]]:
    """For the checkpoint loader: the experts of stacked tensor `layers.<i>.mlp.experts.*` this rank's slots hold."""
    return lambda name: slot_experts(placement, rank, int(name.split(".")[1]))


TP_CUT = (".self_attn.q_b_proj.", ".self_attn.o_a_proj.", ".self_attn.o_b_proj.", ".self_attn.sinks")


def rank_share(cfg: ModelConfig, rank: Rank, placement: Placement | None) -> Callable[[str], float]:
    """The fraction of each canonical tensor this rank keeps (for the weight bytes and the fit check)."""
    tp = rank.parallel.tensor_parallel_size
    experts = 1.0 if placement is None else placement.slots_per_rank / cfg.n_routed_experts

    def share(name: str) -> float:
        if ".mlp.experts." in name:
            return experts
        return 1.0 / tp if any(part in name + "." for part in TP_CUT) else 1.0

    return share


def take_experts(tensors: dict, cfg, placement: Placement, rank: int, whole: bool,
                 module: str = "mlp") -> tuple[list, list]:
    """Every layer's routed-expert weights of this rank's slots, popped out of `tensors` (`whole`: the tensors hold
    every expert, else already this rank's slots); a meta tensor of the whole shape stays for the shape checks.
    `module`: the layers' MoE module name (V4 `mlp`, V4.1 `ffn`)."""
    gate_up, down = [], []
    for i in range(cfg.num_hidden_layers):
        prefix = f"layers.{i}.{module}.experts."
        for name, out in ((prefix + "gate_up_proj", gate_up), (prefix + "down_proj", down)):
            w = tensors[name]
            if whole:
                w = rows(w, torch.tensor(slot_experts(placement, rank, i)))
            out.append(w)
            tensors[name] = torch.empty((cfg.n_routed_experts, *w.shape[1:]), device="meta")  # logical shape
    return gate_up, down


def rank_model(cfg: ModelConfig, weights: ModelWeights, ops: OpTable, comm: Comm, placement: Placement | None,
               experts: tuple[list, list] | None, eplb_cfg: EplbConfig | None = None):
    """This rank's `DeepseekV4`: its share of the model's `weights` (`experts`: its slots' weights under
    `placement`, when the experts are split) and the sums over ranks."""
    from deepinfer.model.model import DeepseekV4

    rank = comm.rank
    p = rank.parallel
    p.check_model(cfg.num_attention_heads, cfg.o_groups, cfg.n_routed_experts,
                  redundant=eplb_cfg.redundant_experts if eplb_cfg is not None else 0)
    shard = None if placement is None else ExpertShard(ops, comm, placement, experts[0], experts[1], eplb_cfg)
    hooks = ModelParallel(local_config(cfg, rank), comm.tp_sum if p.tensor_parallel_size > 1 else None, shard)
    return DeepseekV4(cfg, shard_weights(weights, cfg, rank), ops, hooks)


V41_TP_CUT = re.compile(r"^layers\.\d+\.attn\.(attn_sink|wq_b\.weight|wo_a\.weight|wo_b\.weight)$")


def rank_share_v41(cfg: V41Config, rank: Rank, placement: Placement | None) -> Callable[[str], float]:
    """`rank_share` for V4.1's checkpoint names (the backbone's routed experts and attention heads, the Engram
    tables' rows (`engram.table_split`); DSpark's `mtp.*` blocks stay whole)."""
    from deepinfer.weights.v41_loader import ROUTED

    tp = rank.parallel.tensor_parallel_size
    experts = 1.0 if placement is None else placement.slots_per_rank / cfg.n_routed_experts
    split = table_split(cfg, rank)
    tables = {} if split is None else {f"layers.{i}.engram.embed.weight": split.rows(n)[1] / n
                                       for i, n in zip(cfg.engram.layer_ids, cfg.engram.num_embeddings)}
    return lambda name: (experts if ROUTED.match(name) else 1.0 / tp if V41_TP_CUT.match(name)
                         else tables.get(name, 1.0))


def rank_model_v41(cfg: V41Config, weights: V41Weights, ops: OpTable, hasher: EngramHasher | None, comm: Comm,
                   shard: ExpertShard | None):
    """This rank's `DeepseekV41`: its attention heads cut from the whole model's `weights` (V41Weights), its routed
    experts in `shard` when they are split (the weights then keep none), its rows of the Engram tables when the
    ranks split them (`weights` hold those rows, as the loader reads them, or whole tables, cut here)."""
    from deepinfer.model.v41 import DeepseekV41

    rank, v41_heads = comm.rank, ("sink", "wq_b", "wo_a", "wo_b", "attn")
    split, engram = table_split(cfg, rank), None
    layers = [dataclasses.replace(layer, attn=cut_heads(layer.attn, cfg, rank, f"layers.{i}", v41_heads))
              for i, layer in enumerate(weights.layers)]
    if split is not None:
        parts = [split.rows(n) for n in cfg.engram.num_embeddings]
        for (first, count), i, n in zip(parts, cfg.engram.layer_ids, cfg.engram.num_embeddings):
            table = layers[i].engram.table
            if table.shape[0] == n and count != n:  # whole: keep this rank's rows
                table = cut(table, -2, first, count, f"layers.{i}.engram.embed.weight")
            layers[i] = dataclasses.replace(layers[i], engram=dataclasses.replace(layers[i].engram, table=table))
        engram = EngramShard(comm, split, [f for f, _ in parts], [c for _, c in parts])
    weights = dataclasses.replace(weights, layers=tuple(layers))
    if shard is not None:
        weights = without_routed_experts(weights)
    tp_sum = comm.tp_sum if rank.parallel.tensor_parallel_size > 1 else None
    return DeepseekV41(cfg, weights, ops, hasher, ModelParallel(local_config(cfg, rank), tp_sum, shard, engram))


def local_config(cfg: ModelConfig, rank: Rank) -> ModelConfig:
    """`cfg` with this rank's attention heads and output groups."""
    tp = rank.parallel.tensor_parallel_size
    return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // tp, o_groups=cfg.o_groups // tp)


def shard_weights(weights: ModelWeights, cfg: ModelConfig, rank: Rank) -> ModelWeights:
    """This rank's attention heads of the whole model's `weights`, without the routed experts when they are split
    (`ExpertShard` holds this rank's)."""
    v4_heads = ("sinks", "q_b_proj", "o_a_proj", "o_b_proj", "self_attn")
    layers = []
    for i, layer in enumerate(weights.layers):
        attn = cut_heads(layer.attn, cfg, rank, f"layers.{i}", v4_heads)
        m = layer.moe
        moe = dataclasses.replace(m, gate_up=None, down=None) if rank.parallel.enable_expert_parallel else m
        layers.append(dataclasses.replace(layer, attn=attn, moe=moe))
    return dataclasses.replace(weights, layers=tuple(layers))


def cut_heads(a, cfg, rank: Rank, layer: str, fields: tuple[str, str, str, str, str]):
    """Attention weights `a` with this rank's heads and output groups; `fields`: the names of the sinks, the query
    projection, the grouped and the last output projection, and of the attention module (for errors)."""
    tp, t = rank.parallel.tensor_parallel_size, rank.tp_rank
    if tp == 1:
        return a
    sink, q_b, o_a, o_b, module = fields
    heads, groups = cfg.num_attention_heads // tp, cfg.o_groups // tp
    d, r, name = cfg.head_dim, cfg.o_lora_rank, f"{layer}.{module}."
    return dataclasses.replace(a, **{
        sink: getattr(a, sink)[t * heads:(t + 1) * heads].contiguous(),
        q_b: cut(getattr(a, q_b), -2, t * heads * d, heads * d, name + q_b),
        o_a: cut(getattr(a, o_a), -2, t * groups * r, groups * r, name + o_a),
        o_b: cut(getattr(a, o_b), -1, t * groups * r, groups * r, name + o_b),
    })


def without_routed_experts(weights):
    """`weights` (V4's or V4.1's) whose layers hold no routed experts (the rank's `ExpertShard` holds its share)."""
    layers = tuple(dataclasses.replace(layer, moe=dataclasses.replace(layer.moe, gate_up=None, down=None))
                   for layer in weights.layers)
    return dataclasses.replace(weights, layers=layers)


def cut(w, dim: int, start: int, length: int, name: str):
    """w[start : start + length] along `dim` (-2: rows, -1: columns), a copy; a block-quantized weight
    keeps its format, cut on its scale grid (ConfigError naming the tensor when the cut falls inside a block)."""
    if not isinstance(w, BlockQuantized):
        return w.narrow(dim, start, length).contiguous()
    block = w.block[dim]
    if start % block or length % block:
        raise ConfigError(f"tensor {name}: a tensor-parallel share of {length} {'rows' if dim == -2 else 'columns'} "
                          f"at {start} does not fall on its {w.block[0]}x{w.block[1]} scale blocks; choose a "
                          "tensor_parallel_size whose shares are whole blocks")
    per_byte = 2 if w.format == "fp4" and dim == -1 else 1
    values = w.values.narrow(dim, start // per_byte, length // per_byte).contiguous()
    return BlockQuantized(values, w.scales.narrow(dim, start // block, length // block).contiguous(), w.block, w.format)
