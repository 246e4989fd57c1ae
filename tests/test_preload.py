"""Kernels loaded at start: `Launcher.preload` loads each kernel of the model's plan exactly once (threads, callers
racing it, a second preload), and `LLM(...)` on a kernel backend loads the whole plan before the first request,
logging each start-up phase."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import Counter

import pytest
import torch

import backends
from codegen import Compiler
from tilekernels.kernels import Launcher, table
from tilekernels.ops import rms_norm


class RecordingCompiler:
    """Stands in for `codegen.Compiler`: `load` counts its calls per key and returns a distinct callable."""

    def __init__(self, delay: float = 0.0, fail: tuple | None = None):
        self.calls: Counter = Counter()
        self.delay, self.fail = delay, fail
        self._lock = threading.Lock()

    def load(self, req):
        key = (req.op, req.kernel, req.variant)
        with self._lock:
            self.calls[key] += 1
        time.sleep(self.delay)  # long enough for other threads to ask for the same key meanwhile
        if key == self.fail:
            raise RuntimeError(f"cannot load {key}")
        return lambda *args: key


@pytest.fixture(scope="module")
def plan():
    from deepinfer.compile.plan import kernel_plan
    from deepinfer.tiny import tiny_config

    return kernel_plan(tiny_config(), "float32")


@pytest.mark.parametrize("jobs", [1, 4])
def test_preload_loads_the_plan_once_each_and_a_second_preload_nothing(plan, jobs):
    compiler = RecordingCompiler(delay=0.002)
    launcher = Launcher(compiler)
    ticks = []
    assert launcher.preload(plan + plan[:3], jobs, on_loaded=lambda: ticks.append(1)) == len(plan)
    assert compiler.calls == Counter(plan) and len(ticks) == len(plan) and launcher.loaded == len(plan)
    assert launcher.preload(plan, jobs) == 0
    op, kernel, variant = plan[0]
    assert launcher(op, kernel, variant)() == plan[0]  # the memoized callable
    assert compiler.calls == Counter(plan)


def test_callers_racing_the_preload_wait_for_its_load(plan):
    compiler = RecordingCompiler(delay=0.01)
    launcher = Launcher(compiler)
    got: list = []

    def ask_all():
        got.extend(launcher(*key)() == key for key in reversed(plan))

    askers = [threading.Thread(target=ask_all) for _ in range(3)]
    for t in askers:
        t.start()
    loaded = launcher.preload(plan, 4)
    for t in askers:
        t.join()
    assert compiler.calls == Counter(plan)  # every key loaded by exactly one thread
    assert all(got) and len(got) == 3 * len(plan) and 0 < loaded <= len(plan)


def test_a_failed_load_raises_and_is_retried_on_the_next_call(plan):
    compiler = RecordingCompiler(fail=plan[1])
    launcher = Launcher(compiler)
    with pytest.raises(RuntimeError, match="cannot load"):
        launcher.preload(plan, 2)
    assert plan[1] not in launcher._loaded
    compiler.fail = None
    assert launcher(*plan[1])() == plan[1] and compiler.calls[plan[1]] == 2


def test_preload_builds_and_loads_real_c_kernels_once(c_kernel_cache):
    """Two kernels JIT-built by two threads (builds serialized inside the process), then loaded: they compute."""
    compiler = Compiler(backends.get("c"), c_kernel_cache)
    loads = Counter()
    real_load = compiler.load

    def counting_load(req):
        loads[(req.op, req.kernel, req.variant)] += 1
        return real_load(req)

    compiler.load = counting_load
    launcher = Launcher(compiler)
    items = [("rms_norm", "rms_norm", rms_norm.Variant(dim, "float32")) for dim in (48, 72)]
    assert launcher.preload(items, 2) == 2 and launcher.preload(items, 2) == 0
    assert loads == Counter(items)
    ops = table(launcher)
    for dim in (48, 72):
        x, w = torch.randn(5, dim), torch.rand(dim) + 0.5
        torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), rms_norm.reference(x, w, 1e-6), atol=1e-5, rtol=1e-5)
    assert loads == Counter(items)  # running them loaded nothing more


def test_llm_on_a_kernel_backend_loads_the_whole_plan_before_any_request(monkeypatch, tmp_path, plan, caplog):
    import deepinfer.api
    import deepinfer.compile.prebuild
    from deepinfer import LLM
    from deepinfer.runtime.backend import Backend

    compiler = RecordingCompiler()
    launcher = Launcher(compiler)
    built: list = []
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(deepinfer.api, "select_backend", lambda *a, **k: Backend(
        backends.get("c"), torch.device("cpu"), table(launcher), None, launcher))
    monkeypatch.setattr(deepinfer.compile.prebuild, "build_kernels", lambda target, items, *a, **k: built.extend(items) or [])
    with caplog.at_level(logging.INFO, logger="deepinfer"):
        LLM(max_num_seqs=2, max_model_len=256)
    assert built == plan  # an empty cache: the whole plan is built, then loaded once each
    assert compiler.calls == Counter(plan)
    phases = [re.fullmatch(r"deepinfer: start-up: ([a-z ]+?) [0-9.]+ s \(.*\)", r.getMessage())
              for r in caplog.records if r.getMessage().startswith("deepinfer: start-up:")]
    assert [m and m.group(1) for m in phases] == ["tokenizer", "weights", "kernel build check", "kernel load",
                                                  "cache allocation", "graph capture"]


def test_the_plan_is_traced_once_per_config_and_kept_in_the_kernel_cache(tmp_path, monkeypatch, plan):
    import deepinfer.compile.plan as plan_module
    from deepinfer.compile.ready import model_plan
    from deepinfer.tiny import tiny_config

    traced = []
    trace = plan_module.kernel_plan
    monkeypatch.setattr(plan_module, "kernel_plan", lambda *args: traced.append(args) or trace(*args))
    cfg = tiny_config()
    assert model_plan(cfg, "float32", True, tmp_path) == plan and len(traced) == 1
    assert model_plan(cfg, "float32", True, tmp_path) == plan and len(traced) == 1  # read back, not traced
    model_plan(cfg, "bfloat16", True, tmp_path)
    assert len(traced) == 2  # another dtype: another plan
    for kept in (tmp_path / "plans").iterdir():
        kept.write_bytes(b"not a pickle")
    assert model_plan(cfg, "float32", True, tmp_path) == plan and len(traced) == 3  # unreadable: traced again
