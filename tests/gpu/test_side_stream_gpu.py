"""The decode step with its second stream (`backends/nvidia/side_stream.py`) against the same step on one stream:
the same kernels read and write the same rows in the same dependency order, so every logit is bit-identical, in
CUDA-graph replay and eagerly, over enough steps that the compressors close windows and the indexer picks."""

from __future__ import annotations

import pytest
import torch

from backends.nvidia.graphs import CudaGraphs
from backends.nvidia.side_stream import SideStream
from deepinfer.config import ModelConfig
from deepinfer.model.model import DeepseekV4
from deepinfer.model.weights import ModelWeights
from deepinfer.runtime.cache import CacheSpec, PagedCache
from deepinfer.runtime.graph import DecodeGraphs
from deepinfer.tiny import random_tensors
from tests.helpers import TINY_A

pytestmark = pytest.mark.gpu
PROMPTS = (200, 37, 140)  # a prefilled sequence each; decode crosses CSA (4) boundaries and an HCA (128) one
STEPS = 24


@torch.inference_mode()
def decode_logits(cfg, weights, ops, overlap: bool, graphs: bool) -> list[torch.Tensor]:
    """Prefill PROMPTS, then STEPS decode steps of all three rows fed fixed tokens: each step's logits."""
    model = DeepseekV4(cfg, weights, ops, side=SideStream(torch.device("cuda")) if overlap else None)
    cache = PagedCache(cfg, CacheSpec(num_blocks=24, max_seqs=4, max_blocks_per_seq=6), torch.bfloat16, "cuda")
    g = torch.Generator().manual_seed(1)
    seqs = []
    for n in PROMPTS:
        seq = cache.admit()
        assert cache.grow(seq, n + STEPS + 1)
        ids = torch.randint(2, cfg.vocab_size, (n,), generator=g).cuda()
        model.prefill(cache, ids, torch.arange(n, device="cuda"), [(seq, 0, n)], torch.tensor([n - 1], device="cuda"))
        seqs.append(seq)
    step = DecodeGraphs(model, cache, 4, CudaGraphs() if graphs else None)
    out = []
    for i in range(STEPS):
        ids = torch.randint(2, cfg.vocab_size, (len(seqs),), generator=g).tolist()
        out.append(step.run(ids, [s.num_tokens for s in seqs], seqs).clone())
        for s in seqs:
            s.num_tokens += 1
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("graphs", [True, False], ids=["graph", "eager"])
def test_two_streams_give_the_one_stream_logits(cuda, sm90_ops, graphs):
    cfg = ModelConfig.from_dict(TINY_A)
    weights = ModelWeights.from_tensors(cfg, random_tensors(cfg, seed=0, dtype=torch.bfloat16, device="cuda"))
    one = decode_logits(cfg, weights, sm90_ops, overlap=False, graphs=graphs)
    two = decode_logits(cfg, weights, sm90_ops, overlap=True, graphs=graphs)
    assert len(one) == STEPS and all(a.isfinite().all() for a in one)
    for i, (a, b) in enumerate(zip(one, two)):
        assert torch.equal(a, b), f"step {i}: the two-stream logits differ by up to {(a - b).abs().max().item()}"
