import hashlib

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_from_test_id(request):
    """A per-test seed derived from the test id, so every test is reproducible on its own."""
    seed = int(hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:8], 16)
    torch.manual_seed(seed)
    yield


@pytest.fixture(scope="session")
def c_kernel_cache(tmp_path_factory):
    """One kernel cache for every test that runs the c target: a kernel built by one module is a cache hit in
    the next (the tiny models' plans overlap)."""
    return tmp_path_factory.mktemp("c-kernels")
