"""Synthetic quantized DeepSeek-V4 checkpoints, in the layouts the loader reads: the attention projections and
shared experts in FP8 e4m3 with one ue8m0 scale per block (the config's `weight_block_size`), the routed
experts in FP4 e2m1 packed two per byte with one ue8m0 scale per 1x32 block; embeddings, the LM head, the
router, norms and mHC tensors as they are.

Two spellings: "hf" (HF in-memory names, `model.layers.N.self_attn.q_a_proj.weight` with
`..._scale_inv`, stacked experts `mlp.experts.gate_up_proj` / `down_proj`) and "upstream" (DeepSeek's own,
`layers.N.attn.wq_a.weight` with `.scale`, per-expert `ffn.experts.E.w1/w2/w3.weight`; the tensors that are not
quantized keep HF in-memory names, which the loader also reads). Used for CI (tiny models written to disk)
and for benchmarks (the V4-Flash slice). The MTP draft layers' tensors (`mtp.N.*`, when the map holds them) are
written alike: their blocks as the target layers', `e_proj` / `h_proj` in FP8 too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from deepinfer.config import ModelConfig
from deepinfer.weights.quant import EXPERTS, FP8_WEIGHTS
from tilekernels.quant import BlockQuantized, quantize

_UPSTREAM = {"q_a_proj": "attn.wq_a", "q_b_proj": "attn.wq_b", "kv_proj": "attn.wkv", "o_a_proj": "attn.wo_a",
             "o_b_proj": "attn.wo_b", "gate_proj": "ffn.shared_experts.w1", "up_proj": "ffn.shared_experts.w3",
             "down_proj": "ffn.shared_experts.w2"}


def _ue8m0(scales: torch.Tensor) -> torch.Tensor:
    return scales.to(torch.float8_e8m0fnu)


def quantized_tensors(cfg: ModelConfig, tensors: Mapping[str, torch.Tensor], spelling: str = "hf",
                      block: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """Canonical-name tensors (as `deepinfer.tiny.random_tensors` makes) -> checkpoint tensors, quantized."""
    if spelling not in ("hf", "upstream"):
        raise ValueError(f"spelling {spelling!r} is not one of 'hf', 'upstream'")
    qc = cfg.raw.get("quantization_config") or {}
    block = tuple(block or qc.get("weight_block_size") or (128, 128))
    out: dict[str, torch.Tensor] = {}

    def put(name: str, q: BlockQuantized, upstream: str) -> None:
        values = q.values if q.format == "fp8" else q.values.view(torch.int8)
        if spelling == "hf":
            out["model." + name] = values
            out["model." + name + "_scale_inv"] = _ue8m0(q.scales)
        else:
            out[upstream + ".weight"] = values
            out[upstream + ".scale"] = _ue8m0(q.scales)

    for name, tensor in tensors.items():
        m = FP8_WEIGHTS.search(name)
        e = EXPERTS.match(name)
        if m:
            layer = name.split(".mlp.")[0].split(".self_attn.")[0]
            upstream = name.removesuffix(".weight") if m.group(3) else f"{layer}.{_UPSTREAM[m.group(1) or m.group(2)]}"
            put(name, quantize(tensor, "fp8", block), upstream)
        elif e and spelling == "hf":
            put(name, quantize(tensor, "fp4"), "")
        elif e:  # upstream: one tensor per expert and part (gate w1 over up w3, down w2)
            layer, kind = e.group(1), e.group(2)
            for expert in range(tensor.shape[0]):
                rows = tensor.shape[1] // 2
                parts = {"w2": tensor[expert]} if kind == "down_proj" else {"w1": tensor[expert, :rows],
                                                                            "w3": tensor[expert, rows:]}
                for part, w in parts.items():
                    q = quantize(w, "fp4")
                    out[f"{layer}.ffn.experts.{expert}.{part}.weight"] = q.values.view(torch.int8)
                    out[f"{layer}.ffn.experts.{expert}.{part}.scale"] = _ue8m0(q.scales)
        else:
            out["model." + name] = tensor
    return out


def write_checkpoint(path: str | Path, raw_config: dict[str, Any], tensors: Mapping[str, torch.Tensor],
                     spelling: str = "hf", block: tuple[int, int] = (128, 128)) -> Path:
    """A model directory (config.json with its `quantization_config`, model.safetensors) of `tensors`
    (canonical names) quantized as above."""
    import json

    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    raw = dict(raw_config)
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                  "weight_block_size": list(block), "expert_dtype": "fp4"}
    cfg = ModelConfig.from_dict(raw)
    (path / "config.json").write_text(json.dumps(raw, indent=1))
    save_file({k: v.contiguous() for k, v in quantized_tensors(cfg, tensors, spelling, block).items()},
              str(path / "model.safetensors"))
    return path


def native_bytes(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16,
                 block: tuple[int, int] = (128, 128)) -> dict[str, int]:
    """The bytes of `cfg`'s weights in the layout above (FP8 + ue8m0 block scales, FP4 experts + 1x32 ue8m0
    scales, the rest at `dtype` / fp32), by class, computed from the shapes alone."""
    import math

    from deepinfer.model.weights import FP32, INT, tensor_specs
    from tilekernels.quant import FP4_BLOCK, grid

    size = torch.empty((), dtype=dtype).element_size()
    out = {"fp8 dense": 0, "fp4 experts": 0, f"{str(dtype).removeprefix('torch.')}": 0, "fp32 / int": 0}
    for name, spec in tensor_specs(cfg).items():
        *lead, rows, cols = spec.shape if len(spec.shape) > 1 else (1, spec.shape[0])
        if FP8_WEIGHTS.search(name):
            out["fp8 dense"] += rows * cols + math.prod(grid(rows, cols, block))
        elif EXPERTS.match(name):
            out["fp4 experts"] += math.prod(lead) * (rows * cols // 2 + math.prod(grid(rows, cols, FP4_BLOCK)))
        elif spec.kind in (FP32, INT):
            out["fp32 / int"] += math.prod(spec.shape) * (4 if spec.kind == FP32 else 8)
        else:
            out[f"{str(dtype).removeprefix('torch.')}"] += math.prod(spec.shape) * size
    return out


V4_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128],
                   "expert_dtype": "fp4"}


def with_quantization(cfg: ModelConfig, quantization_config: Mapping[str, Any] = V4_QUANTIZATION) -> ModelConfig:
    """`cfg` declaring the checkpoint quantization `quantization_config` (what a quantized checkpoint's config.json
    says), so that the loader, the plan and the model keep those tensors quantized."""
    return ModelConfig.from_dict({**cfg.raw, "quantization_config": dict(quantization_config)})


def random_quantized(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.bfloat16, device: str = "cuda",
                     quantization_config: Mapping[str, Any] = V4_QUANTIZATION) -> tuple[ModelConfig, dict]:
    """(`cfg` with the quantization, its random weights quantized): `tiny.random_tensors`' values, each tensor
    quantized as it is generated on `device` (the benchmarks' V4-Flash slice: its 68 GB of bf16 never whole on an
    80 GB GPU)."""
    from deepinfer.tiny import iter_random_tensors

    tensors = quantize_in_memory(iter_random_tensors(cfg, seed, dtype, device), quantization_config)
    return with_quantization(cfg, quantization_config), tensors


def quantize_in_memory(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                       quantization_config: Mapping[str, Any]) -> dict:
    """Canonical-name tensors (a mapping, or (name, tensor) pairs as `tiny.iter_random_tensors` makes them) -> the
    same with the checkpoint's quantized ones as `BlockQuantized` (ue8m0 scales as exponent bytes), exactly what
    the loader keeps with `--quantization auto`, made on the tensors' own device (benchmarks generate the V4-Flash
    slice on the GPU this way). Each tensor is quantized as it comes: given pairs, no more than one tensor is ever
    held in full precision (the slice's 68 GB of bf16 would not fit next to its scratch on an 80 GB GPU)."""
    from deepinfer.weights.quant import checkpoint_format

    out = {}
    for name, tensor in (tensors.items() if isinstance(tensors, Mapping) else tensors):
        fmt = checkpoint_format(name, quantization_config)
        if fmt is None:
            out[name] = tensor
            continue
        form, block, ue8m0 = fmt
        q = quantize(tensor, form, block, pow2_scales=ue8m0)
        del tensor
        out[name] = q.with_exponent_bytes() if ue8m0 else q
    return out
