"""Speculative decoding on the H200 (sm90 kernels, bf16, verify rows through the CUDA-graph decode steps): the
output equals plain decoding's. With batch-invariant kernels, bit for bit (tokens and logprobs) with the MTP
layer's drafts and with mostly-right drafts (`OracleDrafts`); with the default kernels, token for token on a
model whose greedy margins are far above bf16 rounding. Run with `pytest -m gpu` on the GPU host."""

from __future__ import annotations

import pytest
import torch

import deepinfer
from deepinfer.config import ModelConfig
from deepinfer.runtime.drafters import OracleDrafts
from deepinfer.runtime.sampling import SamplingParams
from deepinfer.runtime.speculative import Speculator
from deepinfer.tiny import random_tensors
from tests.helpers import TINY_DSPARK, TINY_MTP, save_model_dir

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tensors = random_tensors(ModelConfig.from_dict(TINY_MTP), seed=0)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 30.0  # confident: margins far above bf16 rounding
    return save_model_dir(tmp_path_factory.mktemp("gpu-spec") / "tiny-mtp", TINY_MTP, tensors)


def prompts(n: int = 4):
    g = torch.Generator().manual_seed(0)
    return [{"token_ids": torch.randint(2, 512, (m,), generator=g).tolist()} for m in (200, 37, 140, 5, 90, 64, 3, 250)[:n]]


def signature(outs):
    return [(o.token_ids, [(e.token_id, e.logprob) for e in o.logprobs or ()]) for o in outs]


def swap_oracle(llm, reference, accept: float, k: int) -> None:
    drafts = OracleDrafts({i: o.token_ids for i, o in enumerate(reference)}, accept, llm.config.vocab_size)
    llm.engine.speculator = Speculator(llm.engine.steps, k, drafts)


@pytest.mark.parametrize("seqs, k", [(4, 4), (8, 5)])  # verify steps of up to 20 and 48 rows
@pytest.mark.parametrize("invariant", [True, False])
def test_speculative_equals_plain_decoding(model_dir, cuda, invariant, seqs, k):
    kw = dict(backend="nvidia", dtype="bfloat16", max_num_seqs=seqs, prefix_cache="off", batch_invariant=invariant)
    plain = deepinfer.LLM(model_dir, speculative_tokens=0, **kw)
    spec = deepinfer.LLM(model_dir, speculative_tokens=k, **kw)
    assert spec.engine.steps.graphs.capture is not None and spec.engine.steps.graphs.buckets[-1] == seqs * (k + 1)
    params = [SamplingParams(temperature=0, max_new_tokens=48, ignore_eos=True, logprobs=3 if invariant else None),
              SamplingParams(temperature=0.8, seed=5, max_new_tokens=48, ignore_eos=True)]
    for p in params:
        want = plain.generate(prompts(seqs), p)
        got = spec.generate(prompts(seqs), p)  # the MTP layer's drafts (random weights: mostly rejected)
        assert spec.last_stats.spec.steps > 0
        check = signature if invariant else (lambda outs: [o.token_ids for o in outs])
        assert check(got) == check(want)
        swap_oracle(spec, want, 0.8, k)
        got = spec.generate(prompts(seqs), p)
        assert spec.last_stats.spec.accepted[0] > 0 and check(got) == check(want)
        spec.engine.speculator = Speculator(spec.engine.steps, k, type(spec.engine.speculator.drafts)(
            {i: o.token_ids for i, o in enumerate(want)}, 1.0, spec.config.vocab_size))
        got = spec.generate(prompts(seqs), p)
        st = spec.last_stats.spec
        assert st.accepted == st.reached and check(got) == check(want)


@pytest.mark.parametrize("invariant", [True, False])
def test_dspark_equals_plain_decoding(tmp_path, cuda, invariant):
    """DSpark drafting on the sm90 kernels (the block pass: sparse attention over window + block rows, its own
    experts, the Markov head), verified through the decode graphs: the output is plain decoding's."""
    tensors = random_tensors(ModelConfig.from_dict(TINY_DSPARK), seed=0)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 30.0
    path = save_model_dir(tmp_path / "tiny-dspark", TINY_DSPARK, tensors)
    kw = dict(backend="nvidia", dtype="bfloat16", max_num_seqs=4, prefix_cache="off", batch_invariant=invariant)
    plain = deepinfer.LLM(path, speculative_tokens=0, **kw)
    spec = deepinfer.LLM(path, **kw)
    assert spec.speculative_tokens == 4 and type(spec.engine.speculator.drafts).__name__ == "DSparkDrafts"
    check = signature if invariant else (lambda outs: [o.token_ids for o in outs])
    for p in (SamplingParams(temperature=0, max_new_tokens=48, ignore_eos=True, logprobs=3 if invariant else None),
              SamplingParams(temperature=0.8, seed=5, max_new_tokens=48, ignore_eos=True)):
        want = plain.generate(prompts(4), p)
        got = spec.generate(prompts(4), p)
        st = spec.last_stats.spec
        assert st.steps > 0 and st.drafts > 0 and check(got) == check(want)
