"""The kernels a DeepSeek-V4.1 model needs, derived as V4's are (`plan`): the model's `forward` runs on meta
tensors through every op's own `run` with a recording launcher, a prefill of n tokens and a decode step of n
sequences `context` positions deep for each traced row count n. The Engram hasher gets a stand-in class map
(the hashes are values; the kernels they launch depend only on shapes)."""

from __future__ import annotations

import torch

from deepinfer.config_v41 import V41Config

META = torch.device("meta")


def trace_v41(cfg: V41Config, dtype: torch.dtype, launcher, rows: tuple[int, ...], context: int = 1024,
              quantized: bool | None = None) -> None:
    from deepinfer.model.engram_hash import from_classes
    from deepinfer.model.v41 import DeepseekV41
    from deepinfer.model.v41_cache import V41Cache
    from deepinfer.model.v41_compress import Chunk
    from tilekernels.kernels import table

    hasher = None
    if cfg.engram is not None:
        e = cfg.engram
        classes = [i % e.compressed_vocab_size for i in range(max(cfg.vocab_size, e.compressed_vocab_size))]
        hasher = from_classes(e.layer_ids, e.max_ngram, e.n_heads, e.vocab_size, e.pad_id, classes)
    model = DeepseekV41(cfg, meta_weights_v41(cfg, dtype, quantized), table(launcher), hasher)
    for n in rows:  # a prefill of n tokens: the row-wise ops (projections, MoE, mHC, head) at n rows, as a decode
        cache = V41Cache.empty(cfg, 1, max(n, context + 1), dtype, META)  # batch of n sequences runs them
        rows_n = torch.zeros(n, dtype=torch.long, device=META)  # logits of every row: the LM head at n rows too
        model.forward(cache, rows_n, [Chunk(0, 0, n, 0)], logit_rows=rows_n)
    # the per-sequence ops (window, compression, indexer, attention) of decode: one row per sequence whatever the
    # batch (traced at two sequences: tracing each of n sequences on meta tensors costs seconds and adds nothing)
    cache = V41Cache.empty(cfg, 2, context + 1, dtype, META)
    cache.num_tokens = [context, context]
    model.forward(cache, torch.zeros(2, dtype=torch.long, device=META), [Chunk(0, 0, 1, context), Chunk(1, 1, 1, context)])


def meta_weights_v41(cfg: V41Config, dtype: torch.dtype, quantized: bool | None = None):
    """The V4.1 weights as meta tensors of their real shapes and dtypes, as the loader hands them over: the
    Engram tables FP8 always; with `quantized` (None: when the config declares a `quantization_config`, as
    `--quantization auto` loads it) the checkpoint's FP8 / FP4 tensors as block-quantized meta weights."""
    from deepinfer.model.v41_weights import TABLE, V41Weights, tensor_specs
    from deepinfer.model.weights import FP32
    from deepinfer.weights.v41_formats import TABLE_FORMAT, checkpoint_format_v41
    from tilekernels.quant import BlockQuantized, grid

    keep = bool(cfg.raw.get("quantization_config")) if quantized is None else quantized
    tensors = {}
    for name, spec in tensor_specs(cfg).items():
        fmt = TABLE_FORMAT if spec.kind == TABLE else checkpoint_format_v41(name, cfg) if keep else None
        if fmt is None:
            tensors[name] = torch.empty(spec.shape, dtype=torch.float32 if spec.kind == FP32 else dtype, device=META)
            continue
        form, block, ue8m0 = fmt
        rows, cols = spec.shape
        values = (torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=META) if form == "fp8" else
                  torch.empty(rows, cols // 2, dtype=torch.uint8, device=META))
        scales = torch.empty(*grid(rows, cols, block), dtype=torch.uint8 if ue8m0 else torch.float32, device=META)
        tensors[name] = BlockQuantized(values, scales, block, form)
    return V41Weights.from_tensors(cfg, tensors)
