"""The batched sampler on the GPU gives the CPU's tokens: greedy exactly, draws at least 99 % of rows (a uniform
landing within float rounding of a CDF boundary may pick the neighbour)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.runtime.sampler import History, PenaltyState, SamplerGraphs, Seen, sample
from deepinfer.runtime.sampling import SamplingParams

pytestmark = pytest.mark.gpu


def test_gpu_sampler_matches_the_cpu():
    gen = torch.Generator().manual_seed(0)
    batch, vocab = 64, 129280
    logits = torch.randn(batch, vocab, generator=gen) * 4
    kinds = [dict(temperature=0, logit_bias={7: 30.0}), dict(temperature=0.8, top_p=0.9),
             dict(temperature=1.0, top_k=40, min_p=0.02), dict(temperature=0.7, presence_penalty=1.0,
                                                               frequency_penalty=0.5, repetition_penalty=1.2)]
    params = [SamplingParams(seed=i, **kinds[i % len(kinds)]) for i in range(batch)]
    histories = [History(torch.randint(0, vocab, (300,), generator=gen).tolist(),
                         torch.randint(0, vocab, (200,), generator=gen).tolist()) for _ in range(batch)]
    agree = 0
    for position in range(20):
        cpu = sample(logits, params, list(range(batch)), [position] * batch, Seen.of(histories, vocab, "cpu"))
        gpu = sample(logits.cuda(), params, list(range(batch)), [position] * batch, Seen.of(histories, vocab, "cuda"))
        assert [c for c, p in zip(cpu, params) if p.greedy] == [g for g, p in zip(gpu, params) if p.greedy]
        agree += sum(c == g for c, g in zip(cpu, gpu))
    assert agree >= 0.99 * 20 * batch


def test_the_captured_sampler_gives_the_eager_tokens_and_counts():
    from backends.nvidia.graphs import CudaGraphs

    gen = torch.Generator().manual_seed(1)
    batch, vocab = 12, 129280
    logits = (torch.randn(16, vocab, generator=gen) * 4).cuda()  # a bucket of 16, 12 rows used
    kinds = [dict(temperature=0), dict(temperature=0, logit_bias={7: 30.0}), dict(temperature=0.8, top_p=0.9),
             dict(temperature=1.0, top_k=40, min_p=0.02),
             dict(temperature=0.7, presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.2)]
    params = [SamplingParams(seed=i, **kinds[i % len(kinds)]) for i in range(batch)]
    histories = [History(torch.randint(0, vocab, (30,), generator=gen).tolist(),
                         torch.randint(0, vocab, (20,), generator=gen).tolist()) for _ in range(batch)]
    state = PenaltyState(slots=batch, vocab=vocab, device="cuda")
    graphs = SamplerGraphs(state, vocab, scratch_slot=batch, capture=CudaGraphs())
    owners = [object() for _ in range(batch)]
    slots = list(range(batch))[::-1]
    for position in range(5):
        state.prepare(slots, owners, histories)
        seen = state.rows(torch.tensor(slots, device="cuda"))
        eager = sample(logits[:batch], params, list(range(batch)), [position] * batch, seen)
        got = graphs.run(logits, batch, params, list(range(batch)), [position] * batch, slots).tolist()
        assert got == eager
        histories = [History(h.prompt, list(h.generated) + [t]) for h, t in zip(histories, got)]
        expected = Seen.of(histories, vocab, "cuda")
        rows = state.rows(torch.tensor(slots, device="cuda"))
        assert torch.equal(rows.counts, expected.counts) and torch.equal(rows.seen, expected.seen)
