"""The kernels a run needs, ready before its first request: the model's plan (traced once per config and kept in
the kernel cache), what of it the cache lacks built, and all of it loaded into the backend's launcher."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from deepinfer.config import ModelConfig
from deepinfer.config_v41 import V41Config

log = logging.getLogger("deepinfer")
LOAD_JOBS = 1  # threads loading the plan's kernels at start (benchmarks/startup.py measures the choice)


def ready_kernels(backend, cfg: ModelConfig | V41Config, dtype: torch.dtype, env, opts, clock, comm=None,
                  eplb=None) -> None:
    """`backend`: a `runtime.backend.Backend`, `opts`: the run's `assemble.EngineOptions`, `clock`: its `Phases`;
    `comm` / `eplb`: one rank of several (its plan is its own model's: `compile.plan_ranks`).
    On a kernel backend: build the kernels of the model's plan that the target's manifest lacks (with progress,
    into the same cache), then load every kernel of the plan into the backend's launcher, so that the first
    request loads none. Nothing on the reference backend."""
    if backend.kernel_target is None:
        return
    from codegen.driver import unlisted
    from deepinfer.assemble import progress_bar
    from deepinfer.compile.prebuild import build_missing

    target = backend.kernel_target
    ranks = None if comm is None else (comm.rank.parallel, eplb.redundant_experts if eplb is not None else 0)
    plan = model_plan(cfg, str(dtype).removeprefix("torch."), opts.quantization == "auto", env.cache_dir / target,
                      opts.batch_invariant, ranks)
    missing = unlisted(env.cache_dir / target, plan)
    build_missing(target, missing, env.cache_dir, opts.show_progress)
    clock.done("kernel build check", f"{len(plan)} kernels in the plan, {len(missing)} built now")
    if backend.launcher is None:
        return
    jobs = min(LOAD_JOBS, os.cpu_count() or 1)
    bar = progress_bar(opts.show_progress, "loading kernels", total=len(plan), unit="kernel")
    try:
        loaded = backend.launcher.preload(plan, jobs, on_loaded=None if bar is None else bar.update)
    finally:
        if bar is not None:
            bar.close()
    clock.done("kernel load", f"{loaded} kernels, {jobs} thread(s)")


def model_plan(cfg: ModelConfig | V41Config, dtype: str, quantized: bool, root: Path,
               invariant: bool = False, ranks: tuple | None = None) -> list[tuple]:
    """The model's kernel plan (`deepinfer.compile.plan.kernel_plan`: a trace of the model on meta tensors, seconds
    on a large config), kept under `root/plans/` keyed by all it derives from: the config, dtype, quantization,
    the ranks' layout (`ranks`: a `ParallelConfig` and the EPLB redundant slots), torch's version and the source of
    deepinfer and tilekernels (any edit there traces it anew)."""
    import hashlib
    import json
    import pickle

    import deepinfer
    import tilekernels
    from deepinfer.compile.plan import kernel_plan

    layout = None if ranks is None else [vars(ranks[0]), ranks[1]]
    digest = hashlib.sha256(json.dumps([cfg.raw, dtype, quantized, invariant, torch.__version__]
                                       + ([] if layout is None else [layout]), sort_keys=True, default=str).encode())
    for package in (deepinfer, tilekernels):
        base = Path(package.__file__).parent
        for source in sorted(base.rglob("*.py")):
            digest.update(f"{package.__name__}/{source.relative_to(base)}".encode())
            digest.update(source.read_bytes())
    path = root / "plans" / f"{digest.hexdigest()[:32]}.pickle"
    try:  # the kernel cache is trusted as much as the libraries it holds, which are loaded into this process
        return pickle.loads(path.read_bytes())
    except FileNotFoundError:
        pass
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError, TypeError, ValueError) as exc:
        log.info("deepinfer: kernel plan %s unreadable (%s): tracing the model again", path, exc)
    plan = kernel_plan(cfg, dtype, quantized, invariant, *([] if ranks is None else [ranks]))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_bytes(pickle.dumps(plan))
    os.replace(tmp, path)  # atomic: a concurrent start reads the old file or the whole new one
    return plan
