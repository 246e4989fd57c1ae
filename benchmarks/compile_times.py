"""`deepinfer compile` over model configs and targets: exit status, kernel count, cold and warm wall time.

    python -m benchmarks.compile_times --targets sm100,ascend --configs default,TINY_A,TINY_B,ODD_A,ODD_B,v4-flash

Each (target, config) compiles into its own empty cache (cold), then again (warm: every kernel cached). The
table goes to stdout (markdown); a run that fails to compile any kernel exits 1 after printing the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLASH = ROOT / "benchmarks" / "configs" / "v4-flash.json"


def config_dirs(names: list[str], where: Path) -> dict[str, Path | None]:
    """name -> model directory holding its config.json (None: the embedded default model)."""
    sys.path.insert(0, str(ROOT))
    from tests import helpers

    out: dict[str, Path | None] = {}
    for name in names:
        if name == "default":
            out[name] = None
            continue
        raw = json.loads(FLASH.read_text()) if name == "v4-flash" else getattr(helpers, name)
        path = where / name
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(raw))
        out[name] = path
    return out


def compile_once(target: str, model: Path | None, cache: Path, jobs: int) -> tuple[int, float, str]:
    cmd = [sys.executable, "-m", "deepinfer", "compile", "--target", target, "--out", str(cache), "--jobs", str(jobs)]
    if model is not None:
        cmd += ["--model", str(model)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    last = (proc.stdout.strip().splitlines() or [proc.stderr.strip()[-300:]])[-1]
    return proc.returncode, time.perf_counter() - start, last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="sm90,sm100,ascend,c")
    parser.add_argument("--configs", default="default,TINY_A,TINY_B,ODD_A,ODD_B,v4-flash")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    failed = False
    print(f"| target | config | status | cold s | warm s | cold result |  ({os.cpu_count()} cores, --jobs {args.jobs})")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        dirs = config_dirs(args.configs.split(","), Path(tmp) / "models")
        for target in args.targets.split(","):
            for name, model in dirs.items():
                cache = Path(tmp) / "cache" / f"{target}-{name}"
                rc, cold, result = compile_once(target, model, cache, args.jobs)
                rc2, warm, _ = compile_once(target, model, cache, args.jobs)
                failed |= bool(rc or rc2)
                print(f"| {target} | {name} | {'ok' if not (rc or rc2) else f'exit {rc}/{rc2}'} | {cold:.1f} | "
                      f"{warm:.1f} | {result} |", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
