"""Batch invariance through the engine on the CPU (reference ops, `--batch-invariant`): a request's token ids and
logprobs are bit for bit those of its run alone, in batches of other sizes and mixes, with other `--max-num-seqs`
and `--max-prefill-tokens` (chunk boundaries), after preemptions, greedy and seeded-sampled; without the mode its
logprobs move. Targets where the mode cannot be promised say so."""

from __future__ import annotations

import logging

import pytest
import torch

import backends
import deepinfer
from deepinfer.config import ModelConfig
from deepinfer.errors import ConfigError
from deepinfer.runtime.backend import check_invariance
from deepinfer.runtime.sampling import SamplingParams
from deepinfer.tiny import random_tensors
from tests.helpers import TINY_A, save_model_dir

PARAMS = (SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True, logprobs=3),
          SamplingParams(temperature=0.8, top_p=0.9, seq_seed=11, max_new_tokens=10, ignore_eos=True, logprobs=3))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cfg = ModelConfig.from_dict(TINY_A)
    return save_model_dir(tmp_path_factory.mktemp("bi-engine") / "tiny", TINY_A, random_tensors(cfg, seed=1))


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [{"token_ids": torch.randint(2, TINY_A["vocab_size"], (n,), generator=g).tolist()} for n in lengths]


MINE = _prompts([140], seed=0)[0]
OTHERS = _prompts([150, 200, 90, 170, 40, 7], seed=1)


def _seen(output) -> tuple:
    return tuple(output.token_ids), tuple((t.token_id, t.logprob, tuple(t.top)) for t in output.logprobs or ())


@pytest.fixture(scope="module")
def alone(saved):
    llm = deepinfer.LLM(saved, batch_invariant=True, max_num_seqs=1)
    return [_seen(llm.generate([MINE], p)[0]) for p in PARAMS]


def _batch(where: int, others=OTHERS):
    """The request twice (greedy, then sampled) among `others` (alternately greedy and sampled with their own seeds),
    the first copy at `where`."""
    mixed = [SamplingParams(temperature=0.7 * (i % 2), seed=i, max_new_tokens=10, ignore_eos=True)
             for i in range(len(others))]
    prompts = others[:where] + [MINE] + others[where:] + [MINE]
    params = mixed[:where] + [PARAMS[0]] + mixed[where:] + [PARAMS[1]]
    return prompts, params


@pytest.mark.parametrize("max_seqs,chunk,where", [(4, 64, 0), (8, 2048, 3), (3, 37, 6)])
def test_a_request_gets_the_same_bits_in_any_batch(saved, alone, max_seqs, chunk, where):
    llm = deepinfer.LLM(saved, batch_invariant=True, max_num_seqs=max_seqs, max_prefill_tokens=chunk)
    outs = llm.generate(*_batch(where))
    assert [_seen(outs[where]), _seen(outs[-1])] == alone


def test_preempted_requests_get_the_same_bits(saved, alone):
    prompts, params = _batch(4, OTHERS[:4])
    tight = deepinfer.LLM(saved, batch_invariant=True, max_num_seqs=4, num_blocks=6, max_prefill_tokens=64)
    outs = tight.generate(prompts, params)
    assert tight.last_stats.preemptions > 0
    assert [_seen(outs[4]), _seen(outs[-1])] == alone
    roomy = deepinfer.LLM(saved, batch_invariant=True, max_num_seqs=6, max_prefill_tokens=64)
    assert [_seen(o) for o in outs] == [_seen(o) for o in roomy.generate(prompts, params)]


def test_without_the_mode_a_batch_moves_the_logprobs(saved):
    solo = deepinfer.LLM(saved, max_num_seqs=1)
    batched = deepinfer.LLM(saved, max_num_seqs=8, max_prefill_tokens=64)
    want = _seen(solo.generate([MINE], PARAMS[0])[0])
    got = _seen(batched.generate(OTHERS[:3] + [MINE], PARAMS[0])[3])
    assert got != want  # the same greedy tokens, most likely, but not the same bits


def test_targets_that_cannot_promise_it_say_so(caplog):
    with pytest.raises(ConfigError, match="--batch-invariant is not available on backend 'ascend'"):
        check_invariance(backends.get("ascend"))
    with caplog.at_level(logging.WARNING, logger="deepinfer"):
        check_invariance(backends.get("sm100"))
    assert "never run" in caplog.text
    for name in ("sm90", "c", "reference"):
        check_invariance(backends.get(name))
