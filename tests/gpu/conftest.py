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
