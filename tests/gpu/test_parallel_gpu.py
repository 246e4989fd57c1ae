"""Several GPUs (NCCL, deepinfer's own launcher, one process per GPU): data-parallel, tensor-parallel and
expert-parallel layouts on a tiny model against one GPU, eager and through decode graphs with the NCCL collectives
captured inside (`DEEPINFER_PARALLEL_GRAPHS=1`): at 2 ranks, and at 4 and 8 where the host has that many GPUs
(`nvidia-h200-x2`, `-x4`, `-x8`; a layout needing more GPUs than the host has is skipped). Run with `pytest -m gpu`
on such a host. Not yet run: no machine with several GPUs has been lent (docs/parallel.md).

Tolerance: the ranks' logits against one GPU's, both bf16, every row forced along the fp32 reference's greedy
tokens; the bound is twice the one-GPU run's own distance from the fp32 reference on the same rows (bf16 rounding:
both runs are that close to the reference; the ranks only change the order of the sums over heads and experts)
plus 1 % of the largest logit (the ranks' partial sums are rounded to bf16 once more a layer)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.api import LLM
from deepinfer.config import ModelConfig
from deepinfer.parallel.config import ParallelConfig
from deepinfer.parallel.pool import RankPool
from deepinfer.runtime.sampling import SamplingParams
from deepinfer.tiny import random_tensors
from tests.helpers import TINY_A, save_model_dir
from tests.parallel_probe import SIZES, Probe

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the parallel GPU tests need two GPUs")]
PROMPTS = [[5, 17, 300, 42, 9, 77], [100, 7, 7, 65, 3]]  # one a data-parallel rank (with those below, up to 8)
STEPS = 6
LAYOUTS = {  # TINY_A: 4 heads, 2 output groups, 8 routed experts
    "dp2": dict(data_parallel_size=2),
    "dp2+ep": dict(data_parallel_size=2, enable_expert_parallel=True),
    "tp2": dict(tensor_parallel_size=2),
    "tp2+ep": dict(tensor_parallel_size=2, enable_expert_parallel=True),
    "dp4+ep": dict(data_parallel_size=4, enable_expert_parallel=True),
    "dp2xtp2+ep": dict(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True),
    "dp8+ep": dict(data_parallel_size=8, enable_expert_parallel=True),  # one expert a rank
    "dp4xtp2+ep": dict(data_parallel_size=4, tensor_parallel_size=2, enable_expert_parallel=True),
}
PROMPTS += [[11, 12, 13], [400, 2, 99, 7, 1, 1, 5], [8, 9], [300, 301, 302, 303], [42], [7, 6, 5, 4, 3, 2]]  # 8


class GpuProbe(Probe):
    """`Probe` on the GPU kernels (bf16)."""

    def __init__(self, **kwargs):
        self.llm = LLM(**{**SIZES, "backend": "nvidia", **kwargs})


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """TINY_A (4 heads, 2 output groups, 8 experts) with a sharpened LM head: greedy margins far above bf16
    rounding, so the greedy tokens of every layout must agree."""
    tensors = random_tensors(ModelConfig.from_dict(TINY_A), seed=0)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 30.0
    return save_model_dir(tmp_path_factory.mktemp("gpu-ranks") / "tiny", TINY_A, tensors)


@pytest.fixture(scope="module")
def reference(model):
    """The fp32 reference's logits and its greedy tokens per prompt (what every run is forced along)."""
    logits = Probe(model=model, dtype="float32").logits(PROMPTS, STEPS)
    tokens = [[int(t) for t in rows[len(ids) - 1:-1].argmax(-1)] for ids, rows in zip(PROMPTS, logits)]
    return logits, tokens


@pytest.fixture(scope="module")
def one_gpu(model, reference, cuda):
    """One GPU's logits along the reference tokens, and each prompt's bound (the module's docstring)."""
    ref, tokens = reference
    probe = GpuProbe(model=model)
    try:
        logits = probe.logits(PROMPTS, STEPS, tokens)
    finally:
        probe.close()
    distances = [(g - r).abs().max().item() for g, r in zip(logits, ref)]
    assert all(0 < b < 0.1 * r.abs().max().item() for b, r in zip(distances, ref))  # bf16 rounding, not a bad kernel
    return logits, [2 * b + 0.01 * r.abs().max().item() for b, r in zip(distances, ref)]


def on_ranks(model, layout: dict, method: str, *args):
    parallel = ParallelConfig(**layout)
    if parallel.world > torch.cuda.device_count():
        pytest.skip(f"{parallel.world} ranks need {parallel.world} GPUs; this host has {torch.cuda.device_count()}")
    pool = RankPool(parallel, GpuProbe, dict(model=model, **layout))
    try:
        return pool.call(method, *args)
    finally:
        pool.close()


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_gpus_give_one_gpus_logits(model, reference, one_gpu, layout, captured):
    """Every prefill and decode row within the bound (the module's docstring) of one GPU's. `graphs`: each decode
    step replayed from a CUDA graph with the step's NCCL collectives captured inside (the attention's all-reduce,
    the experts' gathers and sums)."""
    _, tokens = reference
    want, bounds = one_gpu
    got = on_ranks(model, LAYOUTS[layout], "logits", PROMPTS, STEPS, tokens, captured)
    for g, w, bound in zip(got, want, bounds, strict=True):
        assert g.shape == w.shape
        assert (g - w).abs().max().item() <= bound


@pytest.mark.parametrize("layout", ["dp2+ep", "tp2+ep", "dp2xtp2+ep", "dp4xtp2+ep"])
def test_engine_decode_graphs_on_the_ranks_equal_eager_decode(model, monkeypatch, layout):
    """`DEEPINFER_PARALLEL_GRAPHS=1`: the engine captures every decode bucket on every rank (the lockstep's static
    rows, the expert exchange inside) and generates the tokens the same ranks generate decoding eagerly (one
    prompt a data-parallel rank: the same rows either way, so the same sums)."""
    dp = LAYOUTS[layout].get("data_parallel_size", 1)
    params = [SamplingParams(temperature=0, max_new_tokens=STEPS, ignore_eos=True) for _ in PROMPTS[:max(2, dp)]]
    prompts = [{"token_ids": p} for p in PROMPTS[:max(2, dp)]]
    runs = []
    for flag in ("0", "1"):
        monkeypatch.setenv("DEEPINFER_PARALLEL_GRAPHS", flag)  # the workers inherit it
        outputs, _ = on_ranks(model, LAYOUTS[layout], "generate", prompts, params)
        runs.append([o.token_ids for o in outputs])
    assert runs[0] == runs[1] and all(len(t) == STEPS for t in runs[0])
