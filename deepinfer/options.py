"""Engine options: their types and ranges (checked before anything loads), the compute dtype, and the cache's
geometry and size against the memory that must hold it."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from deepinfer.config import ModelConfig
from deepinfer.env import MAX_DRAFT_TOKENS
from deepinfer.errors import ConfigError
from deepinfer.runtime.cache import CacheLayout, CacheSpec
from deepinfer.runtime.prefix import MODES as PREFIX_MODES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, default: str = "float32") -> torch.dtype:
    """'auto' is the target's default dtype (float32 on the CPU paths, bfloat16 on accelerators); otherwise one
    of DTYPES."""
    if name == "auto":
        return DTYPES[default]
    if name not in DTYPES:
        raise ConfigError(f"dtype {name!r} is not supported; accepted: auto, {', '.join(DTYPES)}")
    return DTYPES[name]


DEFAULT_MAX_MODEL_LEN = 8192


def cache_spec(cfg: ModelConfig, memory: tuple[int, int] | None, dtype: torch.dtype, max_seqs: int, max_model_len: int | None,
               num_blocks: int | None, gpu_memory_utilization: float, block_tokens: int = 128,
               unit: Callable[[CacheSpec], tuple[int, int]] | None = None, snapshots: int = 0,
               draft_layers: int = 0, lookahead: int = 0, reserve: int = 0) -> CacheSpec:
    """Cache geometry: the block table spans max_model_len (default min(model limit, 8192)); blocks come from
    `num_blocks`, else from free device memory when the target can measure it (`memory`: free, total), else
    enough for every slot at full length. `unit(spec)` -> (bytes per block, bytes per slot) of the model's
    cache (default: V4's `CacheLayout`). `snapshots`: sliding-window snapshots to keep (exact prefix caching;
    V4's layout only), taken out of the memory budget first; `draft_layers`: draft layers' window rings per slot
    (speculative decoding); `lookahead`: ring rows for verify rows a sequence may not keep; `reserve`: device
    bytes kept free beyond the 2 GiB of activations (speculative decoding's captured graphs: `draft_graph_bytes`)."""
    limit = model_len(cfg, max_model_len)
    per_seq = -(-limit // block_tokens)
    if num_blocks is None:
        num_blocks = max_seqs * per_seq
        if memory is not None:
            probe = CacheSpec(0, max_seqs, per_seq, block_tokens, draft_layers=draft_layers, lookahead=lookahead)
            if unit is None:
                layout = CacheLayout.build(cfg, probe, dtype)
                per_block, per_slot = layout.block_bytes, layout.slot_bytes
                per_slot += snapshots * layout.snapshot_bytes / (max_seqs + 1)
            else:
                per_block, per_slot = unit(probe)
            free, _ = memory
            activations = (2 << 30) + reserve  # 2 GiB, and what the drafter's graphs keep
            budget = int(free * gpu_memory_utilization - (max_seqs + 1) * per_slot) - activations
            if budget < 2 * per_block:  # one block and the scratch block
                raise ConfigError(f"not enough free GPU memory for the cache: {free / 2**30:.1f} GiB free, "
                                  f"gpu_memory_utilization={gpu_memory_utilization}, {max_seqs} slots of "
                                  f"{per_slot / 2**20:.0f} MiB, {activations / 2**30:.2f} GiB for activations"
                                  + (" (with the speculative graphs' buffers)" if reserve else "")
                                  + "; lower --max-num-seqs or set --num-blocks")
            num_blocks = min(num_blocks, budget // per_block - 1)  # the cache adds a scratch block
    if num_blocks < 1:
        raise ConfigError(f"num_blocks must be >= 1, got {num_blocks}")
    return CacheSpec(num_blocks=num_blocks, max_seqs=max_seqs, max_blocks_per_seq=per_seq, block_tokens=block_tokens,
                     snapshots=snapshots, draft_layers=draft_layers, lookahead=lookahead)


def draft_graph_bytes(cfg, max_seqs: int, draft_layers: int, dtype: torch.dtype, lookahead: int = 0) -> int:
    """Device bytes speculative decoding's captured graphs keep beyond the 2 GiB of activations (0 without drafts):
    the verify buckets' logits past plain decoding's (`lookahead` drafts a request: buckets up to max_seqs x (1 +
    lookahead) rows), and with DSpark the block passes' largest bucket's base logits [requests, block, V] in `dtype`
    with a Markov-corrected fp32 row and its bias [requests, V] (the buckets share one memory pool)."""
    from deepinfer.runtime.graph import graph_logits_bytes

    if not draft_layers:
        return 0
    vocab = cfg.vocab_size
    verify = graph_logits_bytes(max_seqs * (1 + lookahead), vocab) - graph_logits_bytes(max_seqs, vocab)
    if getattr(cfg, "dspark", None) is None:
        return verify
    size = torch.empty((), dtype=dtype).element_size()
    return verify + max_seqs * vocab * (cfg.dspark.block_size * size + 8)


def model_len(cfg: ModelConfig, max_model_len: int | None) -> int:
    """The longest sequence (prompt and output): max_model_len, else min(model limit, 8192)."""
    if max_model_len is not None and max_model_len > cfg.max_position_embeddings:
        raise ConfigError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings "
                          f"({cfg.max_position_embeddings})")
    return min(cfg.max_position_embeddings, max_model_len or DEFAULT_MAX_MODEL_LEN)


def host_memory() -> int | None:
    """Bytes of host memory available now (Linux MemAvailable), or None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _option(name: str, value: Any, ok: bool, accepted: str) -> None:
    if not ok:
        raise ConfigError(f"{name}={value!r} is invalid; expected {accepted}")


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_options(model, backend, dtype, tokenizer, max_num_seqs, max_prefill_tokens, max_model_len, num_blocks,
                  gpu_memory_utilization, random_seed, quantization="auto", batch_invariant=None,
                  prefix_cache=None, speculative_tokens=None, speculative_varlen=None) -> None:
    """Types and ranges of LLM's arguments, before anything is loaded."""
    _option("model", model, model is None or isinstance(model, (str, Path)), "a model directory path (str or Path) or None")
    _option("backend", backend, backend is None or isinstance(backend, str), "a target name or None")
    _option("dtype", dtype, isinstance(dtype, str), f"one of auto, {', '.join(DTYPES)}")
    _option("tokenizer", tokenizer, tokenizer is None or isinstance(tokenizer, (str, Path)),
            "a tokenizer.json path (str or Path) or None")
    _option("max_num_seqs", max_num_seqs, _count(max_num_seqs), "an integer >= 1")
    _option("max_prefill_tokens", max_prefill_tokens, _count(max_prefill_tokens), "an integer >= 1")
    _option("max_model_len", max_model_len, max_model_len is None or (_count(max_model_len) and max_model_len >= 2),
            "an integer >= 2 (prompt and output positions) or None")
    _option("num_blocks", num_blocks, num_blocks is None or _count(num_blocks), "an integer >= 1 or None")
    _option("gpu_memory_utilization", gpu_memory_utilization,
            isinstance(gpu_memory_utilization, (int, float)) and not isinstance(gpu_memory_utilization, bool)
            and 0 < gpu_memory_utilization <= 1, "a number in (0, 1]")
    _option("random_seed", random_seed, isinstance(random_seed, int) and not isinstance(random_seed, bool)
            and 0 <= random_seed < 2**63, "an integer in [0, 2**63)")
    _option("quantization", quantization, quantization in QUANTIZATIONS,
            "'auto' (FP8/FP4 checkpoint tensors kept in their own precision) or 'none' (dequantized to dtype)")
    _option("batch_invariant", batch_invariant, batch_invariant is None or isinstance(batch_invariant, bool),
            "True, False or None ($DEEPINFER_BATCH_INVARIANT)")
    _option("prefix_cache", prefix_cache, prefix_cache is None or prefix_cache in PREFIX_MODES,
            f"one of {', '.join(PREFIX_MODES)}, or None (approximate; exact with batch_invariant)")
    _option("speculative_tokens", speculative_tokens, speculative_tokens is None or (
        isinstance(speculative_tokens, int) and not isinstance(speculative_tokens, bool)
        and 0 <= speculative_tokens <= MAX_DRAFT_TOKENS),
        f"an integer from 0 to {MAX_DRAFT_TOKENS} (draft tokens per decode step; 0 = plain decoding) or None "
        "($DEEPINFER_USE_NEXTN_DECODE, else 5 when the checkpoint has an MTP layer)")
    _option("speculative_varlen", speculative_varlen, speculative_varlen is None or isinstance(speculative_varlen, bool),
            "True, False or None ($DEEPINFER_ENABLE_MTP_VARLEN)")
    if tokenizer is not None and not Path(tokenizer).is_file():
        raise ConfigError(f"tokenizer file {str(tokenizer)!r} does not exist or is not a file; pass a tokenizer.json "
                          "path, or None for the model directory's own (else the V4 default)")


QUANTIZATIONS = ("auto", "none")


def fit_check(weights: int, cache: int, available: int | None, where: str, hints: list[str],
              cache_desc: str = "") -> None:
    """ConfigError, before anything is allocated, when weights and cache cannot fit in `available` bytes;
    `cache_desc` says what sized the cache."""
    if available is None or weights + cache <= available:
        return
    gib = 2**30
    raise ConfigError(f"the model does not fit: weights {weights / gib:.1f} GiB + cache {cache / gib:.1f} GiB"
                      f"{cache_desc} = "
                      f"{(weights + cache) / gib:.1f} GiB, but {where} has {available / gib:.1f} GiB; "
                      + "; ".join(hints))


def tiny_weight_bytes(cfg: ModelConfig, dtype: torch.dtype, share=None) -> int:
    """The bytes of a model made from `cfg` with every tensor at its kept dtype (no checkpoint: the tiny model);
    `share(name)`: the fraction of each tensor a rank keeps (default all)."""
    import math

    from deepinfer.model.weights import FP32, MODEL, tensor_specs

    size = {MODEL: torch.empty((), dtype=dtype).element_size(), FP32: 4}
    return int(sum(math.prod(spec.shape) * size.get(spec.kind, 8) * (1.0 if share is None else share(name))
                   for name, spec in tensor_specs(cfg).items()))


def speculative_request(explicit: int | None, env_value: int | None, *, ranks: int, prefix: str,
                        block: int = 0) -> int | None:
    """The draft tokens per step asked for: `explicit` (LLM / --speculative-tokens), else `env_value`
    (DEEPINFER_USE_NEXTN_DECODE); None: the default (5 when the checkpoint has an MTP layer). 0 where speculative
    decoding does not run yet (an explicit K > 0 there is a ConfigError; the variable is then ignored). `block`:
    the config's DSpark block size (one pass drafts that many: a larger K is a ConfigError naming where it came
    from), 0 without DSpark."""
    blocked = ("several ranks" if ranks > 1 else "prefix_cache='exact' (--prefix-cache exact)" if prefix == "exact"
               else None)
    if blocked is None:
        asked = explicit if explicit is not None else env_value
        if block and asked is not None and asked > block:
            source = f"speculative_tokens={asked}" if explicit is not None else f"DEEPINFER_USE_NEXTN_DECODE={asked}"
            raise ConfigError(f"{source}: the checkpoint drafts with DSpark blocks of dspark_block_size={block} "
                              f"tokens; pass at most {block}")
        return asked
    if explicit:
        raise ConfigError(f"speculative_tokens={explicit}: speculative decoding does not run with {blocked} yet; "
                          "pass 0 (or leave it unset)")
    return 0


def draft_tokens(requested: int | None, explicit: bool, mtp_layers: int, model: str, block: int = 0) -> int:
    """Draft tokens per step for a model with `mtp_layers` draft layers loaded: `requested`, or 5 (None) when it has
    them; a ConfigError for an explicit K > 0 on a model without. `block`: DSpark's block size (its one pass
    drafts that many: the default is cut to it, a larger K is a ConfigError)."""
    if mtp_layers:
        if requested is None:
            return default_draft_tokens(block)
        if block and requested > block:
            raise ConfigError(f"speculative_tokens={requested}: {model} drafts with DSpark blocks of "
                              f"dspark_block_size={block} tokens; pass at most {block}")
        return requested
    if explicit and requested:
        raise ConfigError(f"speculative_tokens={requested}: {model} has no MTP layer to draft with (no mtp.* "
                          "tensors, or num_nextn_predict_layers 0 in its config.json); pass 0 or leave it unset")
    return 0


DEFAULT_DRAFT_TOKENS = 5  # DEEPINFER_USE_NEXTN_DECODE's default in the product


def default_draft_tokens(block: int = 0) -> int:
    """Draft tokens per step when none are asked for: 5, cut to DSpark's `block` size (0: no DSpark)."""
    return min(DEFAULT_DRAFT_TOKENS, block or DEFAULT_DRAFT_TOKENS)
