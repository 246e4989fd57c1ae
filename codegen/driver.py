"""Build many kernels for one target, in parallel, with progress; write the target's manifest.json."""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import backends
from codegen.compiler import Compiler, Request, deepinfer_version, variant_dict
from codegen.errors import CompileError
from codegen.worker import decode, encode, resolve

MANIFEST = "manifest.json"
REPO_ROOT = Path(__file__).resolve().parents[1]  # holds codegen/, backends/, tilekernels/, deepinfer/

log = logging.getLogger("deepinfer.codegen")


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
    """Build one (op, kernel, variant) item (in a worker process, or in this one when jobs <= 1)."""
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
    make_request: Callable[..., Request] | str,
    cache_dir: Path,
    jobs: int = 1,
    on_result: Callable[[Result], Any] | None = None,
) -> list[Result]:
    """Build every item; results in the order of `items`, `on_result` called (in this thread) as each
    completes. With jobs > 1 the builds run in `jobs` worker processes started as `python -m codegen.worker`
    (never a fork or multiprocessing spawn of the caller, so the caller's script is not re-run);
    `make_request` is then passed by name ("module:function"), so it must be a module-level function or such
    a string. A worker that dies gives its item a 'failed' result whose log holds the worker's stderr tail."""
    target_name = backends.get(target_name).name  # an unknown name fails here, before any work
    cache_dir = Path(cache_dir)
    jobs = max(1, min(jobs, len(items)))
    spec = request_spec(make_request) if jobs > 1 else None
    if jobs > 1 and spec is None:
        log.warning("build_all: %r is not importable by name; building in this process (jobs=1)", make_request)
        jobs = 1
    results: dict[int, Result] = {}
    if jobs <= 1:
        fn = resolve_request(make_request) if isinstance(make_request, str) else make_request
        for i, item in enumerate(items):
            results[i] = build_one(target_name, str(cache_dir), fn, item)
            if on_result:
                on_result(results[i])
    else:
        _WorkerPool(target_name, str(cache_dir), spec, jobs).run(items, results, on_result)
    ordered = [results[i] for i in range(len(items))]
    write_manifest(cache_dir / target_name, ordered)
    return ordered


def request_spec(make_request: Callable[..., Request] | str) -> str | None:
    """`make_request` as an importable "module:qualname" string; None for a lambda, a nested function, or one
    defined in `__main__` (a worker must not import the caller's script)."""
    if isinstance(make_request, str):
        return make_request
    module, qualname = getattr(make_request, "__module__", None), getattr(make_request, "__qualname__", "")
    if not module or module == "__main__" or not qualname or "<" in qualname:
        return None
    spec = f"{module}:{qualname}"
    try:
        return spec if resolve_request(spec) is make_request else None
    except (ImportError, AttributeError):
        return None


def resolve_request(spec: str) -> Callable[..., Request]:
    return resolve(spec)


def worker_env() -> dict[str, str]:
    """The caller's environment, with this checkout first on PYTHONPATH (a checkout need not be installed)."""
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO_ROOT) not in paths:
        paths.insert(0, str(REPO_ROOT))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


class _RemoteTraceback(Exception):
    def __init__(self, tb: str):
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f"\n(in a build worker)\n{self.tb}"


class _Worker:
    """One `python -m codegen.worker` process: JSON lines over its stdin/stdout; stderr kept as a tail."""

    TAIL_LINES = 60

    def __init__(self, env: dict[str, str]):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "codegen.worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, env=env, text=True, encoding="utf-8", errors="replace", bufsize=1)
        self.tail: deque[str] = deque(maxlen=self.TAIL_LINES)
        self._drain = threading.Thread(target=self._read_stderr, daemon=True, name=f"build-worker-{self.proc.pid}")
        self._drain.start()

    def _read_stderr(self) -> None:
        try:
            for line in self.proc.stderr:
                self.tail.append(line)
        except (OSError, ValueError):
            pass

    def ask(self, msg: dict) -> dict | None:
        """Send one item; its reply, or None when the worker died (or broke the protocol)."""
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (OSError, ValueError):
            return None
        try:
            reply = json.loads(line) if line else None
        except ValueError:
            self.tail.append(f"(unexpected line on the protocol stream: {line[:200]!r})\n")
            return None
        return reply if isinstance(reply, dict) and reply.get("id") == msg["id"] else None

    def reap(self) -> str:
        """After a failed `ask`: stop the process; its exit status and stderr tail, as text."""
        self.kill()
        self._drain.join(timeout=5)
        code = self.proc.returncode
        return f"build worker pid {self.proc.pid} exited with code {code}\n--- stderr tail ---\n" + "".join(self.tail)

    def close(self) -> None:
        """Stdin closed: the worker finishes and exits; killed if it does not within a few seconds."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()
        self._drain.join(timeout=5)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


class _WorkerPool:
    """`jobs` slots, each a thread driving one worker process, taking the next item as its worker frees up.
    A worker that dies fails its item and is replaced for the next one."""

    def __init__(self, target_name: str, cache_dir: str, spec: str, jobs: int):
        self.target_name, self.cache_dir, self.spec, self.jobs = target_name, cache_dir, spec, jobs
        self.env = worker_env()
        self.todo: queue.Queue = queue.Queue()
        self.done: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.live: set[_Worker] = set()

    def run(self, items: list[tuple], results: dict[int, Result], on_result: Callable[[Result], Any] | None) -> None:
        for i, item in enumerate(items):
            self.todo.put((i, item))
        threads = [threading.Thread(target=self._slot, daemon=True, name=f"build-slot-{n}") for n in range(self.jobs)]
        for t in threads:
            t.start()
        try:
            while len(results) < len(items):
                try:
                    i, result, error = self.done.get(timeout=0.5)
                except queue.Empty:
                    if not any(t.is_alive() for t in threads) and self.done.empty():
                        raise RuntimeError("build workers stopped before every item had a result") from None
                    continue
                if error is not None:
                    exc, tb = error
                    raise exc from (_RemoteTraceback(tb) if tb else None)
                results[i] = result
                if on_result:
                    on_result(result)
        finally:
            self.stop.set()
            if len(results) < len(items):  # aborted: do not wait for builds in flight
                with self.lock:
                    for w in list(self.live):
                        w.kill()
            for t in threads:
                t.join(timeout=30)

    def _slot(self) -> None:
        worker: _Worker | None = None
        try:
            while not self.stop.is_set():
                try:
                    i, item = self.todo.get_nowait()
                except queue.Empty:
                    break
                if worker is None:
                    worker = _Worker(self.env)
                    with self.lock:
                        self.live.add(worker)
                        if self.stop.is_set():  # aborted while it started
                            break
                start = time.perf_counter()
                reply = worker.ask({"id": i, "target": self.target_name, "cache_dir": self.cache_dir,
                                    "make_request": self.spec, "item": encode(item)})
                if reply is None:
                    detail = worker.reap()
                    with self.lock:
                        self.live.discard(worker)
                    worker = None
                    if not self.stop.is_set():
                        self.done.put((i, self._crashed(item, detail, time.perf_counter() - start), None))
                elif "error" in reply:
                    self.done.put((i, None, (decode(reply["error"]), reply.get("traceback", ""))))
                    break
                else:
                    self.done.put((i, decode(reply["result"]), None))
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which re-raises it
            import traceback

            self.done.put((None, None, (exc, traceback.format_exc())))
        finally:
            if worker is not None:
                worker.close()
                with self.lock:
                    self.live.discard(worker)

    def _crashed(self, item: tuple, detail: str, seconds: float) -> Result:
        op, kernel, variant = item
        vd = variant_dict(variant)
        label = f"{op}.{kernel}[{','.join(f'{k}={v}' for k, v in vd.items())}]"
        text = f"build worker died while building {label} for {self.target_name}\n{detail}"
        log_dir = Path(self.cache_dir) / self.target_name / "failed"
        try:
            log_dir.mkdir(parents=True, exist_ok=True)
            log_path = str(log_dir / f"worker-crash.{op}.{kernel}.{os.getpid()}.{int(time.time() * 1000)}.log")
            Path(log_path).write_text(text)
        except OSError as exc:
            log_path = f"(no log: {exc})"
        tail = detail.splitlines()[-5:]
        return Result(op, kernel, vd, "failed", log_path, seconds,
                      {"error": f"build worker died while building {label}: " + " | ".join(tail)})


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


def unlisted(root: Path, items: Iterable[tuple]) -> list[tuple]:
    """The (op, kernel, variant) items the manifest under `root` (a target's cache directory) does not list."""

    def key(op: str, kernel: str, variant: dict) -> tuple[str, str, str]:
        return op, kernel, json.dumps(variant, sort_keys=True)

    listed = {key(e["op"], e["kernel"], e["variant"]) for e in read_manifest(root).get("entries", [])}
    return [it for it in items if key(it[0], it[1], variant_dict(it[2])) not in listed]


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
