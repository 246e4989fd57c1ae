"""Sampling parameters and the sampler."""

from __future__ import annotations

import pytest
import torch

from deepinfer.errors import RequestError
from deepinfer.runtime.sampling import SamplingParams, draw_seed, filter_logits, sample


def test_greedy_is_argmax():
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=0)] * 3
    assert sample(logits, params, [0, 0, 0], [5, 5, 5]) == logits.argmax(-1).tolist()


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = lambda p: torch.isfinite(filter_logits(logits, p)).nonzero().flatten().tolist()  # noqa: E731
    assert kept(SamplingParams(top_k=2)) == [0, 1]
    assert kept(SamplingParams(top_p=0.5)) == [0]
    assert kept(SamplingParams(top_p=0.79)) == [0, 1]
    assert kept(SamplingParams(top_p=0.81)) == [0, 1, 2]
    assert kept(SamplingParams(top_p=1.0)) == [0, 1, 2, 3]


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
     ({"max_new_tokens": 0}, "max_new_tokens"), ({"seed": -3}, "seed"), ({"stop": [""]}, "stop")],
)
def test_bad_parameters_are_named(kwargs, name):
    with pytest.raises(RequestError, match=f"sampling parameter {name}="):
        SamplingParams(**kwargs)
