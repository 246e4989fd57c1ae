"""Before a kernel backend runs a model: build, with progress, the kernels its config needs that the target's
manifest (written by `deepinfer compile`) does not list yet; they land in the same cache, so later runs load
them. (A kernel missing for another reason, e.g. a changed op body, is still compiled on first use, logged.)"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from deepinfer.config import ModelConfig
from deepinfer.errors import ConfigError

log = logging.getLogger("deepinfer")


def missing_kernels(target: str, cfg: ModelConfig, dtype: str, cache_dir: Path,
                    quantized: bool | None = None) -> list[tuple]:
    """The (op, kernel, variant) items `cfg` needs that the target's manifest does not list."""
    from codegen.driver import unlisted
    from deepinfer.compile.plan import kernel_plan

    return unlisted(cache_dir / target, kernel_plan(cfg, dtype, quantized))


def build_kernels(target: str, items: list[tuple], cache_dir: Path, jobs: int | None = None,
                  progress: bool = True) -> list:
    """Build `items` in parallel (default min(8, cores) jobs) with a progress bar on stderr; the results."""
    from codegen.driver import build_all
    from tilekernels.kernels import request

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(items), desc=f"compile {target}", unit="kernel", file=sys.stderr, dynamic_ncols=True)
    try:
        return build_all(target, items, request, cache_dir, jobs=jobs or min(8, os.cpu_count() or 1),
                         on_result=None if bar is None else lambda r: bar.update(1))
    finally:
        if bar is not None:
            bar.close()


def prebuild(target: str, cfg: ModelConfig, dtype: str, cache_dir: Path, progress: bool,
             quantized: bool | None = None) -> None:
    """Build the kernels `cfg` needs for `target` that the manifest lacks; a failure names its log."""
    build_missing(target, missing_kernels(target, cfg, dtype, cache_dir, quantized), cache_dir, progress)


def build_missing(target: str, items: list[tuple], cache_dir: Path, progress: bool) -> None:
    """Build `items` (kernels the manifest lacks), logged; ConfigError naming each failure's log."""
    if not items:
        return
    log.info("deepinfer: compiling %d kernel(s) for %s into %s (first run for this model; cached afterwards, "
             "or build ahead with `deepinfer compile --target %s --model DIR`)", len(items), target, cache_dir, target)
    start = time.perf_counter()
    failed = [r for r in build_kernels(target, items, cache_dir, progress=progress) if r.status == "failed"]
    if failed:
        raise ConfigError(f"{len(failed)} kernel(s) failed to compile for {target}: "
                          + "; ".join(f"{r.label} (log {r.path})" for r in failed))
    log.info("deepinfer: compiled %d kernel(s) in %.1f s", len(items), time.perf_counter() - start)
