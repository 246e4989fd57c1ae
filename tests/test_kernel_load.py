"""Loading a cached kernel does not trace its body: the cache's index maps the request's source key to the entry,
whose saved signature stands in for the PrimFunc. A miss of any kind (an entry without a signature, a changed
source, an unreadable record, a builder that is not plain data and code) traces, as before, and still computes."""

from __future__ import annotations

import json
import shutil
import sys
from collections import Counter

import pytest
import torch

import backends
import codegen.compiler as compiler_module
import tilekernels.kernels as kernels_module
from backends import tl
from codegen import Compiler, Request
from codegen.compiler import source_key
from tilekernels.kernels import request
from tilekernels.ops import rms_norm

VARIANT = rms_norm.Variant(40, "float32")
ITEM = ("rms_norm", "rms_norm", VARIANT)


REAL_DIGEST = compiler_module._tree_digest.__wrapped__  # the digest without the process-wide memo


@pytest.fixture(scope="module", autouse=True)
def _pinned_sources():
    """Source digests fixed for this module: an edit of the checkout while it runs must not change the keys
    between two loads (the guard that turns the index off after such an edit is tested on its own below)."""
    memo: dict = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compiler_module, "_process_start", lambda: float("inf"))
        mp.setattr(compiler_module, "_tree_digest", lambda name: memo[name] if name in memo else memo.setdefault(name, REAL_DIGEST(name)))
        yield


@pytest.fixture
def traces(monkeypatch):
    """Counts how many kernel bodies are traced (each trace builds the facade once)."""
    count = Counter()
    facade = kernels_module.Facade

    def counting(*args, **kwargs):
        count["traces"] += 1
        return facade(*args, **kwargs)

    monkeypatch.setattr(kernels_module, "Facade", counting)
    return count


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One c kernel built (and indexed) once; each test works on its own copy of the cache."""
    root = tmp_path_factory.mktemp("indexed")
    Compiler(backends.get("c"), root).get(request(*ITEM))
    return root


@pytest.fixture
def cache_dir(built, tmp_path):
    shutil.copytree(built, tmp_path / "cache")
    return tmp_path / "cache"


def check_computes(fn):
    x, w = torch.randn(6, VARIANT.dim), torch.rand(VARIANT.dim) + 0.5
    ops = kernels_module.table(_Fixed(fn))
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), rms_norm.reference(x, w, 1e-6), atol=1e-5, rtol=1e-5)


class _Fixed:
    """A launcher handing out one loaded kernel."""

    def __init__(self, fn):
        self.fn = fn

    def for_op(self, op):
        return lambda kernel, variant: self.fn


def entry_of(cache_dir):
    (entry,) = [p for p in (cache_dir / "c" / "rms_norm.rms_norm").iterdir() if p.is_dir()]
    return entry


def test_a_cached_kernel_loads_without_tracing_and_computes(cache_dir, traces):
    entry = entry_of(cache_dir)
    assert tl.SIGNATURE_FILE in json.loads((entry / "meta.json").read_text())["files"]
    fn = Compiler(backends.get("c"), cache_dir, jit=False).load(request(*ITEM))
    assert traces["traces"] == 0
    check_computes(fn)
    assert traces["traces"] == 0


def test_an_entry_built_before_signatures_traces_once_then_loads_untraced(cache_dir, traces):
    entry = entry_of(cache_dir)
    meta = json.loads((entry / "meta.json").read_text())
    del meta["files"][tl.SIGNATURE_FILE]
    (entry / tl.SIGNATURE_FILE).unlink()
    (entry / "meta.json").write_text(json.dumps(meta))
    shutil.rmtree(cache_dir / "c" / "index")  # an old cache: no index either
    check_computes(Compiler(backends.get("c"), cache_dir, jit=False).load(request(*ITEM)))
    assert traces["traces"] == 1
    (record,) = (cache_dir / "c" / "index").rglob("*.json")
    assert "signature" in json.loads(record.read_text())  # the entry has none: the record carries it
    check_computes(Compiler(backends.get("c"), cache_dir, jit=False).load(request(*ITEM)))
    assert traces["traces"] == 1


def test_a_changed_source_or_an_unreadable_record_is_traced(cache_dir, traces, monkeypatch):
    (record,) = (cache_dir / "c" / "index").rglob("*.json")
    record.write_text("{not json")
    check_computes(Compiler(backends.get("c"), cache_dir, jit=False).load(request(*ITEM)))
    assert traces["traces"] == 1 and json.loads(record.read_text())["key"]  # traced, and recorded again
    record.write_text(json.dumps({"key": "0" * 64}))  # names no entry
    Compiler(backends.get("c"), cache_dir, jit=False).load(request(*ITEM))
    assert traces["traces"] == 2
    digest = compiler_module._tree_digest
    monkeypatch.setattr(compiler_module, "_tree_digest", lambda name: "edited" + (digest(name) or ""))
    check_computes(Compiler(backends.get("c"), cache_dir, jit=False).load(request(*ITEM)))
    assert traces["traces"] == 3


class _Knob:
    def __init__(self, value):
        self.value = value


def _request_with(value) -> Request:
    base = request(*ITEM)
    return Request(base.op, base.kernel, base.variant, lambda target: (value, base.build(target))[1])


def test_the_source_key_covers_the_builder_and_refuses_what_it_cannot_read():
    target = backends.get("c")
    assert source_key(request(*ITEM), target) == source_key(request(*ITEM), target) is not None
    assert source_key(request(*ITEM), target) != source_key(request("rms_norm", "rms_norm",
                                                                    rms_norm.Variant(48, "float32")), target)
    assert source_key(_request_with(1), target) == source_key(_request_with(1), target) is not None
    assert source_key(_request_with(1), target) != source_key(_request_with(2), target)  # a tune knob in a closure
    assert source_key(_request_with(_Knob(1)), target) is None  # an object it cannot reduce to data: always traced
    assert source_key(request(*ITEM), backends.get("sm90")) != source_key(request(*ITEM), target)


def test_a_source_changed_after_the_process_started_is_not_indexed(tmp_path, monkeypatch):
    monkeypatch.setattr(compiler_module, "_process_start", lambda: 0.0)  # everything is newer than this process
    monkeypatch.setattr(compiler_module, "_tree_digest", REAL_DIGEST)
    pkg = tmp_path / "edited_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert REAL_DIGEST("edited_pkg") is None
    assert source_key(request(*ITEM), backends.get("c")) is None
    sys.modules.pop("edited_pkg", None)


def test_the_ffi_loader_leaves_to_tilelang_what_it_cannot_call_alike(tmp_path, monkeypatch):
    (tmp_path / tl.BACKEND_FILE).write_text("cython\n")
    assert tl.load_ffi_library(tmp_path, tl.Signature("{}")) is None  # another execution backend
    (tmp_path / tl.BACKEND_FILE).write_text("tvm_ffi\n")
    assert tl.load_ffi_library(tmp_path, tl.Signature('{"a": "tilelang_out_idx"}')) is None  # outputs it allocates
    with pytest.raises(ValueError):
        tl.Signature("not json")


LIGHT_PROBE = """
import sys
from pathlib import Path
import backends
import codegen.compiler as compiler
from codegen import Compiler
from tilekernels.kernels import request
from tilekernels.ops import rms_norm
compiler._process_start = lambda: float("inf")  # a concurrent edit of the checkout must not turn the index off
fn = Compiler(backends.get("sm90"), Path(sys.argv[1]), jit=False).load(
    request("rms_norm", "rms_norm", rms_norm.Variant(256, "bfloat16")))
print("LOADED", type(fn).__name__, "tilelang" in sys.modules, "tvm" in sys.modules)
"""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="building an sm90 library needs nvcc")
def test_an_indexed_sm90_kernel_loads_through_tvm_ffi_without_importing_tilelang(tmp_path):
    """No GPU needed: TVM-FFI loads a CUDA library lazily (the device code is loaded at the first call)."""
    import subprocess

    from codegen.driver import worker_env

    item = ("rms_norm", "rms_norm", rms_norm.Variant(256, "bfloat16"))
    Compiler(backends.get("sm90"), tmp_path).get(request(*item))  # built with nvcc and indexed
    out = subprocess.run([sys.executable, "-c", LIGHT_PROBE, str(tmp_path)], capture_output=True, text=True,
                         env=worker_env(), timeout=300, check=False)
    assert "LOADED FfiKernel False False" in out.stdout, out.stdout + out.stderr


@pytest.mark.gpu
def test_sm90_kernel_loads_untraced_and_runs_in_a_cuda_graph(tmp_path, traces):
    """On the GPU host (`pytest -m gpu tests/test_kernel_load.py`): an sm90 kernel built (nvcc) and indexed loads
    untraced in a fresh compiler, matches the reference, and replays from a CUDA graph on torch's stream."""
    if not torch.cuda.is_available():
        raise RuntimeError("this test needs an NVIDIA GPU")
    item = ("rms_norm", "rms_norm", rms_norm.Variant(256, "bfloat16"))
    sm90 = backends.get("sm90")
    Compiler(sm90, tmp_path).load(request(*item))  # built now, traced once, indexed
    built = traces["traces"]
    fn = Compiler(sm90, tmp_path, jit=False).load(request(*item))
    assert traces["traces"] == built  # loaded untraced
    assert isinstance(fn, tl.FfiKernel)  # through TVM-FFI alone
    ops = kernels_module.table(_Fixed(fn))
    x, w = torch.randn(8, 256, device="cuda").bfloat16(), torch.rand(256, device="cuda") + 0.5
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), rms_norm.reference(x, w, 1e-6), atol=2e-2, rtol=2e-2)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        ops.rms_norm(x, w, 1e-6)  # warm-up on the capture stream
        with torch.cuda.graph(graph, stream=stream):
            out = ops.rms_norm(x, w, 1e-6)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, rms_norm.reference(x, w, 1e-6), atol=2e-2, rtol=2e-2)
