"""`deepinfer compile` and `deepinfer kernels list`."""

from __future__ import annotations

import os
import time
from pathlib import Path

import click

import backends

TARGETS = backends.COMPILE_TARGETS


@click.command("compile")
@click.option("--target", required=True, help=f"Compile target: {', '.join(TARGETS)}.")
@click.option("--model", "model_dir", type=click.Path(file_okay=False), default=None,
              help="Model directory whose config.json gives the shapes [default: the tiny default model].")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Kernel cache directory [default: $DEEPINFER_CACHE_DIR or ~/.cache/deepinfer/kernels].")
@click.option("--jobs", type=click.IntRange(min=1), default=None, help="Parallel builds [default: CPU count, at most 8].")
@click.option("--ops", default=None, help="Comma-separated op names to build (default: every op the model needs).")
@click.option("--dtype", type=click.Choice(["auto", "bfloat16", "float32"]), default="auto", show_default=True,
              help="Activation dtype of the variants; auto = the target's default (float32 for c, bfloat16 otherwise).")
@click.option("--quantization", type=click.Choice(["auto", "none"]), default="auto", show_default=True,
              help="auto: the FP8/FP4 kernels for a checkpoint whose config declares a quantization_config, as "
                   "`run --quantization auto` loads it; none: the kernels of its dequantized weights.")
@click.option("--batch-invariant/--no-batch-invariant", default=False, show_default=True,
              help="The batch-invariant variants, as `run --batch-invariant` launches them (DeepSeek-V4).")
@click.option("--data-parallel-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --tensor-parallel-size / --enable-expert-parallel: the kernels one rank of that layout "
                   "launches (its heads, its expert slots), as `run` with those flags builds them at start.")
@click.option("--tensor-parallel-size", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--enable-expert-parallel", is_flag=True, default=False)
@click.option("--eplb-redundant-experts", type=click.IntRange(min=0), default=0, show_default=True,
              help="EPLB's redundant expert slots (with --enable-expert-parallel; they change a rank's slot count).")
def compile_cmd(target, model_dir, out_dir, jobs, ops, dtype, quantization, batch_invariant, data_parallel_size,
                tensor_parallel_size, enable_expert_parallel, eplb_redundant_experts) -> None:
    """Lower and build the kernels a model needs for one target, into the artifact cache + manifest."""
    from deepinfer.env import Env
    from deepinfer.errors import DeepInferError

    try:
        backends.compile_target(target)
    except backends.BackendError as exc:
        raise click.BadParameter(str(exc), param_hint="--target") from exc
    try:
        ranks = _ranks(data_parallel_size, tensor_parallel_size, enable_expert_parallel, eplb_redundant_experts)
        _compile(target, model_dir, Path(out_dir) if out_dir else Env.read().cache_dir, jobs, ops, dtype,
                 quantization == "auto", batch_invariant, ranks)
    except DeepInferError as exc:
        raise click.ClickException(str(exc)) from exc


def _ranks(dp: int, tp: int, ep: bool, redundant: int):
    """(ParallelConfig, redundant slots) of a layout of several ranks; None for one process."""
    from deepinfer.errors import ConfigError
    from deepinfer.parallel.config import ParallelConfig

    parallel = ParallelConfig(dp, tp, ep)
    if redundant and not (ep and parallel.world > 1):
        raise ConfigError("--eplb-redundant-experts needs --enable-expert-parallel over several ranks")
    return (parallel, redundant) if parallel.world > 1 else None


def _compile(target: str, model_dir, out_dir: Path, jobs, ops, dtype, quantized: bool = True,
             invariant: bool = False, ranks: tuple | None = None) -> None:
    from deepinfer.config_v41 import read_config
    from deepinfer.errors import ConfigError
    from deepinfer.compile.plan import kernel_plan
    from deepinfer.compile.prebuild import build_kernels
    from deepinfer.env import check_writable_dir
    from deepinfer.tiny import tiny_config

    cfg = read_config(model_dir) if model_dir else tiny_config()  # DeepSeek-V4 or V4.1
    check_writable_dir(out_dir, "--out")
    dtype = backends.get(target).default_dtype if dtype == "auto" else dtype
    if ranks is not None:
        ranks[0].check_model(cfg.num_attention_heads, cfg.o_groups, cfg.n_routed_experts, redundant=ranks[1])
    items = kernel_plan(cfg, dtype, None if quantized else False, invariant, ranks)
    if ops:
        wanted = [o.strip() for o in ops.split(",") if o.strip()]
        known = sorted({op for op, _, _ in items})
        unknown = [o for o in wanted if o not in known]
        if unknown:
            raise ConfigError(f"--ops: unknown op(s) {unknown}; this model's kernel ops are: {', '.join(known)}")
        items = [it for it in items if it[0] in wanted]
    jobs = jobs or min(8, os.cpu_count() or 1)
    layout = "" if ranks is None else f", one rank of {ranks[0].world}"
    click.echo(f"deepinfer compile: {len(items)} kernel(s) for {target} ({model_dir or 'tiny default model'}, "
               f"{dtype}{layout}) into {out_dir}, {jobs} job(s)", err=True)
    start = time.perf_counter()
    results = build_kernels(target, items, out_dir, jobs)
    counts = {s: sum(r.status == s for r in results) for s in ("built", "cached", "failed")}
    for r in results:
        if r.status == "failed":
            click.echo(f"FAILED {r.label}: log {r.path}", err=True)
    notes = sorted({n for r in results for n in r.notes.values() if r.status != "failed"})
    for note in notes:
        click.echo(f"note: {note}", err=True)
    click.echo(f"built {counts['built']}, cached {counts['cached']}, failed {counts['failed']} in "
               f"{time.perf_counter() - start:.1f} s; manifest {out_dir / target / 'manifest.json'}")
    if counts["failed"]:
        raise SystemExit(1)


@click.group("kernels")
def kernels() -> None:
    """The op library and its build state."""


@kernels.command("list")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Kernel cache directory [default: $DEEPINFER_CACHE_DIR or ~/.cache/deepinfer/kernels].")
def list_cmd(out_dir) -> None:
    """Each op, its kernels, the targets it has been built for here and run for (matched its reference)."""
    import json

    from codegen.driver import read_manifest
    from deepinfer.env import Env
    from tilekernels.ops import DECLARED

    root = Path(out_dir) if out_dir else Env.read().cache_dir
    built: dict[str, dict[str, int]] = {}
    for target in TARGETS:
        for entry in read_manifest(root / target).get("entries", []):
            built.setdefault(entry["op"], {}).setdefault(target, 0)
            built[entry["op"]][target] += 1
    try:
        runs = json.loads((root / "runs.json").read_text())
    except (OSError, ValueError):
        runs = {}
    click.echo(f"{'op':22} {'kernels':24} {'built (variants)':34} run")
    for name, op in sorted(DECLARED.items()):
        kernel_names = ",".join([k.name for k in op.kernels] + [f"{u}*" for u in op.uses]) or "reference only"
        b = " ".join(f"{t}:{n}" for t, n in sorted(built.get(name, {}).items())) or "-"
        r = " ".join(sorted(runs.get(name, {}))) or "-"
        click.echo(f"{name:22} {kernel_names:24} {b:34} {r}")
    click.echo(f"(op* = the kernels of another op; cache: {root}; sm100 and ascend are compile-only here)")
