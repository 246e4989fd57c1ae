"""Sampling parameters and the sampler."""

from __future__ import annotations

import pytest
import torch

from deepinfer.errors import RequestError
from deepinfer.runtime.sampler import (History, PenaltyState, SamplerGraphs, Seen, adjust_logits, filter_logits,
                                       sample)
from deepinfer.runtime.sampling import SamplingParams, draw_seed


def test_greedy_is_argmax():
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=0)] * 3
    assert sample(logits, params, [0, 0, 0], [5, 5, 5]) == logits.argmax(-1).tolist()


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = lambda p: torch.isfinite(filter_logits(logits[None], [p])[0]).nonzero().flatten().tolist()  # noqa: E731
    assert kept(SamplingParams(top_k=2)) == [0, 1]
    assert kept(SamplingParams(top_p=0.5)) == [0]
    assert kept(SamplingParams(top_p=0.79)) == [0, 1]
    assert kept(SamplingParams(top_p=0.81)) == [0, 1, 2]
    assert kept(SamplingParams(top_p=1.0)) == [0, 1, 2, 3]
    assert kept(SamplingParams(top_p=0.83)) == [0, 1, 2]
    assert kept(SamplingParams(top_k=3, top_p=0.83)) == [0, 1]  # top-p on the top-k renormalized distribution
    assert kept(SamplingParams(min_p=0.3)) == [0, 1, 2]  # 0.15 >= 0.3 * 0.5
    assert kept(SamplingParams(min_p=0.31)) == [0, 1]


def test_draws_follow_the_distribution_and_the_seed():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    p = SamplingParams(temperature=1.0)
    draws = [sample(logits, [p], [11], [pos])[0] for pos in range(3000)]
    freq = torch.bincount(torch.tensor(draws), minlength=3).float() / 3000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)
    assert [sample(logits, [p], [11], [pos])[0] for pos in range(50)] == draws[:50]
    assert draw_seed(1, 2) != draw_seed(2, 1)


@pytest.mark.parametrize(
    "kwargs, name",
    [({"temperature": -0.5}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -1}, "top_k"),
     ({"max_new_tokens": 0}, "max_new_tokens"), ({"seed": -3}, "seed"), ({"stop": [""]}, "stop"), ({"stop": 5}, "stop"),
     ({"min_p": 1.5}, "min_p"), ({"presence_penalty": 2.5}, "presence_penalty"),
     ({"frequency_penalty": "x"}, "frequency_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
     ({"logit_bias": {5: 101}}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": [1]}, "logit_bias"),
     ({"temperature": True}, "temperature"), ({"ignore_eos": 1}, "ignore_eos")],
)
def test_bad_parameters_are_named(kwargs, name):
    with pytest.raises(RequestError, match=f"sampling parameter {name}="):
        SamplingParams(**kwargs)


def reference_adjust(logits: torch.Tensor, p: SamplingParams, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """One row, token by token, as the OpenAI / CTRL definitions read."""
    out = logits.clone()
    for token, bias in p.logit_bias.items():
        out[token] += bias
    for token in set(prompt) | set(generated):
        out[token] = out[token] / p.repetition_penalty if out[token] > 0 else out[token] * p.repetition_penalty
    for token in set(generated):
        out[token] -= p.frequency_penalty * generated.count(token) + p.presence_penalty
    return out


def test_penalties_and_logit_bias_match_the_reference():
    vocab = 300
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, vocab, generator=gen) * 3
    params = [SamplingParams(presence_penalty=0.7, frequency_penalty=0.4),
              SamplingParams(repetition_penalty=1.3, logit_bias={3: 5.0, "7": -100}),
              SamplingParams(),  # untouched in a penalized batch
              SamplingParams(presence_penalty=-1.0, frequency_penalty=2.0, repetition_penalty=0.8, logit_bias={0: 1.5}),
              SamplingParams(frequency_penalty=1.0)]
    histories = [History(torch.randint(0, vocab, (n,), generator=gen).tolist(),
                         torch.randint(0, vocab, (m,), generator=gen).tolist()) for n, m in [(9, 30), (4, 0), (3, 3),
                                                                                             (50, 12), (1, 200)]]
    got = adjust_logits(logits, params, Seen.of(histories, vocab, "cpu"))
    for i, (p, h) in enumerate(zip(params, histories)):
        torch.testing.assert_close(got[i], reference_adjust(logits[i], p, h.prompt, h.generated), rtol=0, atol=1e-5)
    assert not torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])


def test_greedy_follows_the_penalties_and_bias():
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.0]])
    assert sample(logits, [SamplingParams(temperature=0)], [0], [0]) == [0]
    assert sample(logits, [SamplingParams(temperature=0, logit_bias={2: 4.5})], [0], [0]) == [2]
    p = SamplingParams(temperature=0, frequency_penalty=0.6)
    assert sample(logits, [p], [0], [0], Seen.of([History([], [0, 0])], 4, "cpu")) == [1]  # 5 - 2 * 0.6 < 4
    p = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sample(logits, [p], [0], [0], Seen.of([History([0], [])], 4, "cpu")) == [1]  # 5 / 2 < 4


def test_penalized_draws_follow_the_reference_distribution():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    p = SamplingParams(temperature=0.9, presence_penalty=0.5, top_k=3, min_p=0.1, logit_bias={3: 0.2})
    history = Seen.of([History([1], [0, 0, 2])], 4, "cpu")
    expected = torch.softmax(filter_logits(reference_adjust(logits[0], p, [1], [0, 0, 2])[None], [p])[0], -1)
    draws = torch.tensor([sample(logits, [p], [3], [pos], history)[0] for pos in range(4000)])
    freq = torch.bincount(draws, minlength=4).float() / len(draws)
    assert torch.allclose(freq, expected, atol=0.03), (freq, expected)


def test_a_row_draws_the_same_whatever_its_batch():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 500, generator=gen)
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=i) for i in range(6)]
    together = sample(logits, params, list(range(6)), [10] * 6)
    alone = [sample(logits[i : i + 1], params[i : i + 1], [i], [10])[0] for i in range(6)]
    assert together == alone


def test_penalty_state_follows_slots_and_owners():
    state = PenaltyState(slots=3, vocab=10, device="cpu")
    a, b, c = object(), object(), object()
    state.prepare([2], [a], [History([1, 1], [4])])
    rows = state.rows(torch.tensor([2]))
    assert rows.counts[0].tolist() == [0, 0, 0, 0, 1, 0, 0, 0, 0, 0]
    assert rows.seen[0].nonzero().flatten().tolist() == [1, 4]
    state.record(torch.tensor([2]), torch.tensor([4]))
    state.record(torch.tensor([2, 3]), torch.tensor([7, 9]))  # row 3 is the scratch slot's
    state.prepare([2], [a], [History([1, 1], [4, 4, 7])])  # kept, not rebuilt
    rows = state.rows(torch.tensor([2]))
    assert rows.counts[0, 4] == 2 and rows.counts[0, 7] == 1
    state.prepare([0, 2], [a, b], [History([1, 1], [4, 4, 7]), History([3], [])])  # a moved, b took slot 2
    rows = state.rows(torch.tensor([0, 2]))
    torch.testing.assert_close(rows.counts, Seen.of([History([1, 1], [4, 4, 7]), History([3], [])], 10, "cpu").counts)
    assert rows.seen[1].nonzero().flatten().tolist() == [3]
    state.prepare([0], [c], [None])  # an unpenalized request claims slot 0 (its row is not read) ...
    state.record(torch.tensor([0]), torch.tensor([5]))
    state.prepare([0], [a], [History([1, 1], [4, 4, 7])])  # ... so a, back in slot 0, gets its row rebuilt
    assert state.rows(torch.tensor([0])).counts[0, 5] == 0


def replaying(fn):
    """A stand-in for graph capture on the CPU: the output buffer is fixed, each replay recomputes into it."""
    out = fn()
    return out, lambda: out.copy_(fn())


def test_the_graph_sampler_gives_the_eager_tokens_and_counts():
    gen = torch.Generator().manual_seed(2)
    batch, vocab = 6, 400
    logits = torch.randn(8, vocab, generator=gen) * 3  # a bucket of 8, 6 rows used
    kinds = [dict(temperature=0), dict(temperature=0, logit_bias={7: 30.0, "9": -5}), dict(temperature=0.8, top_p=0.9),
             dict(temperature=1.0, top_k=40, min_p=0.02), dict(temperature=0.7, presence_penalty=1.0,
                                                                frequency_penalty=0.5, repetition_penalty=1.2)]
    params = [SamplingParams(seed=i, **kinds[i % len(kinds)]) for i in range(batch)]
    histories = [History(torch.randint(0, vocab, (30,), generator=gen).tolist(),
                         torch.randint(0, vocab, (20,), generator=gen).tolist()) for _ in range(batch)]
    state = PenaltyState(slots=batch, vocab=vocab, device="cpu")
    graphs = SamplerGraphs(state, vocab, scratch_slot=batch, capture=replaying)
    owners, slots = [object() for _ in range(batch)], list(range(batch))[::-1]
    for position in range(4):
        params_now = params if position != 2 else [SamplingParams(seed=1, temperature=0.5)] * batch  # no bias left
        state.prepare(slots, owners, histories)
        eager = sample(logits[:batch], params_now, list(range(batch)), [position] * batch,
                       state.rows(torch.tensor(slots)))
        got = graphs.run(logits, batch, params_now, list(range(batch)), [position] * batch, slots).tolist()
        assert got == eager
        histories = [History(h.prompt, list(h.generated) + [t]) for h, t in zip(histories, got)]
        rows = state.rows(torch.tensor(slots))
        assert torch.equal(rows.counts, Seen.of(histories, vocab, "cpu").counts)
