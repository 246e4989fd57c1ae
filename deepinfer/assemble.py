"""A model directory (or the embedded tiny model) and the engine options -> the model, its cache and the
`ModelSteps` the engine drives: `assemble_v4` for DeepSeek-V4 (paged cache, decode graphs, kernels where the
backend has them), `assemble_v41` for DeepSeek-V4.1 (the CPU reference path and sm90, its paged cache)."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

import backends
from deepinfer.config import ModelConfig
from deepinfer.config_v41 import V41Config
from deepinfer.env import Env, check_writable_dir
from deepinfer.compile.ready import ready_kernels
from deepinfer.errors import ConfigError
from deepinfer.options import cache_spec, draft_graph_bytes, fit_check, host_memory, tiny_weight_bytes
from deepinfer.runtime.backend import Backend
from deepinfer.runtime.cache import CacheLayout, CacheSpec, PagedCache
from deepinfer.runtime.defaults import MAX_PREFILL_TOKENS
from deepinfer.runtime.prefix import PrefixMode
from deepinfer.runtime.steps import ModelSteps

log = logging.getLogger("deepinfer")
GIB = 2**30
V41_BACKENDS = ("reference", "c", "sm90")  # where V4.1 has run; `cpu` names the first


@dataclass(frozen=True)
class EngineOptions:
    max_num_seqs: int
    max_model_len: int | None
    num_blocks: int | None
    gpu_memory_utilization: float
    random_seed: int
    quantization: str  # auto | none
    show_progress: bool
    batch_invariant: bool = False  # the backend's op table is the batch-invariant one (its plan compiled so)
    prefix_cache: PrefixMode = PrefixMode("off")  # DeepSeek-V4's prefix cache (runtime/prefix.py)
    draft_layers: int = 0  # MTP layers to load and give a window ring per slot (speculative decoding)
    lookahead: int = 0  # draft tokens a verify step may write and not keep (CacheSpec.lookahead)
    max_prefill_tokens: int = MAX_PREFILL_TOKENS  # rows of a forward at most (the V4.1 ranks' Engram exchange)

    @property
    def snapshots(self) -> int:
        """Sliding-window snapshots the cache keeps: exact prefix caching keeps four per running sequence (a
        conversation's next turn finds the last one of its previous turn after the others' new ones)."""
        return 4 * self.max_num_seqs if self.prefix_cache.mode == "exact" else 0


@dataclass(frozen=True)
class Assembled:
    model: Any  # DeepseekV4 | DeepseekV41
    cache: Any  # PagedCache | V41SlotCache (both SlotBlocks)
    steps: ModelSteps
    weight_bytes: int
    memory_report: str


def _fit(cfg: Any, dtype: torch.dtype, backend: Backend, opts: EngineOptions, weights: int, cache_bytes) -> None:
    """ConfigError before anything large is allocated when weights and cache exceed the memory available."""
    memory = backend.memory()
    where = "host memory available" if memory is None else "the device's free memory"
    cache_need, cache_desc = 0, ""
    if opts.num_blocks is not None or memory is None:  # an explicit size, or every slot at full length
        probe = cache_spec(cfg, None, dtype, opts.max_num_seqs, opts.max_model_len, opts.num_blocks,
                           opts.gpu_memory_utilization, snapshots=opts.snapshots, draft_layers=opts.draft_layers,
                           lookahead=opts.lookahead)
        cache_need = cache_bytes(probe)
        cache_desc = (f" (num_blocks={probe.num_blocks} blocks of {probe.block_tokens} positions, "
                      f"max_num_seqs={probe.max_seqs} slots)")
    hints = ["lower --max-num-seqs, --max-model-len or --num-blocks"]
    if opts.quantization == "none" and cfg.raw.get("quantization_config"):
        hints.insert(0, "keep the checkpoint's FP8/FP4 weights with --quantization auto")
    hints.append("split it over several devices (--data-parallel-size 2 --enable-expert-parallel)")
    fit_check(weights, cache_need, host_memory() if memory is None else memory[0], where, hints, cache_desc)


def assemble_v4(cfg: ModelConfig, model_dir: Path | None, backend: Backend, dtype: torch.dtype, env: Env,
                opts: EngineOptions, comm=None, eplb=None, load_mtp: bool = True) -> Assembled:
    """`comm` (a `deepinfer.parallel.comm.Comm`): this process is one rank of several; it keeps its share
    (`eplb`: an `EplbConfig` when the split experts are balanced). `load_mtp`: the MTP draft layers' weights are
    loaded too, when the checkpoint (or the random tiny model's config) has them."""
    from deepinfer.model.model import DeepseekV4
    from deepinfer.model.weights import ModelWeights, mtp_tensor_specs, tensor_specs
    from deepinfer.runtime.graph import DecodeGraphs
    from deepinfer.runtime.steps import V4Steps
    from deepinfer.weights.loader import weight_bytes

    # quantized checkpoint tensors stay FP8 / FP4 on every backend with `auto` (the kernels read them as stored;
    # the reference ops dequantize one tensor at a time); `none` dequantizes them at load
    keep = opts.quantization == "auto"
    placement = share = None
    if comm is not None:  # where the routed experts go, before anything is read: a rank reads its own only
        from deepinfer.parallel.shard import expert_placement, experts_to_read, rank_model, rank_share, take_experts

        placement = expert_placement(cfg, comm, eplb)
        share = rank_share(cfg, comm.rank, placement)
    weights_size = (weight_bytes(model_dir, cfg, dtype, keep, share, load_mtp) if model_dir is not None
                    else tiny_weight_bytes(cfg, dtype, share))
    def cache_bytes(spec: CacheSpec) -> int:
        layout = CacheLayout.build(cfg, spec, dtype)
        return layout.nbytes + spec.snapshots * layout.snapshot_bytes

    _fit(cfg, dtype, backend, opts, weights_size, cache_bytes)
    if backend.kernel_target is not None:
        check_writable_dir(env.cache_dir, "the kernel cache (DEEPINFER_CACHE_DIR)")
    clock = Phases()
    experts = None
    if model_dir is None:
        from deepinfer.tiny import random_tensors

        tensors = random_tensors(cfg, seed=opts.random_seed, dtype=dtype)
        tensors = tensors if load_mtp else {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
        mtp_layers = cfg.num_nextn_predict_layers if load_mtp else 0
    else:
        from deepinfer.weights.loader import load_checkpoint

        total = len(tensor_specs(cfg)) + (len(mtp_tensor_specs(cfg)) if load_mtp else 0)
        bar = progress_bar(opts.show_progress, "loading weights", total=total)
        # each tensor goes to the device as soon as it is read: the host holds one tensor at a time
        ckpt = load_checkpoint(model_dir, cfg, dtype, backend.device, progress=None if bar is None else bar.update,
                               keep_quantized=keep,
                               experts_of=None if placement is None else experts_to_read(placement, comm.rank.rank),
                               load_mtp=load_mtp)
        if bar is not None:
            bar.close()
        tensors, mtp_layers = ckpt.tensors, ckpt.mtp_layers
    if cfg.has_mtp:
        log.info("MTP draft layers: %d of the config's %d loaded%s", mtp_layers, cfg.num_nextn_predict_layers,
                 "" if load_mtp else " (load_mtp=False)")
    device = backend.device
    layout = kernel_layout(backend)
    if placement is not None:  # this rank's expert slots (cut here from random weights; a checkpoint's are read so)
        gate_up, down = take_experts(tensors, cfg, placement, comm.rank.rank, whole=model_dir is None)
        experts = ([layout(w.to(device)) for w in gate_up], [layout(w.to(device)) for w in down])
    else:  # routed experts in the layout the target's kernels read (one tensor at a time: the plain one is freed)
        for name in [n for n in tensors if ".mlp.experts." in n]:
            tensors[name] = layout(tensors[name].to(device))
    weights = ModelWeights.from_tensors(cfg, {k: v if getattr(v, "is_meta", False) else v.to(device)
                                              for k, v in tensors.items()})
    if comm is None:
        model = DeepseekV4(cfg, weights, backend.ops, side=backend.side_stream() if env.second_stream else None)
    else:
        model = rank_model(cfg, weights, backend.ops, comm, placement, experts, eplb)
    del tensors, weights
    clock.done("weights", f"{weights_size / GIB:.2f} GiB on {device}")
    ready_kernels(backend, cfg, dtype, env, opts, clock, comm, eplb)
    ahead = opts.lookahead if model.weights.draft_layers else 0  # speculative decoding: draft rows a verify step may drop
    drafts = min(opts.draft_layers, model.weights.draft_layers)
    cache = PagedCache(cfg, cache_spec(cfg, backend.memory(), dtype, opts.max_num_seqs, opts.max_model_len,
                                       opts.num_blocks, opts.gpu_memory_utilization, snapshots=opts.snapshots,
                                       draft_layers=drafts, lookahead=ahead,
                                       reserve=draft_graph_bytes(cfg, opts.max_num_seqs, drafts, dtype, ahead)),
                       dtype, device)
    cache.enable_prefix(opts.prefix_cache, cache.salt())
    clock.done("cache allocation", f"{cache.num_bytes() / GIB:.2f} GiB")
    snapshots = (f" + {cache.spec.snapshots} window snapshots {cache.snapshot_bytes() / GIB:.2f} GiB"
                 if cache.spec.snapshots else "")
    report = (f"memory on {device}: weights {weights_size / GIB:.2f} GiB"
              + (" (FP8/FP4 kept)" if keep and cfg.raw.get("quantization_config") else "")
              + f", cache {cache.num_bytes() / GIB:.2f} GiB{snapshots}")
    # several ranks decode eagerly on the device unless DEEPINFER_PARALLEL_GRAPHS: NCCL inside graphs never ran yet
    capture = backend.capture if comm is None or env.parallel_graphs else None
    steps = V4Steps(model, cache, DecodeGraphs(model, cache, opts.max_num_seqs * (1 + ahead), capture,
                                               hidden=ahead > 0))
    if comm is not None and comm.lockstep:
        from deepinfer.parallel.lockstep import LockstepSteps

        steps = LockstepSteps(steps, model, comm)
    return Assembled(model, cache, steps, weights_size, report)


def kernel_layout(backend: Backend):
    """w -> w in the layout `backend`'s expert kernels read (FP4 experts K-permuted for sm_90a's kernels; anything
    else as it is)."""
    if backend.kernel_target is None:
        return lambda w: w
    from tilekernels.ops.moe_experts import kernel_layout as layout

    return lambda w: layout(w, backend.target)


def check_v41_backend(name: str | None) -> None:
    """ConfigError when the `--backend` name (or DEEPINFER_ACCELERATOR) picks a target V4.1 does not run on yet
    (checked before the target is resolved, so it is the error on any machine)."""
    if name is not None and name not in backends.BACKEND_NAMES:
        return  # an unknown name: the backend's own resolution names the accepted ones
    names = backends.ALIASES.get(name, (name,)) if name is not None else (backends.detect().name,)
    if all(n not in V41_BACKENDS for n in names):
        raise ConfigError(f"backend {name or names[0]!r}: DeepSeek-V4.1 runs on {', '.join(V41_BACKENDS)} for now "
                          f"(--backend cpu: the reference ops; --backend c: its TileLang kernels on the CPU; "
                          f"--backend nvidia: its TileLang kernels on an sm_90 GPU); sm100 and ascend lower and build "
                          f"its kernels (`deepinfer compile --model DIR`) but the model was never run there")


def engram_hasher(cfg: V41Config, tokenizer_path: Path):
    """The Engram n-gram hasher from the tokenizer's class map (None without Engram layers); ConfigError when
    the tokenizer's class count is not the config's `engram_compressed_vocab_size`."""
    if cfg.engram is None:
        return None
    from tokenizers import Tokenizer

    from deepinfer.model.engram_hash import from_classes, token_classes

    e = cfg.engram
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    classes, count = token_classes(tokenizer)
    if count != e.compressed_vocab_size:
        raise ConfigError(f"the tokenizer {tokenizer_path} gives {count} Engram token classes; the V4.1 config "
                          f"declares engram_compressed_vocab_size {e.compressed_vocab_size}: the Engram tables are "
                          "indexed by the model's own tokenizer (put its tokenizer.json in the model directory, or "
                          "pass tokenizer=...)")
    if e.pad_id >= len(classes):
        raise ConfigError(f"engram_pad_id {e.pad_id} is outside the tokenizer's {len(classes)} token ids")
    return from_classes(e.layer_ids, e.max_ngram, e.n_heads, e.vocab_size, e.pad_id, classes)


def v41_weight_bytes(cfg: V41Config, dtype: torch.dtype, keep_quantized: bool = False,
                     share: Callable[[str], float] | None = None) -> int:
    """Bytes of the loaded V4.1 weights: with `keep_quantized` the tensors `load_v41` keeps FP8 / FP4 at their
    stored size (values and scales), the rest at `dtype` (fp32 ones at 4 bytes); the Engram tables FP8 always.
    `share(name)`: the fraction of each tensor this rank keeps (several ranks)."""
    from deepinfer.model.v41_weights import tensor_specs
    from deepinfer.model.weights import FP32
    from deepinfer.weights.v41_formats import loaded_format_v41, stored_bytes

    model = torch.empty((), dtype=dtype).element_size()
    total = 0
    for name, spec in tensor_specs(cfg).items():
        fmt = loaded_format_v41(name, cfg, keep_quantized)
        if fmt is None:
            size = math.prod(spec.shape) * (4 if spec.kind == FP32 else model)
        else:
            size = stored_bytes(spec.shape, fmt)
        total += size if share is None else int(size * share(name))
    return total


def assemble_v41(cfg: V41Config, model_dir: Path, tokenizer_path: Path, backend: Backend, dtype: torch.dtype,
                 env: Env, opts: EngineOptions, comm=None, eplb=None) -> Assembled:
    """`comm`: one rank of several (with expert parallelism it reads and holds its own routed experts, `eplb`
    balancing them), as `assemble_v4`."""
    from deepinfer.model.v41 import DeepseekV41
    from deepinfer.model.v41_cache import unit_bytes
    from deepinfer.model.v41_weights import V41Weights, tensor_specs
    from deepinfer.parallel.engram import exchange_bytes
    from deepinfer.runtime.v41_steps import V41SlotCache, V41Steps
    from deepinfer.weights.v41_formats import quantization_config
    from deepinfer.weights.v41_loader import load_v41

    if backend.name not in V41_BACKENDS:  # check_v41_backend ran first; this guards a direct call
        raise ConfigError(f"backend {backend.name!r}: DeepSeek-V4.1 runs on the backends {V41_BACKENDS} for now")
    hasher = engram_hasher(cfg, tokenizer_path)
    # as V4: the checkpoint's FP8 / FP4 tensors stay quantized with `auto` where the model takes them so (the
    # reference ops dequantize one tensor at a time, the kernels read them as stored); `none` dequantizes at load
    keep = opts.quantization == "auto"
    placement = share = split = None
    if comm is not None:  # where the routed experts go, before anything is read: a rank reads its own only
        from deepinfer.parallel.engram import table_split
        from deepinfer.parallel.shard import expert_placement, experts_to_read, rank_model_v41, rank_share_v41

        placement = expert_placement(cfg, comm, eplb)
        share = rank_share_v41(cfg, comm.rank, placement)
        split = table_split(cfg, comm.rank)  # its rows of the Engram tables, when the ranks split them
    weights_size = v41_weight_bytes(cfg, dtype, keep, share)
    ahead = opts.lookahead if opts.draft_layers else 0  # speculative decoding: draft rows a verify step may drop

    def unit(spec) -> tuple[int, int]:
        return unit_bytes(cfg, spec.max_tokens, spec.block_tokens, dtype, spec.lookahead, spec.draft_layers)

    def cache_bytes(spec) -> int:
        block, slot = unit(spec)
        return (spec.num_blocks + 1) * block + (spec.max_seqs + 1) * slot  # + the scratch block and slot

    _fit(cfg, dtype, backend, opts, weights_size, cache_bytes)
    if backend.kernel_target is not None:
        check_writable_dir(env.cache_dir, "the kernel cache (DEEPINFER_CACHE_DIR)")
    clock = Phases()
    ready_kernels(backend, cfg, dtype, env, opts, clock, comm, eplb)  # before the weights: a failing kernel stops early
    bar = progress_bar(opts.show_progress, "loading weights", total=len(tensor_specs(cfg)))
    ckpt = load_v41(model_dir, cfg, dtype, backend.device, keep_quantized=keep,
                    progress=None if bar is None else bar.update,
                    experts_of=None if placement is None else experts_to_read(placement, comm.rank.rank),
                    table_rows=None if split is None else split.rows)
    if bar is not None:
        bar.close()
    shard = None
    if placement is not None:  # this rank's expert slots, read so; the weights keep meta stand-ins of the whole shape
        from deepinfer.parallel.experts import ExpertShard
        from deepinfer.parallel.shard import take_experts

        gate_up, down = take_experts(ckpt.tensors, cfg, placement, comm.rank.rank, whole=False, module="ffn")
        shard = ExpertShard(backend.ops, comm, placement, gate_up, down, eplb)  # the layout one process runs
    weights = V41Weights.from_tensors(cfg, ckpt.tensors, None if split is None else split.rows)
    if comm is None:
        model = DeepseekV41(cfg, weights, backend.ops, hasher)
    else:  # its heads cut from the whole weights, its experts in `shard` when split
        model = rank_model_v41(cfg, weights, backend.ops, hasher, comm, shard)
    clock.done("weights", f"{weights_size / GIB:.2f} GiB on {backend.device}")
    spec = cache_spec(cfg, backend.memory(), dtype, opts.max_num_seqs, opts.max_model_len, opts.num_blocks,
                      opts.gpu_memory_utilization, unit=unit, draft_layers=opts.draft_layers, lookahead=ahead,
                      reserve=draft_graph_bytes(cfg, opts.max_num_seqs, opts.draft_layers, dtype, ahead)
                      + exchange_bytes(cfg, split, 1 if comm is None else comm.dp, opts.max_prefill_tokens))
    cache = V41SlotCache(cfg, spec, dtype, backend.device)
    clock.done("cache allocation", f"{cache.num_bytes() / GIB:.2f} GiB")
    kept = keep and quantization_config(cfg.raw) is not None
    report = (f"memory on {backend.device}: weights {weights_size / GIB:.2f} GiB "
              + ("(FP8/FP4 kept)" if kept else "(dense ones dequantized)")
              + f", cache {cache.num_bytes() / GIB:.2f} GiB ({spec.num_blocks} blocks of {spec.block_tokens} "
              f"positions, FP4 latents and index keys)")
    steps = V41Steps(model, cache, backend.capture if comm is None else None)  # several ranks: eager, as V4's
    if comm is not None and comm.lockstep:
        from deepinfer.parallel.lockstep import EagerLockstepSteps

        steps = EagerLockstepSteps(steps, model, comm)
    return Assembled(model, cache, steps, weights_size, report)


class Phases:
    """Start-up phases, each logged at INFO with its seconds as it ends (`deepinfer: start-up: NAME S s (NOTE)`)."""

    def __init__(self) -> None:
        self.last = time.perf_counter()

    def done(self, name: str, note: str = "") -> None:
        now = time.perf_counter()
        log.info("deepinfer: start-up: %s %.2f s%s", name, now - self.last, f" ({note})" if note else "")
        self.last = now


def progress_bar(enabled: bool, desc: str, total: int | None = None, unit: str | None = None):
    if not enabled:
        return None
    from tqdm import tqdm

    unit = unit or ("req" if desc == "requests" else "tensor")
    return tqdm(total=total, desc=desc, unit=unit, leave=False, dynamic_ncols=True)
