"""The kernels a DeepSeek-V4 model needs, derived by running it: prefill and decode run once on meta tensors
(no memory, no compute) through every op's own `run` with a recording launcher, at each row count where an op
declares its variant changes (`OpDecl.row_samples`). What `run` would launch is what the plan builds: there is
no second list of variants to keep in step with the ops."""

from __future__ import annotations

from typing import Any

import torch

from deepinfer.config import ModelConfig
from deepinfer.config_v41 import V41Config

Item = tuple[str, str, Any]  # (op, kernel, variant)
META = torch.device("meta")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def sample_rows() -> tuple[int, ...]:
    """Row counts to trace: 1 and every op's declared variant boundaries."""
    from tilekernels.ops import DECLARED

    return tuple(sorted({1}.union(*(op.row_samples for op in DECLARED.values()))))


def kernel_plan(cfg: ModelConfig | V41Config, dtype: str = "bfloat16", quantized: bool | None = None,
                invariant: bool = False, ranks: tuple | None = None) -> list[Item]:
    """Every (op, kernel, variant) the forward passes of `cfg` (DeepSeek-V4 or V4.1) launch, without duplicates,
    in launch order. `quantized`: the checkpoint's FP8/FP4 tensors stay quantized (None: whenever the config
    declares a `quantization_config`, as `--quantization auto` loads them). `invariant`: the batch-invariant
    variants (`--batch-invariant`), DeepSeek-V4 only. `ranks` (a `ParallelConfig` and the EPLB redundant slots):
    what one rank of that layout launches (`plan_ranks`)."""
    from deepinfer.compile.plan_v41 import trace_v41
    from deepinfer.errors import ConfigError
    from tilekernels.kernels import Recorder

    recorder = Recorder(invariant)
    if isinstance(cfg, V41Config) and invariant:
        raise ConfigError("batch invariance is implemented for DeepSeek-V4 models; this config is DeepSeek-V4.1")
    if ranks is not None and ranks[0].world > 1:
        from deepinfer.compile.plan_ranks import trace_rank

        trace_rank(cfg, dtype, recorder, sample_rows(), quantized, *ranks)
    elif isinstance(cfg, V41Config):
        trace_v41(cfg, torch_dtype(dtype), recorder, sample_rows(), quantized=quantized)
    else:
        trace(cfg, dtype, recorder, sample_rows(), quantized=quantized)
    return list(recorder.seen)


def torch_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported by the kernels; accepted: {', '.join(DTYPES)}")
    return DTYPES[dtype]


def trace(cfg: ModelConfig, dtype: str, launcher, rows: tuple[int, ...], context: int = 1024,
          quantized: bool | None = None, model=None) -> None:
    """Run, on meta tensors, a prefill of n tokens and a decode step of n sequences (each `context` positions
    deep) for every n in `rows`, launching kernels through `launcher`; with MTP layers in the config, the first
    one's pass over the n prefilled rows too (speculative decoding's drafter); with DSpark, its read of the n
    rows and a draft pass for n requests. `model`: a meta model of `cfg` over `launcher`'s table to run instead
    of the whole one (one rank's: no drafters, speculative decoding runs on one device)."""
    from deepinfer.model.decode import DecodeInputs
    from deepinfer.model.model import DeepseekV4
    from deepinfer.model.dspark import DSparkDrafter
    from deepinfer.model.mtp import MTPDrafter, draft_share
    from deepinfer.runtime.cache import CacheSpec, PagedCache
    from tilekernels.kernels import table

    whole = model is None
    if whole:
        model = DeepseekV4(cfg, meta_weights(cfg, torch_dtype(dtype), quantized), table(launcher))
    drafter = MTPDrafter(model) if whole and model.weights.mtp else None
    dspark = DSparkDrafter(model) if whole and model.weights.dspark is not None else None
    for n in rows:
        per_seq = -(-max(n, context + 1) // 128)
        cache = PagedCache(cfg, CacheSpec(num_blocks=n * per_seq, max_seqs=n, max_blocks_per_seq=per_seq,
                                          draft_layers=model.weights.draft_layers), DTYPES[dtype], META)
        seq = cache.admit()
        cache.grow(seq, n)
        ids = torch.zeros(n, dtype=torch.long, device=META)
        _, streams = model.prefill(cache, ids, ids, [(seq, 0, n)], hidden=True)
        if drafter is not None:
            drafter.forward(cache, streams, ids, ids, [(draft_share(seq, 0), 0, n)], ids)
        if dspark is not None:
            share = draft_share(seq, 0)
            w = cfg.sliding_window  # a step's read is every kept row of its requests (up to W each)
            dspark.read(cache, streams, ids, [(share, s, min(w, n - s)) for s in range(0, n, w)])
            b = cfg.dspark.block_size
            for requests in sorted({max(1, n // b), -(-n // b)}):  # a pass runs requests x b rows: both sides of n
                anchors = torch.zeros(requests, dtype=torch.long, device=META)
                dspark.draft(cache, anchors, anchors, [share] * requests, lambda logits, i: logits.argmax(dim=-1))
        step = DecodeInputs(
            ids=torch.zeros(n, dtype=torch.long, device=META),
            positions=torch.zeros(n, dtype=torch.long, device=META),
            slots=torch.zeros(n, dtype=torch.long, device=META),
            blocks=torch.zeros(n, per_seq, dtype=torch.long, device=META),
        )
        model.decode(cache, step)


def meta_weights(cfg: ModelConfig, dtype: torch.dtype, quantized: bool | None = None):
    """The model's weights as meta tensors of their real shapes and dtypes; with `quantized` (None: when the
    config declares a `quantization_config`) the checkpoint's FP8/FP4 tensors as block-quantized meta weights."""
    from deepinfer.model.weights import ModelWeights

    return ModelWeights.from_tensors(cfg, meta_tensors(cfg, dtype, quantized))


def meta_tensors(cfg: ModelConfig, dtype: torch.dtype, quantized: bool | None = None) -> dict:
    """`meta_weights`' tensors by canonical name, before they are packed."""
    from deepinfer.model.weights import FP32, INT, mtp_tensor_specs, tensor_specs
    from deepinfer.weights.quant import checkpoint_format

    qc = cfg.raw.get("quantization_config")
    if quantized is False:
        qc = None
    kinds = {FP32: torch.float32, INT: torch.long}
    return {name: meta_weight(spec.shape, checkpoint_format(name, qc), kinds.get(spec.kind, dtype))
            for name, spec in {**tensor_specs(cfg), **mtp_tensor_specs(cfg)}.items()}


def meta_weight(shape: tuple[int, ...], fmt: tuple | None, dtype: torch.dtype):
    """A meta weight of logical `shape` [..., N, K]: plain `dtype` (`fmt` None), or block-quantized as the loader
    keeps it in `fmt` (form, block, ue8m0): FP8 values or FP4 packed two a byte, ue8m0 exponent-byte or fp32
    scales."""
    from tilekernels.quant import BlockQuantized, grid

    if fmt is None:
        return torch.empty(shape, dtype=dtype, device=META)
    form, block, ue8m0 = fmt
    *lead, rows, cols = shape
    values = (torch.empty(*lead, rows, cols, dtype=torch.float8_e4m3fn, device=META) if form == "fp8" else
              torch.empty(*lead, rows, cols // 2, dtype=torch.uint8, device=META))
    scales = torch.empty(*lead, *grid(rows, cols, block), dtype=torch.uint8 if ue8m0 else torch.float32, device=META)
    return BlockQuantized(values, scales, block, form)
