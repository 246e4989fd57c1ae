"""Batch invariance on the H200 (`--batch-invariant`): the sm90 kernels and CUDA graphs give a token the same bits
whatever its batch. Op by op at V4-Flash's shapes (`benchmarks/batch_invariance.py`'s cases: 1 to 2048 rows, and
the prefill and decode forms of the attention and the indexer); the V4-Flash slice's logits for one request alone
and beside 7, 31 and 127 others of random lengths, through prefill chunks and decode-graph buckets; and the engine
on a tiny model in the style of SGLang's deterministic test (single, mixed and prefix prompts) with token ids and
logprobs compared bit for bit."""

from __future__ import annotations

import pytest
import torch

import deepinfer
from benchmarks import batch_invariance as bi
from deepinfer.runtime.sampling import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def invariant_ops(cuda, cache_dir):
    from tilekernels.kernels import kernel_table

    return kernel_table("sm90", cache_dir, invariant=True)


@pytest.mark.parametrize("case", bi.CASES + (bi.FP4_CASE,), ids=lambda c: c.name)
def test_each_op_gives_a_row_the_same_bits_at_every_row_count(case, invariant_ops, cuda):
    gaps = bi.gaps(bi.outputs(invariant_ops, case, cuda))
    assert all(g == 0.0 for g in gaps.values()), f"{case.name}: rows differ from the 2048-row call by {gaps}"


@pytest.mark.parametrize("pair", bi.PAIRS, ids=lambda p: p[0].split(" (")[0])
def test_the_prefill_and_decode_forms_agree_bitwise(pair, invariant_ops, cuda):
    assert bi.pair_gap(invariant_ops, *pair, cuda) == 0.0


# ---- the V4-Flash slice: one request alone, then beside others -------------------------------------------------


@pytest.fixture(scope="module")
def slice_model(cuda, cache_dir):
    import os

    from benchmarks.decode import SLICE
    from deepinfer.compile.plan import kernel_plan
    from deepinfer.compile.prebuild import build_kernels
    from deepinfer.config import ModelConfig
    from deepinfer.model.model import DeepseekV4
    from deepinfer.model.weights import ModelWeights
    from deepinfer.tiny import random_tensors
    from tilekernels.kernels import kernel_table

    cfg = ModelConfig.from_model_dir(SLICE)
    build_kernels("sm90", kernel_plan(cfg, "bfloat16", invariant=True), cache_dir, jobs=min(16, os.cpu_count() or 1),
                  progress=False)
    weights = ModelWeights.from_tensors(cfg, random_tensors(cfg, seed=0, dtype=torch.bfloat16, device="cuda"))
    return cfg, DeepseekV4(cfg, weights, kernel_table("sm90", cache_dir, invariant=True))


def _slice_run(cfg, model, prompts: list[list[int]], chunk: int, steps: int, graphs_rows: int) -> torch.Tensor:
    """Prefill every prompt in `chunk`-token steps (several sequences per step, as the engine packs them), then
    `steps` greedy decode steps of all of them through the captured graph of `graphs_rows` rows. Returns the first
    prompt's fp32 logits [1 + steps, V] on the CPU."""
    from backends.nvidia.graphs import CudaGraphs
    from deepinfer.runtime.cache import CacheSpec, PagedCache
    from deepinfer.runtime.graph import DecodeGraphs

    per_seq = -(-(max(map(len, prompts)) + steps + 1) // 128)
    cache = PagedCache(cfg, CacheSpec(num_blocks=len(prompts) * per_seq, max_seqs=len(prompts),
                                      max_blocks_per_seq=per_seq), torch.bfloat16, "cuda")
    seqs = [cache.admit() for _ in prompts]
    for s, p in zip(seqs, prompts):
        assert cache.grow(s, len(p) + steps + 1)
    done = [0] * len(prompts)
    last = [None] * len(prompts)
    with torch.inference_mode():
        while any(d < len(p) for d, p in zip(done, prompts)):
            ids, pos, spans, budget, ends = [], [], [], chunk, []
            for i, (s, p) in enumerate(zip(seqs, prompts)):
                take = min(budget, len(p) - done[i])
                if take <= 0:
                    continue
                spans.append((s, len(ids), take))
                ids += p[done[i]:done[i] + take]
                pos += list(range(done[i], done[i] + take))
                done[i] += take
                budget -= take
                ends.append((i, len(ids) - 1))
            rows = torch.tensor([row for _, row in ends], device="cuda")
            logits = model.prefill(cache, torch.tensor(ids, device="cuda"), torch.tensor(pos, device="cuda"), spans,
                                   rows)
            for j, (i, _) in enumerate(ends):
                if done[i] == len(prompts[i]):
                    last[i] = logits[j].float().cpu()
        graphs = DecodeGraphs(model, cache, graphs_rows, CudaGraphs())
        out = [last[0]]
        tokens = [int(t.argmax()) for t in last]
        for step in range(steps):
            logits = graphs.run(tokens, [len(p) + step for p in prompts], seqs)
            out.append(logits[0].float().cpu())
            tokens = [int(t.argmax()) for t in logits[: len(prompts)]]
            for s in seqs:
                s.num_tokens += 1
    return torch.stack(out)


@pytest.mark.parametrize("others", (7, 31, 127))
def test_slice_request_alone_equals_it_among_others(slice_model, others):
    cfg, model = slice_model
    g = torch.Generator().manual_seed(others)
    mine = torch.randint(0, cfg.vocab_size, (300,), generator=g).tolist()
    rest = [torch.randint(0, cfg.vocab_size, (int(n),), generator=g).tolist()
            for n in torch.randint(1, 700, (others,), generator=g)]
    alone = _slice_run(cfg, model, [mine], chunk=4096, steps=4, graphs_rows=1)
    among = _slice_run(cfg, model, [mine] + rest, chunk=509, steps=4, graphs_rows=others + 1)
    assert torch.equal(alone, among), f"largest gap {(alone - among).abs().max().item()}"


# ---- the engine (CUDA graphs, scheduler, sampler) on a tiny model ------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from deepinfer.config import ModelConfig
    from deepinfer.tiny import random_tensors
    from tests.helpers import TINY_A, save_model_dir

    return save_model_dir(tmp_path_factory.mktemp("gpu-bi") / "tiny", TINY_A,
                          random_tensors(ModelConfig.from_dict(TINY_A), seed=0))


def _engine(tiny_dir, **kw):
    return deepinfer.LLM(tiny_dir, backend="nvidia", dtype="bfloat16", batch_invariant=True, **kw)


def _prompts(mode: str, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(2, 512, (150,), generator=g).tolist()
    if mode == "single":
        return [base] * n
    if mode == "prefix":  # one shared prefix, different continuations
        return [base[:100] + torch.randint(2, 512, (int(k),), generator=g).tolist()
                for k in torch.randint(1, 200, (n,), generator=g)]
    return [torch.randint(2, 512, (int(k),), generator=g).tolist() for k in torch.randint(1, 400, (n,), generator=g)]


@pytest.mark.parametrize("mode", ("single", "mixed", "prefix"))
def test_engine_outputs_do_not_depend_on_the_batch(tiny_dir, mode, cuda):
    params = [SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_new_tokens=24, ignore_eos=True, logprobs=3)]
    prompts = _prompts(mode, 40, seed=1)
    solo = _engine(tiny_dir, max_num_seqs=1)
    want = [solo.generate([{"token_ids": prompts[0]}], p)[0] for p in params]
    for max_seqs, chunk in ((8, 64), (32, 509), (64, 2048)):
        llm = _engine(tiny_dir, max_num_seqs=max_seqs, max_prefill_tokens=chunk)
        for p, w in zip(params, want):
            got = llm.generate([{"token_ids": q} for q in prompts], p)
            mine = [o for q, o in zip(prompts, got) if q == prompts[0]]
            for o in mine:
                assert o.token_ids == w.token_ids
                assert _logprobs(o) == _logprobs(w)


def _logprobs(output) -> list:
    return [(t.token_id, t.logprob, tuple(t.top)) for t in output.logprobs]
