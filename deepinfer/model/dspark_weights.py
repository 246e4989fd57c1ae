"""The tensors of DSpark block drafting (`config_dspark.DSparkConfig`): canonical names and shapes, and the typed
container the drafter reads (`model/dspark.py`).

Under `mtp.{j}.*` (j < num_nextn_predict_layers): each a sliding-window V4 block with top-k MoE over the
DSpark experts; `mtp.0.main_proj` / `mtp.0.main_norm` (the target's tapped streams -> the blocks' context);
on the last block its HyperHead and final norm, the Markov head (`markov_head.embed` V x rank, `markov_head.head`
rank -> V) and the confidence head (`confidence_head.proj`, [1, H + rank]). Embedding and LM head: the target's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from deepinfer.config import SLIDING, TOPK_MOE, ModelConfig
from deepinfer.model.weights import FP32, MODEL, HyperConnection, Layer, TensorSpec, block_specs, layer_weights


def dspark_tensor_specs(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Every DSpark tensor of the config by canonical name (none without `cfg.dspark`)."""
    ds = cfg.dspark
    if ds is None:
        return {}
    h, n, last = cfg.hidden_size, cfg.hc_mult, f"mtp.{cfg.num_nextn_predict_layers - 1}."
    specs: dict[str, TensorSpec] = {}
    for j in range(cfg.num_nextn_predict_layers):
        specs.update(block_specs(cfg, f"mtp.{j}.", SLIDING, TOPK_MOE, experts=ds.n_routed_experts))
    specs["mtp.0.main_proj.weight"] = TensorSpec((h, h * len(ds.target_layer_ids)), MODEL)
    specs["mtp.0.main_norm.weight"] = TensorSpec((h,), FP32)
    specs[last + "norm.weight"] = TensorSpec((h,), FP32)
    specs[last + "hc_head.hc_fn"] = TensorSpec((n, n * h), FP32)
    specs[last + "hc_head.hc_base"] = TensorSpec((n,), FP32)
    specs[last + "hc_head.hc_scale"] = TensorSpec((1,), FP32)
    specs[last + "markov_head.embed.weight"] = TensorSpec((cfg.vocab_size, ds.markov_rank), MODEL)
    specs[last + "markov_head.head.weight"] = TensorSpec((cfg.vocab_size, ds.markov_rank), MODEL)
    specs[last + "confidence_head.proj.weight"] = TensorSpec((1, h + ds.markov_rank), MODEL)
    return specs


@dataclass(frozen=True)
class DSparkWeights:
    blocks: tuple[Layer, ...]  # the draft blocks, in order
    main_proj: torch.Tensor  # [H, taps * H]
    main_norm: torch.Tensor  # [H] fp32
    norm: torch.Tensor  # [H] fp32, the last block's final norm
    hc_head: HyperConnection  # the last block's HyperHead collapse
    markov_embed: torch.Tensor  # [V, rank]
    markov_head: torch.Tensor  # [V, rank]
    confidence: torch.Tensor  # [1, H + rank]

    @classmethod
    def from_tensors(cls, cfg: ModelConfig, t: Mapping[str, torch.Tensor], dtype: torch.dtype) -> DSparkWeights:
        """Pack a canonical-name map holding every tensor of `dspark_tensor_specs(cfg)`."""
        last = f"mtp.{cfg.num_nextn_predict_layers - 1}."
        return cls(
            blocks=tuple(layer_weights(t, f"mtp.{j}.", SLIDING, dtype) for j in range(cfg.num_nextn_predict_layers)),
            main_proj=t["mtp.0.main_proj.weight"],
            main_norm=t["mtp.0.main_norm.weight"],
            norm=t[last + "norm.weight"],
            hc_head=HyperConnection(t[last + "hc_head.hc_fn"], t[last + "hc_head.hc_base"], t[last + "hc_head.hc_scale"]),
            markov_embed=t[last + "markov_head.embed.weight"],
            markov_head=t[last + "markov_head.head.weight"],
            confidence=t[last + "confidence_head.proj.weight"],
        )
