"""Load a DeepSeek-V4.1 checkpoint directory (one safetensors file, or shards listed by
`model.safetensors.index.json`) into the upstream-named tensors `V41Weights.from_tensors` takes.

- Quantized weights (`<module>.weight` with a `<module>.scale` beside it) are dequantized to the model dtype:
  FP8 e4m3 with one ue8m0 scale per 32x32 block (the block comes from `quantization_config.weight_block_size`,
  V4.1's 32x32 when absent), FP4 e2m1 experts (two per int8 byte) with one scale per 1x32. The Engram tables
  stay FP8 (`BlockQuantized`, 1x32 blocks): the lookup dequantizes only the rows it reads.
- Vision tensors (`vision.*`, `aligner.*`, `image_*`, the routers' `gate.bias_vl`) are skipped with one log line:
  images are not supported yet.
- Draft (DSpark, `mtp.*`) tensors the config declares are loaded; `mtp.N.embed`/`mtp.N.head` (aliases of the
  main embedding and head) are ignored.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deepinfer.config_v41 import V41Config
from deepinfer.errors import WeightsError
from deepinfer.model.v41_weights import TABLE, tensor_specs
from deepinfer.model.weights import FP32
from deepinfer.weights.loader import ShardReader, checkpoint_files
from deepinfer.weights.quant import as_quantized, dequantize, is_quantized

log = logging.getLogger("deepinfer.weights")

FP8_BLOCK_V41 = (32, 32)
TABLE_BLOCK = (1, 32)  # Engram tables: one scale per row and 32 columns
VISION = re.compile(r"^(vision\.|aligner\.|image_(start|end|newline)\b)|\.gate\.bias_vl$")
DRAFT_ALIAS = re.compile(r"^mtp\.\d+\.(embed|head)\.weight$")


@dataclass
class V41Checkpoint:
    tensors: dict[str, torch.Tensor]
    vision: list[str] = field(default_factory=list)  # skipped
    ignored: list[str] = field(default_factory=list)
    quantized: int = 0  # tensors read with a scale


def load_v41(model_dir: str | Path, cfg: V41Config, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu") -> V41Checkpoint:
    """Read every tensor `cfg` needs from `model_dir`; a `WeightsError` names a missing tensor, a wrong shape, a
    quantized tensor without its scale, or a scale that does not fit its weight."""
    model_dir = Path(model_dir)
    files = checkpoint_files(model_dir)
    specs = tensor_specs(cfg)
    bare = {(k[len("model."):] if k.startswith("model.") else k): k for k in files}
    ckpt = V41Checkpoint(tensors={})
    values: dict[str, str] = {}
    scales: dict[str, str] = {}
    for name, key in bare.items():
        if VISION.search(name):
            ckpt.vision.append(key)
        elif name.endswith(".scale") and name[: -len("scale")] + "weight" in bare:
            scales[name[: -len("scale")] + "weight"] = key
        elif name in specs:
            values[name] = key
        else:
            ckpt.ignored.append(key)
    missing = [name for name in specs if name not in values]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise WeightsError(f"{model_dir}: the checkpoint lacks {len(missing)} tensor(s) the V4.1 config requires: "
                           f"{shown}")
    block = tuple((cfg.raw.get("quantization_config") or {}).get("weight_block_size") or FP8_BLOCK_V41)
    read = ShardReader(files)

    for name, spec in specs.items():
        key = values[name]
        tensor = read(key)
        label = f"{name} ({key})" if key != name else name
        if name in scales:
            ckpt.quantized += 1
            if spec.kind == TABLE:
                tensor = as_quantized(label, tensor, read(scales[name]), TABLE_BLOCK)
            else:
                tensor = dequantize(label, tensor, read(scales[name]), dtype, block)
        elif is_quantized(tensor):
            raise WeightsError(f"tensor {label} is quantized ({tensor.dtype}) but the checkpoint has no "
                               f"{name[: -len('weight')]}scale beside it")
        else:
            tensor = tensor.to(torch.float32 if spec.kind == FP32 else dtype)
        if tuple(tensor.shape) != spec.shape:
            raise WeightsError(f"tensor {label} has shape {list(tensor.shape)}, but the V4.1 config requires "
                               f"{list(spec.shape)}")
        ckpt.tensors[name] = tensor.to(device)
    read.close()
    if ckpt.vision:
        log.warning("skipped %d vision tensor(s) (e.g. %s): images are not supported yet; text requests run",
                    len(ckpt.vision), ckpt.vision[0])
    unknown = [k for k in ckpt.ignored if not DRAFT_ALIAS.match(bare_name(k))]
    if unknown:
        log.warning("ignored %d checkpoint tensor(s) the V4.1 model does not use, e.g. %s", len(unknown), unknown[0])
    return ckpt


def bare_name(key: str) -> str:
    return key[len("model."):] if key.startswith("model.") else key
