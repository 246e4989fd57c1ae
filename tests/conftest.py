import hashlib
import os

# One CPU thread per test process (and the processes tests start): the tests' tensors are tiny, where a second
# thread costs more than it gains (tests/test_speculative.py + test_engine.py: 54 s on one thread against 62 s and
# twice the CPU time on two), and the suite's other core is left to the kernel lowerings `Ahead` runs meanwhile.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def _seed_from_test_id(request):
    """A per-test seed derived from the test id, so every test is reproducible on its own."""
    seed = int(hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:8], 16)
    torch.manual_seed(seed)
    yield


@pytest.fixture(scope="session")
def c_kernel_cache(tmp_path_factory):
    """One kernel cache for every test that runs the c target: a kernel built by one module is a cache hit in
    the next (the tiny models' plans overlap). Under pytest-xdist (README.md's `-n 2`) the workers share it: the
    base temporary directory's parent is common to them, and the cache publishes each entry atomically."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        path = tmp_path_factory.getbasetemp().parent / "c-kernels"
        path.mkdir(exist_ok=True)
        return path
    return tmp_path_factory.mktemp("c-kernels")


def _in_background() -> None:
    """A worker of `Ahead`: the lowest CPU priority (the tests running meanwhile keep their core), and no output
    (it would land in whichever test's captured output is open; the work's results carry its errors)."""
    os.nice(19)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)


class Ahead:
    """Slow kernel lowerings queued at the session's start, run by two worker processes at the lowest priority
    (lowering and nvcc are single-threaded: CI's two cores). A test module with such work defines
    `queue_ahead(ahead, items)` (items: its selected tests): it submits the work and returns what its module
    fixture needs, which gets it back through `of` and waits for what is not done yet. The suite's tests run one
    at a time, so the lowerings of tests/tilekernels/test_lowering.py (near the end) run on the core the tests
    before it leave idle; a waiting fixture leaves the workers both cores. Under pytest-xdist every worker
    collects every test but runs only the files it is handed (`--dist loadfile`), so there a module's work is
    queued when its fixture first asks for it (`lazy`), by the one worker that runs it."""

    def __init__(self, tmp_path_factory, lazy: bool = False):
        self.tmp_path_factory = tmp_path_factory
        self.lazy = lazy
        self.queued: dict[str, object] = {}  # module name -> what its queue_ahead returned
        self.waiting: dict[str, list] = {}  # lazy: module name -> its selected tests
        self._pool = None

    def queue(self, module, items: list) -> None:
        """Queue `module`'s work for `items` (its selected tests) now, or (lazy) when its fixture asks."""
        if self.lazy:
            self.waiting[module.__name__] = items
        else:
            self._queue_now(module, items)

    def _queue_now(self, module, items: list) -> None:
        try:
            self.queued[module.__name__] = module.queue_ahead(self, items)
        except Exception as exc:  # noqa: BLE001 - raised again by the module's fixture (`Ahead.of`)
            self.queued[module.__name__] = exc

    def submit(self, fn, *args):
        """A future of fn(*args) in a worker (spawned: TileLang's lowering changes process-wide state)."""
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        if self._pool is None:
            workers = max(1, min(2, os.cpu_count() or 1))
            self._pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_in_background)
        return self._pool.submit(fn, *args)

    def of(self, module) -> object:
        """What `module`'s queue_ahead returned (its error raised again, failing that module's tests alone)."""
        if module.__name__ in self.waiting:
            self._queue_now(module, self.waiting.pop(module.__name__))
        queued = self.queued[module.__name__]
        if isinstance(queued, Exception):
            raise queued
        return queued

    def close(self) -> None:
        if self._pool is not None:  # an interrupted run (-x) drops the queued work, lets the running finish
            self._pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="session", autouse=True)
def ahead(request, tmp_path_factory):
    """The session's `Ahead`, the work of every selected module that has some queued in run order."""
    ahead = Ahead(tmp_path_factory, lazy=bool(os.environ.get("PYTEST_XDIST_WORKER")))
    items = [item for item in request.session.items if getattr(item, "module", None) is not None]
    for module in dict.fromkeys(item.module for item in items):
        if hasattr(module, "queue_ahead"):
            ahead.queue(module, [item for item in items if item.module is module])
    yield ahead
    ahead.close()


def pytest_collection_modifyitems(items):
    """The modules with work queued ahead run last (in their order), giving their workers the whole suite's idle
    core: the tests of tests/compile/test_every_config_lowers.py would otherwise run third, waiting for most of it."""
    items.sort(key=lambda item: hasattr(getattr(item, "module", None), "queue_ahead"))
