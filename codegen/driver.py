"""Build many kernels for one target, in parallel, with progress; write the target's manifest.json."""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import backends
from codegen.compiler import Compiler, Request, deepinfer_version, variant_dict
from codegen.errors import CompileError

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Result:
    op: str
    kernel: str
    variant: dict
    status: str  # built | cached | failed
    path: str  # the artifact dir, or the failure's log
    seconds: float
    notes: dict
    key: str = ""
    stages: dict | None = None

    @property
    def label(self) -> str:
        return f"{self.op}.{self.kernel}[{','.join(f'{k}={v}' for k, v in self.variant.items())}]"


def build_one(target_name: str, cache_dir: str, make_request: Callable[..., Request], item: tuple) -> Result:
    """Build one (op, kernel, variant) item (runs in a worker process)."""
    op, kernel, variant = item
    start = time.perf_counter()
    compiler = Compiler(backends.get(target_name), Path(cache_dir))
    try:
        art = compiler.get(make_request(op, kernel, variant))
    except CompileError as exc:
        return Result(op, kernel, variant_dict(variant), "failed", str(exc.log), time.perf_counter() - start,
                      {"error": str(exc)})
    except ValueError as exc:  # the body refused the variant (a shape its tiles cannot cover): nothing was built
        return Result(op, kernel, variant_dict(variant), "failed", f"(no log: {exc})", time.perf_counter() - start,
                      {"error": str(exc)})
    return Result(op, kernel, variant_dict(variant), "cached" if art.cached else "built", str(art.path),
                  time.perf_counter() - start, art.meta.get("notes", {}), art.key, art.meta.get("stages"))


def build_all(
    target_name: str,
    items: list[tuple],
    make_request: Callable[..., Request],
    cache_dir: Path,
    jobs: int = 1,
    on_result: Callable[[Result], Any] | None = None,
) -> list[Result]:
    """Build every item; results in the order of `items`. Workers are spawned processes (TileLang is not
    fork-safe once imported)."""
    backends.get(target_name)  # an unknown name fails here, before any work
    results: dict[int, Result] = {}
    if jobs <= 1:
        for i, item in enumerate(items):
            results[i] = build_one(target_name, str(cache_dir), make_request, item)
            if on_result:
                on_result(results[i])
    else:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            futures = {pool.submit(build_one, target_name, str(cache_dir), make_request, item): i
                       for i, item in enumerate(items)}
            for fut in as_completed(futures):
                results[futures[fut]] = fut.result()
                if on_result:
                    on_result(results[futures[fut]])
    ordered = [results[i] for i in range(len(items))]
    write_manifest(cache_dir / target_name, ordered)
    return ordered


def write_manifest(root: Path, results: Iterable[Result]) -> Path:
    """Merge the built entries into <root>/manifest.json (atomically replaced)."""
    path = root / MANIFEST
    root.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(root)
    entries = {e["key"]: e for e in manifest.get("entries", [])}
    for r in results:
        if r.status != "failed":
            entries[r.key] = {"op": r.op, "kernel": r.kernel, "variant": r.variant, "key": r.key,
                              "path": os.path.relpath(r.path, root), "stages": r.stages, "notes": r.notes}
    target = backends.get(root.name)
    manifest = {"target": root.name, "description": target.description, "toolchain": target.toolchain(),
                "deepinfer": deepinfer_version(), "entries": sorted(entries.values(), key=lambda e: (e["op"], e["kernel"], e["key"]))}
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(tmp, path)
    return path


def read_manifest(root: Path) -> dict:
    try:
        return json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}


def record_run(root: Path, op: str, target: str, detail: str) -> None:
    """Note that an op's kernels ran on real hardware for `target` and matched the reference (runs.json)."""
    path = root / "runs.json"
    root.mkdir(parents=True, exist_ok=True)
    try:
        runs = json.loads(path.read_text())
    except (OSError, ValueError):
        runs = {}
    runs.setdefault(op, {})[target] = detail
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(runs, indent=1, sort_keys=True))
    os.replace(tmp, path)
