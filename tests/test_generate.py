"""End-to-end generation through `deepinfer.LLM`: HF parity, batching, chunking, sampling and stopping."""

from __future__ import annotations

import json

import pytest
import torch

import deepinfer
from deepinfer.errors import RequestError
from deepinfer.runtime.sampling import SamplingParams
from tests.helpers import TINY_A, hf_model

GREEDY = SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    hf = hf_model(TINY_A)
    path = tmp_path_factory.mktemp("gen") / "tiny"
    hf.save_pretrained(path)
    return path, hf


@pytest.fixture(scope="module")
def llm(saved):
    # these tests run prompts again and compare: an approximate prefix hit (the default) would change the logits
    return deepinfer.LLM(saved[0], prefix_cache="off")


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, TINY_A["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_greedy_generation_matches_hf_generate(saved, llm):
    _, hf = saved
    ids = prompt(200, 1)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=40, min_new_tokens=40)[0, len(ids):]
    out = llm.generate({"token_ids": ids}, SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True))[0]
    assert out.token_ids == ref.tolist()
    assert out.finish_reason == "length" and out.num_generated_tokens == 40 and out.num_prompt_tokens == 200


def test_batched_requests_equal_each_alone(llm):
    prompts = [{"token_ids": prompt(n, n)} for n in (5, 140, 33, 1, 260)]
    lengths = [SamplingParams(temperature=0, max_new_tokens=m, ignore_eos=True) for m in (7, 20, 3, 12, 9)]
    together = llm.generate(prompts, lengths)
    for p, params, out in zip(prompts, lengths, together):
        assert out.token_ids == llm.generate(p, params)[0].token_ids


def test_chunked_prefill_gives_the_same_tokens(saved, llm):
    chunked = deepinfer.LLM(saved[0], max_prefill_tokens=7, max_num_seqs=2)
    prompts = [{"token_ids": prompt(n, n + 100)} for n in (150, 20, 61)]
    a = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert [o.token_ids for o in chunked.generate(prompts, GREEDY)] == a


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    p = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=123, max_new_tokens=16, ignore_eos=True)
    target = {"token_ids": prompt(30, 7)}
    alone = llm.generate(target, p)[0].token_ids
    others = [{"token_ids": prompt(12, 8)}, target, {"token_ids": prompt(90, 9)}]
    params = [SamplingParams(temperature=1.0, seed=5, max_new_tokens=10), p, GREEDY]
    assert llm.generate(others, params)[1].token_ids == alone
    other_seed = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=124, max_new_tokens=16, ignore_eos=True)
    assert llm.generate(target, other_seed)[0].token_ids != alone


def test_stop_on_eos_stop_string_and_max_tokens(saved, tmp_path):
    path, _ = saved
    llm = deepinfer.LLM(path)
    ids = {"token_ids": prompt(40, 3)}
    free = llm.generate(ids, GREEDY)[0]
    # a copy of the model whose EOS is the 6th token greedy decoding produces
    eos = free.token_ids[5]
    first = free.token_ids.index(eos)
    (tmp_path / "m").mkdir()
    for f in path.iterdir():
        (tmp_path / "m" / f.name).write_bytes(f.read_bytes())
    raw = json.loads((path / "config.json").read_text())
    raw["eos_token_id"] = [eos, 1]
    (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
    out = deepinfer.LLM(tmp_path / "m").generate(ids, SamplingParams(temperature=0, max_new_tokens=32))[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: first + 1]
    # a stop string taken from the free-running text
    text = free.text
    start = next(i for i in range(len(text) // 2, len(text)) if text[i : i + 3].strip())
    stop = text[start : start + 3]
    out = llm.generate(ids, SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == text[: text.index(stop)]
    assert len(out.token_ids) < 32
    out = llm.generate(ids, SamplingParams(temperature=0, max_new_tokens=4))[0]
    assert out.finish_reason == "length" and out.token_ids == free.token_ids[:4]


def test_prompt_longer_than_the_model_limit(saved, tmp_path):
    path, _ = saved
    (tmp_path / "m").mkdir()
    for f in path.iterdir():
        (tmp_path / "m" / f.name).write_bytes(f.read_bytes())
    raw = json.loads((path / "config.json").read_text())
    raw["max_position_embeddings"] = 64
    (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
    llm = deepinfer.LLM(tmp_path / "m")
    with pytest.raises(RequestError, match="prompt has 64 tokens.*limit.*64"):
        llm.generate({"token_ids": prompt(64, 1)}, GREEDY)
    out = llm.generate({"token_ids": prompt(60, 1)}, GREEDY)[0]  # room for 4 more positions only
    assert out.finish_reason == "length" and out.num_generated_tokens == 4


def test_token_ids_outside_the_vocabulary(llm):
    with pytest.raises(RequestError, match="token id 600 is outside"):
        llm.generate({"token_ids": [3, 600]}, GREEDY)


def test_default_tiny_model_chat_and_raw():
    llm = deepinfer.LLM()
    assert llm.random_weights and llm.config.vocab_size == 129280
    chat = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_new_tokens=8))[0]
    raw = llm.generate("Hi", SamplingParams(temperature=0, max_new_tokens=8))[0]
    assert chat.num_prompt_tokens > raw.num_prompt_tokens  # the chat template adds BOS and role markers
    assert 1 <= chat.num_generated_tokens <= 8 and isinstance(chat.text, str)


def test_max_model_len_is_exact():
    small = deepinfer.LLM(max_model_len=16, max_num_seqs=2)
    assert small.engine.max_len == 16
    out = small.generate({"token_ids": list(range(5, 15))}, SamplingParams(temperature=0, max_new_tokens=100,
                                                                         ignore_eos=True), use_tqdm=False)[0]
    assert out.num_generated_tokens == 6 and out.finish_reason == "length"
    with pytest.raises(RequestError, match="the limit is 16 positions"):
        small.generate({"token_ids": list(range(5, 21))})


def test_logit_bias_and_penalties_steer_generation(llm):
    ids = prompt(20, 3)
    forced = llm.generate({"token_ids": ids}, SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True,
                                                             logit_bias={77: 100}), use_tqdm=False)[0]
    assert forced.token_ids == [77] * 6
    # a strong frequency penalty on top of the same bias: 77 once, then never again in a row of 6
    spread = llm.generate({"token_ids": ids}, SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True,
                                                             logit_bias={77: 100}, frequency_penalty=2.0,
                                                             presence_penalty=2.0, repetition_penalty=50.0),
                          use_tqdm=False)[0]
    assert spread.token_ids[0] == 77 and spread.token_ids.count(77) < 6
