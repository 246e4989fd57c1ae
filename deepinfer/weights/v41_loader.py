"""Load a DeepSeek-V4.1 checkpoint directory (one safetensors file, or shards listed by
`model.safetensors.index.json`) into the upstream-named tensors `V41Weights.from_tensors` takes.

- Quantized weights (`<module>.weight` with a `<module>.scale` beside it: FP8 e4m3 with one ue8m0 scale per
  block of `quantization_config.weight_block_size`, 32x32 in V4.1; FP4 e2m1 experts, two per int8 byte, one scale
  per 1x32) are dequantized to the model dtype, or with `keep_quantized` (`--quantization auto`) kept as
  `tilekernels.quant.BlockQuantized` (ue8m0 scales as exponent bytes) where the model takes them so
  (`v41_formats.checkpoint_format_v41`): the Engram `wkv` and FP8 routed experts are dequantized anyway. The
  Engram tables always stay FP8 (1x32 blocks): the lookup dequantizes only the rows it reads.
- The main layers' routed experts are stacked while they are read, one layer at a time (`ffn.experts.gate_up_proj`
  [E, 2I, D], `ffn.experts.down_proj` [E, D, I]; V4's `_stack_experts`), and each tensor moves to `device` once
  read: the host never holds a second copy of the experts.
- Vision tensors (`vision.*`, `aligner.*`, `image_*`, the routers' `gate.bias_vl`) are skipped with one log line:
  images are not supported yet.
- Draft (DSpark, `mtp.*`) tensors the config declares are loaded, expert by expert; `mtp.N.embed`/`mtp.N.head`
  (aliases of the main embedding and head) are ignored.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deepinfer.config_v41 import V41Config
from deepinfer.errors import WeightsError
from deepinfer.model.v41_weights import DOWN, GATE_UP, TABLE, V41_CONFIG, tensor_specs
from deepinfer.model.weights import FP32, MODEL, TensorSpec, check_present, check_shape
from deepinfer.weights.loader import ShardReader, _stack_experts, checkpoint_files
from deepinfer.weights.names import Target
from deepinfer.weights.quant import as_quantized, for_kernels, is_quantized, stored_form
from deepinfer.weights.v41_formats import (FP8_BLOCK_V41, TABLE_FORMAT, Format, checkpoint_format_v41,
                                           quantization_config)
from tilekernels.quant import BlockQuantized, is_exponent_bytes

log = logging.getLogger("deepinfer.weights")

TABLE_BLOCK = TABLE_FORMAT[1]  # Engram tables: one scale per row and 32 columns
VISION = re.compile(r"^(vision\.|aligner\.|image_(start|end|newline)\b)|\.gate\.bias_vl$")
DRAFT_ALIAS = re.compile(r"^mtp\.\d+\.(embed|head)\.weight$")
ROUTED = re.compile(r"^(layers\.\d+\.ffn\.)experts\.\d+\.w[123]\.weight$")  # stacked at load (not mtp.*)


@dataclass
class V41Checkpoint:
    tensors: dict[str, torch.Tensor | BlockQuantized]
    vision: list[str] = field(default_factory=list)  # skipped
    ignored: list[str] = field(default_factory=list)
    quantized: int = 0  # tensors read with a scale


def load_v41(model_dir: str | Path, cfg: V41Config, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu", keep_quantized: bool = False) -> V41Checkpoint:
    """Read every tensor `cfg` needs from `model_dir`; a `WeightsError` names a missing tensor, a wrong shape, a
    quantized tensor without its scale, or a scale that does not fit its weight (grid or dtype)."""
    model_dir = Path(model_dir)
    files = checkpoint_files(model_dir)
    specs = tensor_specs(cfg)
    bare = {bare_name(k): k for k in files}
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
    check_present(specs, values, V41_CONFIG, f"{model_dir}: ")
    qc = quantization_config(cfg.raw)
    block = qc["weight_block_size"] if qc else FP8_BLOCK_V41
    read = ShardReader(files)
    try:
        moes: list[str] = []
        for name, spec in specs.items():
            routed = ROUTED.match(name)
            if routed:
                if routed.group(1) not in moes:
                    moes.append(routed.group(1))
                continue
            fmt = checkpoint_format_v41(name, cfg) if keep_quantized else None
            tensor = _one(name, spec, values[name], scales.get(name), read, dtype, block, fmt, ckpt)
            ckpt.tensors[name] = tensor.to(device)
        for prefix in moes:  # one layer's experts on the host at a time
            for stacked, tensor in _experts(prefix, cfg, values, scales, read, dtype, block, keep_quantized,
                                            ckpt).items():
                ckpt.tensors[stacked] = tensor.to(device)
    finally:
        read.close()
    if ckpt.vision:
        log.warning("skipped %d vision tensor(s) (e.g. %s): images are not supported yet; text requests run",
                    len(ckpt.vision), ckpt.vision[0])
    unknown = [k for k in ckpt.ignored if not DRAFT_ALIAS.match(bare_name(k))]
    if unknown:
        log.warning("ignored %d checkpoint tensor(s) the V4.1 model does not use, e.g. %s", len(unknown), unknown[0])
    return ckpt


def _one(name: str, spec: TensorSpec, key: str, scale_key: str | None, read, dtype: torch.dtype,
         block: tuple[int, int], kept: Format | None, ckpt: V41Checkpoint) -> torch.Tensor | BlockQuantized:
    """One tensor: plain (cast), quantized kept (`kept`: the format it may keep) or dequantized; shape checked."""
    tensor = read(key)
    label = f"{name} ({key})" if key != name else name
    target = torch.float32 if spec.kind == FP32 else dtype
    if scale_key is not None:
        ckpt.quantized += 1
        q = as_quantized(label, tensor, read(scale_key), TABLE_BLOCK if spec.kind == TABLE else block)
        if spec.kind == TABLE:
            tensor = q
        elif kept is not None and kept[0] == q.format:
            tensor = kernel_form(label, q)
        else:
            tensor = q.dequantize(target)
    elif is_quantized(tensor):
        raise WeightsError(f"tensor {label} is quantized ({tensor.dtype}) but the checkpoint has no "
                           f"{name[: -len('weight')]}scale beside it")
    else:
        tensor = tensor.to(target)
    check_shape(label, tensor.shape, spec, V41_CONFIG)
    return tensor


def kernel_form(label: str, q: BlockQuantized) -> BlockQuantized:
    """A kept tensor as the kernels read it: FP4 scales checked to be powers of two, ue8m0 scales as uint8
    exponent bytes (the form the kernel plan traces)."""
    q = for_kernels(label, q)
    return q.with_exponent_bytes() if is_exponent_bytes(q.scales) else q


def _experts(prefix: str, cfg: V41Config, values: dict[str, str], scales: dict[str, str], read, dtype: torch.dtype,
             block: tuple[int, int], keep: bool, ckpt: V41Checkpoint) -> dict[str, torch.Tensor | BlockQuantized]:
    """Layer `prefix`'s routed experts stacked while read (V4's `_stack_experts`): FP4 kept with `keep` when the
    config's experts are FP4 and so is the checkpoint's first, else every expert dequantized into the stack."""
    e, inter, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    out = {}
    for stacked, parts, shape in ((prefix + GATE_UP, (("gate", "w1"), ("up", "w3")), (e, 2 * inter, d)),
                                  (prefix + DOWN, (("down", "w2"),), (e, d, inter))):
        sources = []
        for i in range(e):
            for part, w in parts:
                name = f"{prefix}experts.{i}.{w}.weight"
                sources.append((Target("expert", stacked, expert=i, part=part), values[name]))
                if name in scales:
                    sources.append((Target("expert", stacked, scale=True, expert=i, part=part), scales[name]))
        first = f"{prefix}experts.0.{parts[0][1]}.weight"
        fmt = checkpoint_format_v41(first, cfg) if keep else None
        kept = fmt is not None and first in scales and stored_form(read(values[first])) == fmt[0]
        tensor = _stack_experts(stacked, TensorSpec(shape, MODEL), sources, read, dtype, block, ckpt, kept)
        out[stacked] = kernel_form(stacked, tensor) if isinstance(tensor, BlockQuantized) else tensor
    return out


def bare_name(key: str) -> str:
    return key[len("model."):] if key.startswith("model.") else key
