"""Load a DeepSeek-V4.1 checkpoint directory (one safetensors file, or shards listed by
`model.safetensors.index.json`) into the upstream-named tensors `V41Weights.from_tensors` takes.

- Quantized weights (`<module>.weight` with a `<module>.scale` beside it: FP8 e4m3 with one ue8m0 scale per
  block of `quantization_config.weight_block_size`, 32x32 in V4.1; FP4 e2m1 experts, two per int8 byte, one scale
  per 1x32) are dequantized to the model dtype, or with `keep_quantized` (`--quantization auto`) kept as
  `tilekernels.quant.BlockQuantized` (ue8m0 scales as exponent bytes) where the model takes them so
  (`v41_formats.checkpoint_format_v41`): the Engram `wkv` and FP8 routed experts are dequantized anyway. The
  Engram tables always stay FP8 (1x32 blocks): the lookup dequantizes only the rows it reads.
- Every checkpoint tensor is read once. The main layers' routed experts are stacked while they are read, one
  stack at a time (`ffn.experts.gate_up_proj` [E, 2I, D], `ffn.experts.down_proj` [E, D, I]; as V4's
  `_stack_experts`), and each tensor moves to `device` once read or stacked: the host never holds a second copy
  of the experts.
- `progress(1)` once per tensor of `tensor_specs(cfg)` (a routed expert's as it joins its stack), as V4's
  `load_checkpoint` calls it once per tensor: a bar of `len(tensor_specs(cfg))` steps.
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
from typing import Callable, Iterator

import torch

from deepinfer.config_v41 import V41Config
from deepinfer.errors import WeightsError
from deepinfer.model.v41_weights import DOWN, GATE_UP, TABLE, V41_CONFIG, tensor_specs
from deepinfer.model.weights import FP32, TensorSpec, check_present, check_shape
from deepinfer.weights.loader import ShardReader, checkpoint_files
from deepinfer.weights.quant import as_quantized, for_kernels, is_quantized
from deepinfer.weights.v41_formats import (FP8_BLOCK_V41, TABLE_FORMAT, Format, checkpoint_format_v41,
                                           quantization_config)
from tilekernels.quant import BlockQuantized, grid, is_exponent_bytes

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
             device: torch.device | str = "cpu", keep_quantized: bool = False,
             progress: Callable[[int], object] | None = None,
             experts_of: Callable[[str], list[int]] | None = None,
             table_rows: Callable[[int], tuple[int, int]] | None = None) -> V41Checkpoint:
    """Read every tensor `cfg` needs from `model_dir`, each checkpoint tensor once; a `WeightsError` names a
    missing tensor, a wrong shape, a quantized tensor without its scale, or a scale that does not fit its weight
    (grid or dtype). `progress(1)` (V4's `load_checkpoint`: e.g. a tqdm bar's `update`) after each tensor of
    `tensor_specs(cfg)` is in place, a routed expert's as it joins its layer's stack: `len(tensor_specs(cfg))`
    calls in all. `experts_of(name)`: the routed experts of stacked tensor `layers.N.ffn.experts.*` to read, in that
    order (one rank's share, as V4's `load_checkpoint`; the checkpoint must still hold every expert); default all.
    `table_rows(rows)`: the (first, count) rows of an Engram table of `rows` rows to read (one rank's part:
    `deepinfer.parallel.engram`); the table's stored shape is still checked whole. Default: every row."""
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
    done = progress or (lambda n: None)
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
            part = table_rows(spec.shape[0]) if table_rows is not None and spec.kind == TABLE else None
            tensor = _one(name, spec, values[name], scales.get(name), read, dtype, block, fmt, ckpt, part)
            ckpt.tensors[name] = tensor.to(device)
            done(1)
        for prefix in moes:  # one stacked tensor on the host at a time
            for stacked, tensor in _experts(prefix, cfg, values, scales, read, dtype, block, keep_quantized, ckpt,
                                            done, experts_of):
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
         block: tuple[int, int], kept: Format | None, ckpt: V41Checkpoint,
         rows: tuple[int, int] | None = None) -> torch.Tensor | BlockQuantized:
    """One tensor: plain (cast), quantized kept (`kept`: the format it may keep) or dequantized; shape checked.
    `rows` (first, count): only those rows (with their scales), the stored shape checked whole."""
    label = f"{name} ({key})" if key != name else name
    if rows is not None:  # every rank checks the whole tensors: a short one must fail on each, not on the last
        check_shape(label, read.shape(key), spec, V41_CONFIG)
        scale_rows = read.shape(scale_key)[0] if scale_key is not None else spec.shape[0]
        if scale_rows != spec.shape[0]:
            raise WeightsError(f"tensor {label}: its scale {scale_key} has {scale_rows} rows, the table {spec.shape[0]}")
        spec = TensorSpec((rows[1], *spec.shape[1:]), spec.kind)
    tensor = read(key, rows)
    target = torch.float32 if spec.kind == FP32 else dtype
    if scale_key is not None:
        ckpt.quantized += 1
        q = as_quantized(label, tensor, read(scale_key, rows), TABLE_BLOCK if spec.kind == TABLE else block)
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


PARTS = {"w1": "gate", "w3": "up", "w2": "down"}  # upstream's routed-expert weights, as the stacks join them


def _experts(prefix: str, cfg: V41Config, values: dict[str, str], scales: dict[str, str], read, dtype: torch.dtype,
             block: tuple[int, int], keep: bool, ckpt: V41Checkpoint, done: Callable[[int], object],
             experts_of: Callable[[str], list[int]] | None = None) -> Iterator[tuple[str, torch.Tensor | BlockQuantized]]:
    """Layer `prefix`'s routed experts, (name, tensor) for gate over up [E, 2I, D] then down [E, D, I], each
    stacked while read (`_stack`): FP4 kept with `keep` when the config's experts are FP4 and every expert part
    has its scale, else dequantized into the stack. `experts_of(name)`: only those experts, in that order (the
    stack is [len, ...]; the others are counted as done unread)."""
    inter, d = cfg.moe_intermediate_size, cfg.hidden_size
    for stacked, ws, rows in ((prefix + GATE_UP, ("w1", "w3"), (2 * inter, d)), (prefix + DOWN, ("w2",), (d, inter))):
        chosen = list(range(cfg.n_routed_experts)) if experts_of is None else experts_of(stacked)
        shape = (len(chosen), *rows)
        if len(chosen) < cfg.n_routed_experts:
            done((cfg.n_routed_experts - len(chosen)) * len(ws))
        names = [[f"{prefix}experts.{i}.{w}.weight" for w in ws] for i in chosen]
        fmt = checkpoint_format_v41(names[0][0], cfg) if keep else None
        kept = fmt is not None and all(n in scales for parts in names for n in parts)
        parts = [[(PARTS[n.split(".")[-2]], values[n], scales.get(n)) for n in experts] for experts in names]
        tensor = _stack(shape, parts, read, dtype, block, fmt[0] if kept else None, ckpt, done)
        yield stacked, kernel_form(stacked, tensor) if isinstance(tensor, BlockQuantized) else tensor


def _stack(shape: tuple[int, int, int], experts: list[list[tuple[str, str, str | None]]], read,
           dtype: torch.dtype, block: tuple[int, int], kept: str | None, ckpt: V41Checkpoint,
           done: Callable[[int], object]) -> torch.Tensor | BlockQuantized:
    """`shape` [E, rows, K] from each expert's parts ((part, key, scale key) joined along rows: gate over up),
    every part read once and written into place as read (`_place`). Kept block-quantized (values and scales)
    when `kept` names the format every part has, with the first's block and dtypes and the joins on block
    boundaries (V4's `_stack_quantized`); else every part dequantized / cast to `dtype` (V4's `_stack_experts`):
    a part found to differ turns the parts placed so far into `dtype` first."""
    n, rows, cols = shape
    values = scales = out = first = None
    for i, parts in enumerate(experts):
        row = scale_row = 0
        for part, key, scale_key in parts:
            expect = (rows // len(parts), cols)
            tensor = read(key)
            if scale_key is not None:
                ckpt.quantized += 1
                q = as_quantized(key, tensor, read(scale_key), block)
                if kept is not None:
                    q = for_kernels(key, q)
                    _check_part(key, part, q.shape, expect)
                    if first is None:
                        first = q
                        if q.format != kept or (len(parts) > 1 and expect[0] % q.block[0]):
                            kept = None
                    elif _form(q) != _form(first):
                        kept, out = None, _dequantize_placed(BlockQuantized(values, scales, first.block, first.format),
                                                             i, row, dtype)
                if kept is not None:
                    scale_rows = sum(grid(*expect, q.block)[0] for _ in parts)
                    values = _place(values, (n, rows), i, row, q.values)
                    scales = _place(scales, (n, scale_rows), i, scale_row, q.scales)
                    row, scale_row = row + q.values.shape[0], scale_row + q.scales.shape[0]
                    done(1)
                    continue
                tensor = q.dequantize(dtype)
            elif is_quantized(tensor):
                raise WeightsError(f"tensor {key} is quantized ({tensor.dtype}) but has no scale tensor")
            else:
                tensor = tensor.to(dtype)
            _check_part(key, part, tensor.shape, expect)
            out = _place(out, (n, rows), i, row, tensor)
            row += tensor.shape[0]
            done(1)
    return out if kept is None else BlockQuantized(values, scales, first.block, first.format)


def _place(out: torch.Tensor | None, lead: tuple[int, int], expert: int, row: int, part: torch.Tensor) -> torch.Tensor:
    """`part` [r, ...] written at rows row..row+r of `expert` in the stacked `out` [E, rows, ...] (`lead`: E, rows),
    allocated with `part`'s trailing shape and dtype when None; returns `out`. The one fill of every stack the
    loader builds: dense experts, kept values, kept scales."""
    if out is None:
        out = torch.empty((*lead, *part.shape[1:]), dtype=part.dtype)
    out[expert, row: row + part.shape[0]] = part
    return out


def _dequantize_placed(stack: BlockQuantized, expert: int, row: int, dtype: torch.dtype) -> torch.Tensor:
    """The dense stack (`dtype`) of what a kept stack holds so far: experts before `expert`, and `expert`'s first
    `row` rows (its parts join on block boundaries)."""
    out = None
    for j in range(expert + 1):
        rows = stack.values.shape[1] if j < expert else row
        placed = BlockQuantized(stack.values[j, :rows], stack.scales[j, : -(-rows // stack.block[0])], stack.block,
                                stack.format)
        out = _place(out, tuple(stack.shape[:2]), j, 0, placed.dequantize(dtype))
    return out


def _check_part(key: str, part: str, shape, expect: tuple[int, int]) -> None:
    if tuple(shape) != tuple(expect):
        raise WeightsError(f"tensor {key} has shape {list(shape)}, but expert {part} weights of this config "
                           f"are {list(expect)}")


def _form(q: BlockQuantized) -> tuple:
    return q.format, q.block, q.values.dtype, q.scales.dtype


def bare_name(key: str) -> str:
    return key[len("model."):] if key.startswith("model.") else key
