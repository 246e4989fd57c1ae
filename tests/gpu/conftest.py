import pytest
import torch

from deepinfer.env import Env


@pytest.fixture(scope="session")
def cuda():
    if not torch.cuda.is_available():
        raise RuntimeError("the gpu tests need an NVIDIA GPU (run `pytest -m gpu` on the GPU host)")
    return torch.device("cuda")


@pytest.fixture(scope="session")
def cache_dir():
    return Env.read().cache_dir


@pytest.fixture(scope="session")
def sm90_ops(cuda, cache_dir):
    from tilekernels.kernels import kernel_table

    return kernel_table("sm90", cache_dir)


def built_sm90_table(items: list[tuple], cache_dir):
    """The sm90 op table after building `items` (op, kernel, variant) in parallel build workers; a failed build
    fails the test with its log's path."""
    import os

    from codegen.driver import build_all
    from tilekernels.kernels import kernel_table, request

    failed = [r for r in build_all("sm90", items, request, cache_dir, jobs=min(16, os.cpu_count() or 1))
              if r.status == "failed"]
    assert not failed, "\n".join(f"{r.label}: {r.path}" for r in failed)
    return kernel_table("sm90", cache_dir)
