"""The kernels a DeepSeek-V4.1 model needs, derived as V4's are (`plan`): the model's `forward` runs on meta
tensors through every op's own `run` with a recording launcher, a prefill of n tokens and a decode step of n
sequences `context` positions deep for each traced row count n. The Engram hasher gets a stand-in class map
(the hashes are values; the kernels they launch depend only on shapes). With DSpark draft blocks, the drafter's
read of the prefilled rows and its block passes (`trace_v41`)."""

from __future__ import annotations

import torch

from deepinfer.config_v41 import V41Config

META = torch.device("meta")


def trace_v41(cfg: V41Config, dtype: torch.dtype, launcher, rows: tuple[int, ...], context: int = 1024,
              quantized: bool | None = None, model=None) -> None:
    """`model`: a meta model of `cfg` over `launcher`'s table to run instead of the whole one (one rank's: no
    drafter, speculative decoding runs on one device)."""
    from deepinfer.model.v41 import DeepseekV41
    from deepinfer.model.v41_cache import V41Cache
    from deepinfer.model.v41_compress import Chunk
    from deepinfer.model.v41_dspark import V41DSparkDrafter
    from deepinfer.runtime.blocks import SeqCache
    from tilekernels.kernels import table

    whole = model is None
    if whole:
        model = DeepseekV41(cfg, meta_weights_v41(cfg, dtype, quantized), table(launcher), stand_in_hasher(cfg))
    drafter = V41DSparkDrafter(model) if whole and model.weights.dspark is not None else None
    for n in rows:  # a prefill of n tokens: the row-wise ops (projections, MoE, mHC, head) at n rows, as a decode
        cache = V41Cache.empty(cfg, 1, max(n, context + 1), dtype, META,  # batch of n sequences runs them
                               draft_layers=model.weights.draft_layers)
        rows_n = torch.zeros(n, dtype=torch.long, device=META)  # logits of every row: the LM head at n rows too
        out = model.forward(cache, rows_n, [Chunk(0, 0, n, 0)], logit_rows=rows_n, hidden=drafter is not None)
        if drafter is not None:  # DSpark: its read of n kept rows (up to W a request) and passes of n / b requests
            share, w, b = SeqCache(slot=0, num_tokens=0, window_start=0), cfg.sliding_window, cfg.dspark.block_size
            drafter.read(cache, out[1], rows_n, [(share, s, min(w, n - s)) for s in range(0, n, w)])
            for requests in sorted({max(1, n // b), -(-n // b)}):  # a pass runs requests x b rows: both sides of n
                anchors = torch.zeros(requests, dtype=torch.long, device=META)
                drafter.markov(*drafter.block(cache, anchors, anchors, anchors, anchors), anchors,
                               lambda logits, i: logits.argmax(dim=-1))
    # the per-sequence ops (window, compression, indexer, attention) of decode: one row per sequence whatever the
    # batch (traced at two sequences: tracing each of n sequences on meta tensors costs seconds and adds nothing)
    cache = V41Cache.empty(cfg, 2, context + 1, dtype, META)
    cache.num_tokens = [context, context]
    model.forward(cache, torch.zeros(2, dtype=torch.long, device=META), [Chunk(0, 0, 1, context), Chunk(1, 1, 1, context)])


def stand_in_hasher(cfg: V41Config):
    """An Engram hasher of `cfg`'s shapes with a synthetic class map (token id modulo the class count); None
    without Engram layers."""
    from deepinfer.model.engram_hash import from_classes

    e = cfg.engram
    if e is None:
        return None
    classes = torch.arange(max(cfg.vocab_size, e.compressed_vocab_size)) % e.compressed_vocab_size
    return from_classes(e.layer_ids, e.max_ngram, e.n_heads, e.vocab_size, e.pad_id, classes)


def meta_weights_v41(cfg: V41Config, dtype: torch.dtype, quantized: bool | None = None):
    """The V4.1 weights as meta tensors of their real shapes and dtypes, as the loader hands them over: the
    Engram tables FP8 always; with `quantized` (None: as True, as `--quantization auto` loads the checkpoint) the
    FP8 / FP4 tensors the config's `quantization_config` declares as block-quantized meta weights."""
    from deepinfer.model.v41_weights import V41Weights

    return V41Weights.from_tensors(cfg, meta_tensors_v41(cfg, dtype, quantized))


def meta_tensors_v41(cfg: V41Config, dtype: torch.dtype, quantized: bool | None = None) -> dict:
    """`meta_weights_v41`' tensors by checkpoint name, before they are packed."""
    from deepinfer.compile.plan import meta_weight
    from deepinfer.model.v41_weights import tensor_specs
    from deepinfer.model.weights import FP32
    from deepinfer.weights.v41_formats import loaded_format_v41

    keep = quantized is not False  # without a quantization_config nothing but the tables is quantized anyway
    return {name: meta_weight(spec.shape, loaded_format_v41(name, cfg, keep), torch.float32 if spec.kind == FP32
                              else dtype) for name, spec in tensor_specs(cfg).items()}
