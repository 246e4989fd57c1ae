"""Load a DeepSeek-V4 checkpoint directory (one safetensors file, or shards listed by
`model.safetensors.index.json`) into canonical-name tensors of the requested dtype.

FP8/FP4 tensors are dequantized (or kept); per-expert tensors are stacked; the MTP draft layers' tensors
(`mtp.N.*`) are loaded as the target's are, all of them or none (`load_mtp=False`: none, not read).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from deepinfer.config import ModelConfig
from deepinfer.errors import WeightsError
from deepinfer.model.weights import (FP32, INT, MODEL, TensorSpec, check_mtp, check_present, check_shape,
                                     mtp_tensor_specs, tensor_specs)
from deepinfer.weights.names import Target, classify, is_mtp
from deepinfer.weights.quant import FP8_BLOCK, as_quantized, dequantize, for_kernels, is_quantized
from tilekernels.quant import BlockQuantized, grid

log = logging.getLogger("deepinfer.weights")

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass
class Checkpoint:
    """The canonical tensors of a model, and what else the checkpoint held."""

    tensors: dict[str, torch.Tensor]
    ignored: list[str] = field(default_factory=list)
    quantized: int = 0
    mtp_layers: int = 0  # the MTP draft layers loaded (their tensors are in `tensors`, `mtp.{j}.*`)
    mtp_skipped: int = 0  # the checkpoint's `mtp.*` tensors not read (`load_mtp=False`)


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
        paths: dict[str, Path] = {}
        missing: dict[str, str] = {}
        for key, fname in weight_map.items():
            if not isinstance(fname, str) or not fname:
                raise WeightsError(f"{index}: tensor {key!r} maps to {fname!r}; expected a shard file name")
            path = model_dir / fname
            if Path(fname).is_absolute() or ".." in Path(fname).parts:  # by name: shards may be symlinks (HF cache)
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
    return list(read_header(path))


def read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each tensor of a safetensors file: (dtype, shape), after checking that its header is whole and its data
    covers every tensor (a truncated or zero-byte file is named here, before anything is loaded)."""
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
    return {k: (str(v["dtype"]), tuple(int(d) for d in v["shape"])) for k, v in header.items() if k != "__metadata__"}


_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
          "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}


def weight_bytes(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, keep_quantized: bool,
                 share: Callable[[str], float] | None = None, load_mtp: bool = True) -> int:
    """The bytes the model's weights will take once loaded (quantized ones in their own precision with
    `keep_quantized`, else at `dtype`), from the checkpoint's headers alone: nothing is read or allocated.
    `share(name)`: the fraction of each canonical tensor a rank keeps (default all); `load_mtp`: the MTP draft
    layers' tensors the checkpoint holds count too."""
    model_dir = Path(model_dir)
    files = checkpoint_files(model_dir)
    header: dict[str, tuple[str, tuple[int, ...]]] = {}
    for path in sorted(set(files.values())):
        header.update(read_header(path))
    specs, names = {**tensor_specs(cfg), **(mtp_tensor_specs(cfg) if load_mtp else {})}, set(files)
    targets = {key: classify(key, names) for key in files}
    scaled = {(t.name, t.expert, t.part) for t in targets.values() if t.scale}
    size = {MODEL: torch.empty((), dtype=dtype).element_size(), FP32: 4, INT: 8}
    total = 0
    for key, t in targets.items():
        if t.name not in specs:
            continue
        kind, (stored, shape) = specs[t.name].kind, header[key]
        numel = math.prod(shape) * (1.0 if share is None else share(t.name))
        if t.scale:
            total += numel * _BYTES.get(stored, 4) if keep_quantized else 0
        elif (t.name, t.expert, t.part) in scaled:
            packed = 2 if stored in ("I8", "U8") else 1  # FP4: two values per byte
            total += numel * _BYTES.get(stored, 1) if keep_quantized else numel * packed * size[kind]
        else:
            total += numel * size[kind]
    total = int(total)
    if cfg.raw.get("tie_word_embeddings") and not any(t.name == "lm_head.weight" for t in targets.values()):
        total += math.prod(specs["lm_head.weight"].shape) * size[MODEL]
    return total


def load_checkpoint(
    model_dir: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    progress: Callable[[int], object] | None = None,
    keep_quantized: bool = False,
    experts_of: Callable[[str], list[int]] | None = None,
    load_mtp: bool = True,
) -> Checkpoint:
    """Read every tensor `cfg` needs from `model_dir`, cast (fp32 for norms/mHC/sinks/biases); FP8 / FP4 tensors
    are dequantized to `dtype`, or with `keep_quantized` kept in their own precision (`BlockQuantized`).
    `experts_of(name)`: the routed experts of the target's stacked tensor `name` (`layers.N.mlp.experts.*`) to
    read, in that order (one rank's share; the checkpoint must still hold every expert); default all.
    `load_mtp`: the MTP draft layers' tensors are read too when the checkpoint holds them (every one of
    `mtp_tensor_specs(cfg)`, or a `WeightsError` names the missing ones); else they are skipped, not read."""
    model_dir = Path(model_dir)
    files = checkpoint_files(model_dir)
    mtp_specs = mtp_tensor_specs(cfg) if load_mtp else {}
    specs = {**tensor_specs(cfg), **mtp_specs}
    names = set(files)
    plan: dict[str, list[tuple[Target, str]]] = {}
    ckpt = Checkpoint(tensors={})
    for key in files:
        target = classify(key, names)
        if target.name in specs:
            plan.setdefault(target.name, []).append((target, key))
        elif not load_mtp and is_mtp(key):
            ckpt.mtp_skipped += 1
        else:
            ckpt.ignored.append(key)
    if cfg.raw.get("tie_word_embeddings") and "lm_head.weight" not in plan and "embed_tokens.weight" in plan:
        plan["lm_head.weight"] = plan["embed_tokens.weight"]
    check_present(tensor_specs(cfg), plan, where=f"{model_dir}: ")
    if check_mtp(cfg, plan.keys(), where=f"{model_dir}: "):
        ckpt.mtp_layers = cfg.num_nextn_predict_layers

    block = tuple((cfg.raw.get("quantization_config") or {}).get("weight_block_size") or FP8_BLOCK)
    read = ShardReader(files)

    for name, sources in plan.items():
        spec = specs[name]
        target_dtype = torch.float32 if spec.kind == FP32 else torch.int64 if spec.kind == INT else dtype
        chosen = (None if experts_of is None or ".mlp.experts." not in name or not name.startswith("layers.")
                  else list(experts_of(name)))
        if sources[0][0].kind == "expert":
            tensor = _stack_experts(name, spec, sources, read, target_dtype, block, ckpt, keep_quantized,
                                    list(range(spec.shape[0])) if chosen is None else chosen)
        else:
            tensor = _one(name, sources, read, target_dtype, block, ckpt, keep_quantized)
        check_shape(f"{name} ({sources[0][1]})", tensor.shape, spec if chosen is None or sources[0][0].kind != "expert"
                    else TensorSpec((len(chosen), *spec.shape[1:]), spec.kind))
        if chosen is not None and sources[0][0].kind != "expert":  # stored stacked: read whole, keep the chosen
            tensor = tensor[torch.tensor(chosen)]  # plain or block-quantized: those experts, copied
        ckpt.tensors[name] = tensor.to(device)
        if progress is not None:
            progress(1)
    read.close()
    if ckpt.ignored:
        log.warning("ignored %d checkpoint tensor(s) the model does not use, e.g. %s", len(ckpt.ignored), ckpt.ignored[0])
    if ckpt.mtp_skipped:
        log.info("skipped %d mtp.* checkpoint tensor(s) (the MTP draft layers; load_mtp=False)", ckpt.mtp_skipped)
    return ckpt


def _one(name, sources, read, dtype, block, ckpt, keep=False) -> torch.Tensor | BlockQuantized:
    values = [key for target, key in sources if not target.scale]
    scales = [key for target, key in sources if target.scale]
    if len(values) != 1:
        raise WeightsError(f"tensor {name} appears {len(values)} times in the checkpoint: {values}")
    tensor = read(values[0])
    if scales:
        ckpt.quantized += 1
        if keep:
            return for_kernels(values[0], as_quantized(f"{name} ({values[0]})", tensor, read(scales[0]), block))
        return dequantize(f"{name} ({values[0]})", tensor, read(scales[0]), dtype, block)
    if is_quantized(tensor) and dtype != torch.int64:
        raise WeightsError(f"tensor {name} ({values[0]}) is quantized ({tensor.dtype}) but has no scale tensor")
    return tensor.to(dtype)


def _stack_experts(name, spec: TensorSpec, sources, read, dtype, block, ckpt, keep,
                   chosen: list[int]) -> torch.Tensor | BlockQuantized:
    """Experts `chosen` of `name`, stacked in that order."""
    n_experts, rows, _ = spec.shape
    parts: dict[tuple[int, str], dict[str, str]] = {}
    for target, key in sources:
        parts.setdefault((target.expert, target.part), {})["scale" if target.scale else "value"] = key
    for (expert, part), keys in parts.items():
        if not 0 <= expert < n_experts:
            raise WeightsError(f"{keys.get('value')}: expert index {expert} is outside [0, {n_experts - 1}]")
        if "value" not in keys:
            raise WeightsError(f"expert {expert} of {name} has a scale but no weight ({keys['scale']})")
    needed = {(e, p) for e in range(n_experts) for p in (("down",) if name.endswith("down_proj") else ("gate", "up"))}
    lacking = sorted(needed - set(parts))
    if lacking:
        raise WeightsError(f"the checkpoint lacks {len(lacking)} expert weight(s) of {name}, e.g. expert {lacking[0]}")
    half = rows // 2
    expect = {"gate": (half, spec.shape[2]), "up": (half, spec.shape[2]), "down": tuple(spec.shape[1:])}
    parts = {(e, p): parts[(e, p)] for e in chosen for p in (("down",) if name.endswith("down_proj") else ("gate", "up"))}
    if keep and all("scale" in keys for keys in parts.values()):
        stacked = _stack_quantized(name, parts, read, block, ckpt, expect, chosen)
        if stacked is not None:
            return stacked
    out = torch.empty((len(chosen), *spec.shape[1:]), dtype=dtype)
    slot = {e: i for i, e in enumerate(chosen)}
    for (expert, part), keys in parts.items():
        tensor = read(keys["value"])
        if "scale" in keys:
            ckpt.quantized += 1
            tensor = dequantize(keys["value"], tensor, read(keys["scale"]), dtype, block)
        elif is_quantized(tensor):
            raise WeightsError(f"tensor {keys['value']} is quantized ({tensor.dtype}) but has no scale tensor")
        i = slot[expert]
        dest = {"gate": out[i, :half], "up": out[i, half:], "down": out[i]}[part]
        if tuple(tensor.shape) != tuple(dest.shape):
            raise WeightsError(
                f"tensor {keys['value']} has shape {list(tensor.shape)}, but expert {part} weights of this config "
                f"are {list(dest.shape)}"
            )
        dest.copy_(tensor)
    return out


def _stack_quantized(name, parts, read, block, ckpt, expect, experts: list[int]) -> BlockQuantized | None:
    """Every expert's part kept quantized and stacked [E, rows, ...] (gate over up), each part written straight
    into the stacked values and scales as it is read (no second copy of the experts); None when the parts differ
    in format, block or dtypes, or gate and up cannot be joined on a block boundary (then they are dequantized)."""
    order = ("down",) if name.endswith("down_proj") else ("gate", "up")
    first = values = scales = None
    for i, expert in enumerate(experts):
        row = scale_row = 0
        for part in order:
            keys = parts[(expert, part)]
            q = for_kernels(keys["value"], as_quantized(keys["value"], read(keys["value"]), read(keys["scale"]), block))
            if tuple(q.shape) != expect[part]:
                raise WeightsError(f"tensor {keys['value']} has shape {list(q.shape)}, but expert {part} weights of "
                                   f"this config are {list(expect[part])}")
            if first is None:
                first = q
                if len(order) > 1 and expect["gate"][0] % q.block[0]:
                    return None
                rows = sum(expect[p][0] for p in order)
                values = torch.empty((len(experts), rows, q.values.shape[-1]), dtype=q.values.dtype)
                scales = torch.empty((len(experts), sum(grid(*expect[p], q.block)[0] for p in order),
                                      q.scales.shape[-1]), dtype=q.scales.dtype)
            elif (q.format, q.block, q.values.dtype, q.scales.dtype) != (first.format, first.block, first.values.dtype,
                                                                         first.scales.dtype):
                return None
            values[i, row: row + q.values.shape[0]] = q.values
            scales[i, scale_row: scale_row + q.scales.shape[0]] = q.scales
            row, scale_row = row + q.values.shape[0], scale_row + q.scales.shape[0]
    ckpt.quantized += len(experts) * len(order)
    return BlockQuantized(values, scales, first.block, first.format)


class ShardReader:
    """reader(key) -> the checkpoint tensor `key` from its shard in `files` (each shard opened once, kept open
    until `close`); a damaged file or an unknown dtype is a WeightsError naming the tensor and the file."""

    def __init__(self, files: dict[str, Path]):
        self.files, self.handles = files, {}

    def __call__(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor, or with `rows` (first, count) only those rows of it (the rest is never read)."""
        if rows is None:
            return self._read(key, lambda f: f.get_tensor(key))
        return self._read(key, lambda f: f.get_slice(key)[rows[0]:rows[0] + rows[1]])

    def shape(self, key: str) -> list[int]:
        """The stored shape of tensor `key`, without reading it."""
        return self._read(key, lambda f: list(f.get_slice(key).get_shape()))

    def _read(self, key: str, how):
        from safetensors import safe_open

        path = self.files[key]
        try:
            if path not in self.handles:
                self.handles[path] = safe_open(str(path), framework="pt", device="cpu")
            return how(self.handles[path])
        except Exception as exc:  # safetensors' own error types: a damaged file, an unknown dtype
            raise WeightsError(f"tensor {key!r} of {path} cannot be read: {exc}") from None

    def close(self) -> None:
        self.handles.clear()
