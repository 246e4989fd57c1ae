"""Start-up time to the first token of `deepinfer run offline` on the embedded default model: cold (an empty
kernel cache: every kernel built) and warm (every kernel cached), with the start-up phases the run logs.

    python -m benchmarks.startup --backend nvidia            # cpu | c | nvidia (or any --backend name)
    python -m benchmarks.startup --backend c --load-jobs 1,2,4,8 --out startup.json

Each run is `python -m deepinfer run offline --prompt ... --max-new-tokens N --temperature 0` in a fresh process,
with DEEPINFER_CACHE_DIR set to `--cache-dir` (default: a fresh temporary directory, so the first run is cold).
"first token" is what the CLI reports: seconds from the process's start (interpreter start-up included) to the
first sampled token; "wall" is the whole process, as timed here. `--load-jobs` also times loading the model's
kernel plan from the warm cache with each number of threads (`Launcher.preload`, one fresh process each).
A table goes to stdout, then the JSON (also written to `--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIRST_TOKEN = re.compile(r"first token ([0-9.]+|nan) s after start")
PHASE = re.compile(r"^deepinfer: start-up: (?P<name>[a-z ]+?) (?P<s>[0-9.]+) s(?: \((?P<note>.*)\))?$", re.M)
PREFILL = re.compile(r"prefill ([0-9.]+) tok/s, decode ([0-9.]+) tok/s")
COMPILED = re.compile(r"deepinfer: compiling (\d+) kernel")


def run_offline(backend: str, cache_dir: Path, prompt: str, max_new_tokens: int, timeout: float) -> dict:
    """One `deepinfer run offline` process: its wall time, first-token time and start-up phases."""
    cmd = [sys.executable, "-m", "deepinfer", "run", "offline", "--backend", backend, "--prompt", prompt,
           "--max-new-tokens", str(max_new_tokens), "--temperature", "0"]
    env = {**os.environ, "DEEPINFER_CACHE_DIR": str(cache_dir), "PYTHONPATH": _pythonpath()}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - start
    err = proc.stderr.replace("\r", "\n")
    if proc.returncode != 0:
        raise SystemExit(f"`{' '.join(cmd)}` exited {proc.returncode}:\n{err[-4000:]}")
    ttft = FIRST_TOKEN.search(err)
    rates = PREFILL.search(err)
    compiled = COMPILED.search(err)
    phases = {m["name"]: {"s": float(m["s"]), "note": m["note"] or ""} for m in PHASE.finditer(err)}
    first = float(ttft.group(1)) if ttft else None
    return {
        "first_token_s": first,
        "wall_s": round(wall, 3),
        "phases": phases,
        # engine set-up and the first request's prefill: the time to the first token no phase covers
        "outside_phases_s": None if first is None else round(first - sum(p["s"] for p in phases.values()), 2),
        "kernels_compiled": int(compiled.group(1)) if compiled else 0,
        "prefill_tok_s": float(rates.group(1)) if rates else None,
        "decode_tok_s": float(rates.group(2)) if rates else None,
    }


def _pythonpath() -> str:
    """The checkout first, so `-m deepinfer` and `-m benchmarks.startup` run this tree's code."""
    return os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])


PROBE = """
import sys, time
from pathlib import Path
from deepinfer.options import resolve_dtype
from deepinfer.runtime.backend import select
from deepinfer.tiny import tiny_config
from deepinfer.compile.plan import kernel_plan
backend = select(sys.argv[1], Path(sys.argv[2]))
if backend.launcher is None:  # the reference backend: no kernels
    print("PROBE 0 0")
    sys.exit(0)
dtype = str(resolve_dtype("auto", backend.target.default_dtype)).removeprefix("torch.")
plan = kernel_plan(tiny_config(), dtype)
start = time.perf_counter()
loaded = backend.launcher.preload(plan, int(sys.argv[3]))
print(f"PROBE {loaded} {time.perf_counter() - start:.4f}")
"""


def probe_load(backend: str, cache_dir: Path, jobs: int, timeout: float) -> dict:
    """Seconds to load the default model's kernel plan from the warm cache with `jobs` threads (a fresh process)."""
    env = {**os.environ, "DEEPINFER_CACHE_DIR": str(cache_dir), "PYTHONPATH": _pythonpath()}
    proc = subprocess.run([sys.executable, "-c", PROBE, backend, str(cache_dir), str(jobs)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    m = re.search(r"^PROBE (\d+) ([0-9.]+)$", proc.stdout, re.M)
    if proc.returncode != 0 or m is None:
        raise SystemExit(f"the load probe ({jobs} threads) failed:\n{proc.stderr[-4000:]}")
    return {"jobs": jobs, "kernels": int(m.group(1)), "seconds": float(m.group(2))}


def table(result: dict) -> str:
    runs = result["runs"]
    names = list(dict.fromkeys(n for r in runs for n in r["phases"]))
    lines = [f"backend {result['backend']} (default model, {result['max_new_tokens']} new tokens), cache "
             f"{result['cache_dir']}",
             "| " + " | ".join(["run", "first token s", "wall s", "kernels compiled", *(f"{n} s" for n in names),
                                "outside phases s"]) + " |",
             "|---" * (5 + len(names)) + "|"]
    for r in runs:
        phases = [f"{r['phases'][n]['s']:.2f}" if n in r["phases"] else "-" for n in names]
        ttft = "-" if r["first_token_s"] is None else f"{r['first_token_s']:.2f}"
        rest = "-" if r["outside_phases_s"] is None else f"{r['outside_phases_s']:.2f}"
        lines.append("| " + " | ".join([r["run"], ttft, f"{r['wall_s']:.2f}", str(r["kernels_compiled"]), *phases, rest])
                     + " |")
    for p in result.get("load_jobs", []):
        lines.append(f"load of the plan from the warm cache, {p['jobs']} thread(s): {p['kernels']} kernels in "
                     f"{p['seconds']:.2f} s")
    return "\n".join(lines)


def first_token_figures(runs: list[dict]) -> dict:
    """Cold and warm first-token seconds; a "warm" run that compiled kernels had no warm cache and is left out."""
    warm = [r["first_token_s"] for r in runs if r["run"].startswith("warm") and not r["kernels_compiled"]
            and r["first_token_s"] is not None]
    cold = next((r["first_token_s"] for r in runs if r["run"] == "cold"), None)
    return {"cold_first_token_s": cold,
            "warm_first_token_s": min(warm) if warm else None,  # the least disturbed run
            "warm_median_first_token_s": statistics.median(warm) if warm else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="nvidia", help="cpu | c | nvidia (any `--backend` name) [nvidia]")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="kernel cache to use (default: a fresh temporary one; an existing one makes 'cold' warm)")
    parser.add_argument("--warm-runs", type=int, default=2, help="warm runs after the cold one [2]")
    parser.add_argument("--skip-cold", action="store_true", help="only warm runs (the cache must hold the kernels)")
    parser.add_argument("--prompt", default="Hello, who are you?")
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--load-jobs", default="", help="comma-separated thread counts to time the kernel load with")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per process [1800]")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)

    tmp = tempfile.TemporaryDirectory(prefix="deepinfer-startup-") if args.cache_dir is None else None
    cache_dir = Path(tmp.name) if tmp is not None else args.cache_dir
    try:
        runs = []
        kinds = ([] if args.skip_cold else ["cold"]) + [f"warm{i + 1}" for i in range(args.warm_runs)]
        for kind in kinds:
            r = run_offline(args.backend, cache_dir, args.prompt, args.max_new_tokens, args.timeout)
            runs.append({"run": kind, **r})
            print(f"{kind}: first token {r['first_token_s']} s after start, wall {r['wall_s']} s", file=sys.stderr)
            if kind.startswith("warm") and r["kernels_compiled"]:
                print(f"{kind} compiled {r['kernels_compiled']} kernels (the cache did not hold them): "
                      "not counted as a warm start", file=sys.stderr)
        jobs = [int(j) for j in args.load_jobs.split(",") if j.strip()]
        probes = [probe_load(args.backend, cache_dir, j, args.timeout) for j in jobs]
    finally:
        if tmp is not None:
            tmp.cleanup()
    result = {"backend": args.backend, "cache_dir": str(args.cache_dir or "(temporary)"), "prompt": args.prompt,
              "max_new_tokens": args.max_new_tokens, **first_token_figures(runs), "runs": runs, "load_jobs": probes}
    print(table(result))
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
