"""Load a DeepSeek-V4 checkpoint directory (one safetensors file, or shards listed by
`model.safetensors.index.json`) into canonical-name tensors of the requested dtype.

FP8/FP4 tensors are dequantized; per-expert tensors are stacked; `mtp.*` tensors (the MTP draft layers) are
not loaded but recorded with their locations, for speculative decoding later.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from deepinfer.config import ModelConfig
from deepinfer.errors import WeightsError
from deepinfer.model.weights import FP32, INT, TensorSpec, tensor_specs
from deepinfer.weights.names import Target, classify
from deepinfer.weights.quant import FP8_BLOCK, dequantize, is_quantized

log = logging.getLogger("deepinfer.weights")

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass
class Checkpoint:
    """The canonical tensors of a model, and what else the checkpoint held."""

    tensors: dict[str, torch.Tensor]
    mtp: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (file, key), not loaded
    ignored: list[str] = field(default_factory=list)
    quantized: int = 0


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Map every tensor key of the checkpoint to its file, checking that every shard exists, lies inside the
    model directory and is a readable safetensors file."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError(f"'weight_map' is a {type(weight_map).__name__}")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise WeightsError(f"{index} is not a valid safetensors index (needs a 'weight_map' object of tensor "
                               f"name -> shard file): {exc}") from None
        root = model_dir.resolve()
        paths: dict[str, Path] = {}
        missing: dict[str, str] = {}
        for key, fname in weight_map.items():
            if not isinstance(fname, str) or not fname:
                raise WeightsError(f"{index}: tensor {key!r} maps to {fname!r}; expected a shard file name")
            path = model_dir / fname
            if not path.resolve().is_relative_to(root):
                raise WeightsError(f"{index}: shard {fname!r} (of tensor {key!r}) lies outside the model directory "
                                   f"{model_dir}; shards must be files inside it")
            if not path.is_file():
                missing.setdefault(fname, key)
            paths[key] = path
        if missing:
            fname, key = next(iter(missing.items()))
            raise WeightsError(
                f"shard {fname!r} listed in {INDEX_FILE} is missing from {model_dir} (it holds e.g. {key}); "
                f"{len(missing)} shard file(s) missing in all"
            )
        files: dict[str, Path] = {}
        for path in sorted(set(paths.values())):
            held = set(_keys(path))
            for key in (k for k, p in paths.items() if p == path):
                if key not in held:
                    raise WeightsError(f"{path} does not hold tensor {key!r}, which {INDEX_FILE} places there")
                files[key] = path
        return files
    single = model_dir / SINGLE_FILE
    shards = [single] if single.is_file() else sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise WeightsError(f"{model_dir} holds no {SINGLE_FILE}, no {INDEX_FILE} and no *.safetensors file")
    files = {}
    for path in shards:
        for key in _keys(path):
            files[key] = path
    return files


def _keys(path: Path) -> list[str]:
    """The tensor names of a safetensors file, after checking that its header is whole and its data covers
    every tensor (a truncated or zero-byte file is named here, before anything is loaded)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{size} bytes, shorter than the 8-byte header length")
            n = int.from_bytes(head, "little")
            if n > size - 8:
                raise ValueError(f"header of {n} bytes, but the file has {size} bytes")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + n + end > size:
            raise ValueError(f"truncated: its tensors need {8 + n + end} bytes, the file has {size}")
    except OSError as exc:
        raise WeightsError(f"checkpoint file {path} cannot be read: {exc.strerror or exc}") from None
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise WeightsError(f"checkpoint file {path} is not a valid safetensors file ({exc})") from None
    return [k for k in header if k != "__metadata__"]


def load_checkpoint(
    model_dir: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    progress: Callable[[int], object] | None = None,
) -> Checkpoint:
    """Read every tensor `cfg` needs from `model_dir`, dequantized and cast (fp32 for norms/mHC/sinks/biases)."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    files = checkpoint_files(model_dir)
    specs = tensor_specs(cfg)
    names = set(files)
    plan: dict[str, list[tuple[Target, str]]] = {}
    ckpt = Checkpoint(tensors={})
    for key in files:
        target = classify(key, names)
        if target.kind == "mtp":
            ckpt.mtp[key] = (str(files[key]), key)
        elif target.name in specs:
            plan.setdefault(target.name, []).append((target, key))
        else:
            ckpt.ignored.append(key)
    if cfg.raw.get("tie_word_embeddings") and "lm_head.weight" not in plan and "embed_tokens.weight" in plan:
        plan["lm_head.weight"] = plan["embed_tokens.weight"]
    missing = [name for name in specs if name not in plan]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise WeightsError(f"{model_dir}: the checkpoint lacks {len(missing)} tensor(s) the config requires: {shown}")

    block = tuple((cfg.raw.get("quantization_config") or {}).get("weight_block_size") or FP8_BLOCK)
    handles: dict[Path, object] = {}

    def read(key: str) -> torch.Tensor:
        path = files[key]
        try:
            if path not in handles:
                handles[path] = safe_open(str(path), framework="pt", device="cpu")
            return handles[path].get_tensor(key)
        except Exception as exc:  # safetensors' own error types: a damaged file, an unknown dtype
            raise WeightsError(f"tensor {key!r} of {path} cannot be read: {exc}") from None

    for name, sources in plan.items():
        spec = specs[name]
        target_dtype = torch.float32 if spec.kind == FP32 else torch.int64 if spec.kind == INT else dtype
        if sources[0][0].kind == "expert":
            tensor = _stack_experts(name, spec, sources, read, target_dtype, block, ckpt)
        else:
            tensor = _one(name, sources, read, target_dtype, block, ckpt)
        if tuple(tensor.shape) != spec.shape:
            raise WeightsError(
                f"tensor {name} ({sources[0][1]}) has shape {list(tensor.shape)}, but the config requires "
                f"{list(spec.shape)}"
            )
        ckpt.tensors[name] = tensor.to(device)
        if progress is not None:
            progress(1)
    handles.clear()
    if ckpt.ignored:
        log.warning("ignored %d checkpoint tensor(s) the model does not use, e.g. %s", len(ckpt.ignored), ckpt.ignored[0])
    return ckpt


def _one(name, sources, read, dtype, block, ckpt) -> torch.Tensor:
    values = [key for target, key in sources if not target.scale]
    scales = [key for target, key in sources if target.scale]
    if len(values) != 1:
        raise WeightsError(f"tensor {name} appears {len(values)} times in the checkpoint: {values}")
    tensor = read(values[0])
    if scales:
        ckpt.quantized += 1
        return dequantize(name, tensor, read(scales[0]), dtype, block)
    if is_quantized(tensor) and dtype != torch.int64:
        raise WeightsError(f"tensor {name} ({values[0]}) is quantized ({tensor.dtype}) but has no scale tensor")
    return tensor.to(dtype)


def _stack_experts(name, spec: TensorSpec, sources, read, dtype, block, ckpt) -> torch.Tensor:
    n_experts, rows, _ = spec.shape
    parts: dict[tuple[int, str], dict[str, str]] = {}
    for target, key in sources:
        parts.setdefault((target.expert, target.part), {})["scale" if target.scale else "value"] = key
    out = None
    for (expert, part), keys in sorted(parts.items()):
        if not 0 <= expert < n_experts:
            raise WeightsError(f"{keys.get('value')}: expert index {expert} is outside [0, {n_experts - 1}]")
        if "value" not in keys:
            raise WeightsError(f"expert {expert} of {name} has a scale but no weight ({keys['scale']})")
        tensor = read(keys["value"])
        if "scale" in keys:
            ckpt.quantized += 1
            tensor = dequantize(keys["value"], tensor, read(keys["scale"]), dtype, block)
        elif is_quantized(tensor):
            raise WeightsError(f"tensor {keys['value']} is quantized ({tensor.dtype}) but has no scale tensor")
        if out is None:
            out = torch.empty(spec.shape, dtype=dtype)
        half = rows // 2
        dest = {"gate": out[expert, :half], "up": out[expert, half:], "down": out[expert]}[part]
        if tuple(tensor.shape) != tuple(dest.shape):
            raise WeightsError(
                f"tensor {keys['value']} has shape {list(tensor.shape)}, but expert {part} weights of this config "
                f"are {list(dest.shape)}"
            )
        dest.copy_(tensor)
    needed = {(e, p) for e in range(n_experts) for p in (("down",) if name.endswith("down_proj") else ("gate", "up"))}
    lacking = sorted(needed - set(parts))
    if lacking:
        raise WeightsError(f"the checkpoint lacks {len(lacking)} expert weight(s) of {name}, e.g. expert {lacking[0]}")
    return out
