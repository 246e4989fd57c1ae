"""Parallel kernel builds run in `python -m codegen.worker` processes: never a re-run of the caller's script,
results in input order, a dying worker is a 'failed' result (not a hang), and no worker outlives a build."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

from codegen.driver import build_all, request_spec
from tilekernels.kernels import request
from tilekernels.ops import rms_norm

REPO = Path(__file__).resolve().parents[2]


def items(*dims: int) -> list[tuple]:
    return [("rms_norm", "rms_norm", rms_norm.Variant(d, "float32")) for d in dims]


def worker_children() -> list[int]:
    """Live child processes of this process that are build workers."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            cmd = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and b"codegen.worker" in cmd:
            found.append(int(entry.name))
    return found


def processes_with_env(token: str) -> list[int]:
    """Live processes whose environment holds `token` (workers inherit their parent's environment)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if token.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def noisy_request(op, kernel, variant):
    """A `make_request` that prints on stdout (Python and fd level), as TileLang does; the protocol survives."""
    print("noise on sys.stdout")
    os.write(1, b"noise on fd 1\n")
    return request(op, kernel, variant)


def crashing_request(op, kernel, variant):
    """Kills the worker for dim=72 (os._exit) and dim=88 (SystemExit); builds the rest normally."""
    if variant.dim == 72:
        sys.stderr.write("about to crash hard\n")
        sys.stderr.flush()
        os._exit(3)
    if variant.dim == 88:
        raise SystemExit("worker told to exit")
    return noisy_request(op, kernel, variant)


def test_parallel_builds_then_cache_hits_in_input_order(tmp_path):
    work = items(64, 96, 48)
    seen = []
    first = build_all("c", work, request, tmp_path, jobs=2, on_result=seen.append)
    assert [r.status for r in first] == ["built"] * 3, [(r.status, r.notes) for r in first]
    assert [r.variant["dim"] for r in first] == [64, 96, 48]
    assert sorted(r.variant["dim"] for r in seen) == [48, 64, 96]  # on_result once per item, as they complete
    second = build_all("c", work, "tilekernels.kernels:request", tmp_path, jobs=2)
    assert [(r.status, r.variant["dim"]) for r in second] == [("cached", 64), ("cached", 96), ("cached", 48)]
    assert [r.key for r in second] == [r.key for r in first]
    assert [r.path for r in second] == [r.path for r in first]
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert sorted(e["variant"]["dim"] for e in manifest["entries"]) == [48, 64, 96]
    assert worker_children() == []


def seed_entries(source: Path, dest: Path) -> None:
    """Copy the published kernel entries (`codegen.cache.read_meta`) of cache target directory `source` into `dest`:
    not its manifest or index, nor a build still staging."""
    import shutil

    from codegen import cache

    for entry in source.glob("*/*"):
        if cache.read_meta(entry) is not None:
            shutil.copytree(entry, dest / entry.parent.name / entry.name)


def test_a_script_without_a_main_guard_is_not_rerun_by_the_workers(tmp_path, c_kernel_cache):
    """`deepinfer.LLM(...)` at a script's top level, kernels on the `c` target, a cache whose manifest lists none of
    them: every kernel is handed to parallel build workers at start, the script's top level runs once, and it
    finishes. The cache is the session's c kernel cache while nothing is in it yet (the suite runs this module
    before the other c-target tests), so that the default model's kernels built here are hits for them
    (tests/test_batch_invariance.py's c case: 19 of its 44 kernels); otherwise a fresh one seeded with the session
    cache's built entries but not its manifest (the workers still start and take every kernel, and find those
    built: under pytest-xdist another worker fills the session cache first, and the 44 kernels were built twice)."""
    if any(c_kernel_cache.iterdir()):
        cache = tmp_path / "cache"
        seed_entries(c_kernel_cache / "c", cache / "c")
    else:
        cache = c_kernel_cache
    script = tmp_path / "user_script.py"
    script.write_text(textwrap.dedent("""\
        import deepinfer

        print("TOP-LEVEL-RAN", flush=True)
        llm = deepinfer.LLM(backend="c", max_num_seqs=2, max_model_len=256)
        out = llm.generate([{"token_ids": [1, 2, 3]}],
                           deepinfer.SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True))
        print("TOKENS", len(out[0].token_ids), flush=True)
        """))
    token = f"DEEPINFER_WORKER_TEST_{uuid.uuid4().hex}"
    env = {**os.environ, "DEEPINFER_TEST_TOKEN": token, "DEEPINFER_CACHE_DIR": str(cache)}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("TOP-LEVEL-RAN") == 1, proc.stdout
    assert "TOKENS 3" in proc.stdout, proc.stdout + proc.stderr
    assert "bootstrapping phase" not in proc.stderr
    manifest = json.loads((cache / "c" / "manifest.json").read_text())
    assert len(manifest["entries"]) > 10  # the tiny model's kernels were built (by the workers) into the cache
    assert processes_with_env(token) == []  # no worker outlived the script


def test_a_dying_worker_fails_its_item_and_the_rest_still_build(tmp_path):
    work = items(72, 80, 88)
    seen = []
    results = build_all("c", work, "tests.codegen.test_workers:crashing_request", tmp_path, jobs=2,
                        on_result=seen.append)
    assert [r.status for r in results] == ["failed", "built", "failed"], [r.notes for r in results]
    assert len(seen) == 3
    hard, soft = results[0], results[2]
    assert "rms_norm.rms_norm[dim=72" in hard.notes["error"]
    log = Path(hard.path).read_text()
    assert "exited with code 3" in log and "about to crash hard" in log and "dim=72" in log
    assert "worker told to exit" in Path(soft.path).read_text()
    assert worker_children() == []


def test_make_request_travels_by_name_and_an_unimportable_one_builds_in_process(tmp_path, caplog):
    assert request_spec(request) == "tilekernels.kernels:request"
    assert request_spec("tests.codegen.test_workers:noisy_request") == "tests.codegen.test_workers:noisy_request"
    assert request_spec(lambda *a: request(*a)) is None

    def nested(*a):
        return request(*a)

    assert request_spec(nested) is None
    with caplog.at_level("WARNING", logger="deepinfer.codegen"):
        results = build_all("c", items(64, 96), nested, tmp_path, jobs=4)
    assert [r.status for r in results] == ["built", "built"]
    assert "building in this process" in caplog.text
    assert worker_children() == []
