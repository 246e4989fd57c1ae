"""Logprobs (`SamplingParams(logprobs=N)`, `--logprobs`, prompts-file `logprobs`, the Chat Completions / Responses
fields), the `seq_seed` alias of `seed`, and the batch-invariance flag's wiring, on the embedded tiny model."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import deepinfer
from deepinfer.cli import main
from deepinfer.errors import ConfigError, RequestError
from deepinfer.prompts_file import plain_line
from deepinfer.runtime.logprobs import top_logprobs
from deepinfer.runtime.request import TokenLogprobs
from deepinfer.runtime.sampling import MAX_LOGPROBS, SamplingParams
from deepinfer.serving.api_requests import APIError


@pytest.fixture(scope="module")
def pair():
    """The same tiny model with asynchronous scheduling on and off, batch-invariant: a finished request's dropped
    row changes a step's batch, which without the mode may move a logprob in its last bits."""
    return (deepinfer.LLM(max_num_seqs=8, batch_invariant=True),
            deepinfer.LLM(max_num_seqs=8, async_scheduling=False, batch_invariant=True))


def ids(n: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"token_ids": torch.randint(2, 1000, (n,), generator=g).tolist()}


def invoke(args, env=None):
    return CliRunner().invoke(main, ["run", "offline", *args], env={"DEEPINFER_HF_MODEL_DIR": "", **(env or {})})


# ---- parameters ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [-1, 1000, MAX_LOGPROBS + 1, "x", 2.0, True])
def test_bad_logprobs_values_are_named(value):
    with pytest.raises(RequestError, match=rf"logprobs={value!r} is invalid; expected null \(off\) or an integer in "
                                           rf"\[0, {MAX_LOGPROBS}\]"):
        SamplingParams(logprobs=value)


def test_good_logprobs_values():
    assert [SamplingParams(logprobs=v).logprobs for v in (None, 0, 5, MAX_LOGPROBS)] == [None, 0, 5, MAX_LOGPROBS]
    assert SamplingParams.from_dict({"logprobs": 3}).logprobs == 3


def test_seq_seed_is_an_alias_of_seed():
    assert SamplingParams(seq_seed=5) == SamplingParams(seed=5)
    assert SamplingParams(seq_seed=5).seed == 5 and SamplingParams(seed=5, seq_seed=5).seed == 5
    assert SamplingParams.from_dict({"seq_seed": 7}).seed == 7
    with pytest.raises(RequestError, match=r"seed=1 and seq_seed=2 disagree"):
        SamplingParams(seed=1, seq_seed=2)
    with pytest.raises(RequestError, match=r"seq_seed=-1 is invalid"):
        SamplingParams(seq_seed=-1)
    with pytest.raises(RequestError, match=r"seq_seed='x' is invalid"):
        SamplingParams.from_dict({"seq_seed": "x"})


def test_prompts_file_keys():
    item, overrides = plain_line({"token_ids": [1, 2], "logprobs": 2, "seq_seed": 4}, False)
    assert item == {"token_ids": [1, 2]} and overrides == {"logprobs": 2, "seed": 4}  # seq_seed overrides --seed
    assert SamplingParams(**{"seed": 1, **overrides}).seed == 4
    _, overrides = plain_line({"token_ids": [1], "seed": 1, "seq_seed": 2}, False)
    with pytest.raises(RequestError, match="seed=1 and seq_seed=2 disagree"):
        SamplingParams(**overrides)


# ---- the top list ------------------------------------------------------------------------------------------
def test_top_logprobs_descending_ties_toward_the_lower_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, -1.0], [0.0] * 6])
    lp, top, top_ids = top_logprobs(logits, 4)
    assert torch.equal(lp, torch.log_softmax(logits, dim=-1))
    assert top_ids.tolist() == [[1, 2, 4, 0], [0, 1, 2, 3]]
    assert torch.equal(top, lp.gather(1, top_ids))
    big = torch.zeros(3, 50000)  # a large all-tied row: the sort's tie order is the ids' order
    big[1, 40000:] = 2.0
    assert top_logprobs(big, 5)[2].tolist() == [[0, 1, 2, 3, 4], [40000, 40001, 40002, 40003, 40004], [0, 1, 2, 3, 4]]
    assert top_logprobs(logits, 0)[1].shape == (2, 0)


# ---- the engine ------------------------------------------------------------------------------------------
def record_logits(llm) -> list[torch.Tensor]:
    """Every step's raw logits as the model returned them (before the masks the sampler applies in place)."""
    seen, steps = [], llm.engine.steps
    prefill, decode = steps.prefill, steps.decode

    def prefilled(*args):
        out = prefill(*args)
        seen.append(out.clone())
        return out

    def decoded(*args):
        out = decode(*args)
        seen.append(out.clone())
        return out

    steps.prefill, steps.decode = prefilled, decoded
    return seen


@pytest.mark.parametrize("params", [dict(temperature=0), dict(temperature=1.3, top_k=4, top_p=0.9, seed=3,
                                                              repetition_penalty=1.5, presence_penalty=1.0,
                                                              logit_bias={7: 5.0})])
def test_logprobs_are_log_softmax_of_the_raw_logits(params, pair):
    llm = deepinfer.LLM(max_num_seqs=2)  # its own: the steps are wrapped
    seen = record_logits(llm)
    out = llm.generate(ids(9, 1), SamplingParams(max_new_tokens=6, logprobs=5, **params), use_tqdm=False)[0]
    assert len(seen) == len(out.token_ids) == len(out.logprobs) == 6  # one request: row 0 of every step
    for token, entry, logits in zip(out.token_ids, out.logprobs, seen):
        want = torch.log_softmax(logits[0].float(), dim=-1)
        assert isinstance(entry, TokenLogprobs) and entry.token_id == token
        assert entry.logprob == pytest.approx(want[token].item(), abs=1e-6) and entry.logprob <= 0
        values, order = torch.sort(want, descending=True, stable=True)
        assert [i for i, _ in entry.top] == order[:5].tolist()
        assert [v for _, v in entry.top] == pytest.approx(values[:5].tolist(), abs=1e-6)
        assert [v for _, v in entry.top] == sorted((v for _, v in entry.top), reverse=True)
        assert sum(torch.tensor([v for _, v in entry.top]).exp()) <= 1 + 1e-6
        if params["temperature"] == 0:  # greedy without adjustments: the token is the most likely one
            assert entry.top[0] == (token, entry.logprob)


def test_logprobs_equal_with_and_without_async_scheduling(pair):
    on, off = pair
    prompts = [ids(n, s) for s, n in enumerate((5, 17, 3, 30, 8))]
    params = [SamplingParams(max_new_tokens=7, temperature=0, logprobs=3),
              SamplingParams(max_new_tokens=5, temperature=0.9, seed=11, logprobs=0),
              SamplingParams(max_new_tokens=9, temperature=0.7, top_k=20, seed=2),  # asks for none
              SamplingParams(max_new_tokens=4, temperature=1.0, seed=5, frequency_penalty=0.5, logprobs=MAX_LOGPROBS),
              SamplingParams(max_new_tokens=8, temperature=0, logprobs=1, stop=("a",))]
    a = on.generate(prompts, params, use_tqdm=False)
    b = off.generate(prompts, params, use_tqdm=False)
    assert [(o.token_ids, o.logprobs) for o in a] == [(o.token_ids, o.logprobs) for o in b]
    assert a[2].logprobs is None and "logprobs" not in a[2].to_dict()
    for o, p in zip(a, params):
        if p.logprobs is not None:
            assert [e.token_id for e in o.logprobs] == o.token_ids
            assert all(len(e.top) == p.logprobs for e in o.logprobs)


def test_asking_for_logprobs_changes_no_token(pair):
    on, _ = pair
    prompts = [ids(6, 20 + s) for s in range(4)]
    base = [SamplingParams(max_new_tokens=6, temperature=t, seed=9) for t in (0, 0.8, 1.0, 0)]
    asked = [SamplingParams(max_new_tokens=6, temperature=t, seed=9, logprobs=2) for t in (0, 0.8, 1.0, 0)]
    mixed = [asked[0], base[1], asked[2], base[3]]
    runs = [on.generate(prompts, ps, use_tqdm=False) for ps in (base, asked, mixed)]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]] == [o.token_ids for o in runs[2]]
    assert [o.logprobs for o in runs[1]][::2] == [o.logprobs for o in runs[2]][::2]  # the same whatever the batch


def test_structured_output_logprobs_are_before_the_mask(pair):
    on, _ = pair
    out = on.generate({"token_ids": [5, 6, 7], "so_args": {"regex": "(yes|no)"}},
                      SamplingParams(max_new_tokens=4, temperature=0, logprobs=2), use_tqdm=False)[0]
    assert out.text in ("yes", "no") and len(out.logprobs) == len(out.token_ids)
    # the grammar forces the last token(s) (after the mask their logprob would be 0); the random tiny model's raw
    # distribution is near-uniform over its vocabulary
    assert all(e.logprob < -5 for e in out.logprobs), out.logprobs


# ---- CLI -------------------------------------------------------------------------------------------------
def test_jsonl_carries_logprobs_only_when_asked(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"token_ids": [5, 6, 7], "max_new_tokens": 3, "logprobs": 2, "seq_seed": 4}) + "\n"
                       + json.dumps({"token_ids": [8, 9], "max_new_tokens": 2}) + "\n")
    result = invoke(["--prompts-file", str(prompts), "--format", "jsonl", "--temperature", "0.8", "--seed", "1"])
    assert result.exit_code == 0, result.output
    records = {r["index"]: r for r in map(json.loads, result.stdout.splitlines())}
    assert "logprobs" not in records[1]
    lps = records[0]["logprobs"]
    assert [e["token_id"] for e in lps] == records[0]["token_ids"] and all(len(e["top"]) == 2 for e in lps)
    assert all(e["logprob"] <= 0 and e["top"][0][1] >= e["top"][1][1] for e in lps)
    result = invoke(["--token-ids", "5,6,7", "--max-new-tokens", "2", "--temperature", "0", "--logprobs", "1"])
    assert result.exit_code == 0 and "[logprobs] [{\"token_id\"" in result.stdout, result.output


@pytest.mark.parametrize("value", ["-1", "1000", "x"])
def test_bad_logprobs_flag(value):
    result = invoke(["--token-ids", "5", "--logprobs", value])
    assert result.exit_code == 2 and "--logprobs" in result.output and value in result.output, result.output


def test_logprobs_flag_is_refused_for_api_requests(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"url": "/v1/chat/completions", "body": {"model": "deepinfer", "messages": []}}) + "\n")
    result = invoke(["--prompts-file", str(path), "--logprobs", "2"])
    assert result.exit_code == 2 and "--logprobs" in result.output, result.output


# ---- API requests ------------------------------------------------------------------------------------------
def chat(cid, **body):
    return {"custom_id": cid, "url": "/v1/chat/completions",
            "body": {"model": "deepinfer", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, **body}}


def test_chat_completions_logprobs(pair):
    on, off = pair
    lines = [chat("a", logprobs=True, top_logprobs=3, temperature=0), chat("b", temperature=0),
             chat("c", logprobs=True, temperature=1.0, seq_seed=3)]
    outs = on.serve(lines, use_tqdm=False)
    assert outs[1].response["choices"][0]["logprobs"] is None and outs[1].logprobs is None
    for out, k in ((outs[0], 3), (outs[2], 0)):
        content = out.response["choices"][0]["logprobs"]["content"]
        assert content and len(content) <= len(out.logprobs)
        # deepseek-recipe writes them as fp32 (shortest repr), as computed
        assert [c["logprob"] for c in content] == pytest.approx([e.logprob for e in out.logprobs[: len(content)]],
                                                                rel=1e-7)
        for c, e in zip(content, out.logprobs):
            assert len(c["top_logprobs"]) == k and isinstance(c["bytes"], list) and isinstance(c["token"], str)
            assert [t["logprob"] for t in c["top_logprobs"]] == pytest.approx([v for _, v in e.top], rel=1e-7)
    try:
        from openai.types.chat import ChatCompletion
    except ImportError:
        pass
    else:
        ChatCompletion.model_validate(outs[0].response)
    # the same batch (logits of a row may differ in the last bit with its batch until the ops are batch-invariant),
    # `seed` for `seq_seed`, asynchronous scheduling off
    again = off.serve(lines[:2] + [chat("c", logprobs=True, temperature=1.0, seed=3)], use_tqdm=False)
    assert [(o.token_ids, o.logprobs) for o in again] == [(o.token_ids, o.logprobs) for o in outs]
    assert again[2].response["choices"][0]["logprobs"] == outs[2].response["choices"][0]["logprobs"]


def test_streamed_chunks_carry_logprobs(pair):
    on, _ = pair
    out = on.serve([chat("s", logprobs=True, top_logprobs=2, temperature=0)], stream=True, use_tqdm=False)[0]
    streamed = [c for ch in out.chunks for choice in ch["data"].get("choices", [])
                for c in ((choice.get("logprobs") or {}).get("content") or [])]
    assert streamed == out.response["choices"][0]["logprobs"]["content"]


def test_responses_logprobs_with_include(pair):
    on, _ = pair
    body = {"model": "deepinfer", "input": "Hi", "max_output_tokens": 5, "temperature": 0}
    lines = [{"custom_id": "r", "url": "/v1/responses",
              "body": {**body, "include": ["message.output_text.logprobs"], "top_logprobs": 2}},
             {"custom_id": "q", "url": "/v1/responses", "body": {**body, "top_logprobs": 2}}]
    with_include, without = on.serve(lines, use_tqdm=False)
    texts = [c for item in with_include.response["output"] if item["type"] == "message" for c in item["content"]]
    assert texts and all(len(t["top_logprobs"]) == 2 for c in texts for t in c["logprobs"])
    assert with_include.logprobs is not None and without.logprobs is None


def test_api_seq_seed_conflict_is_a_400(pair):
    out = pair[0].serve([chat("x", seed=1, seq_seed=2)], use_tqdm=False)[0]
    assert isinstance(out, APIError) and out.status_code == 400
    assert "seed=1" in out.message and "seq_seed=2" in out.message


# ---- the batch-invariance flag -------------------------------------------------------------------------------
class _Stop(ConfigError):
    pass


@pytest.fixture
def wiring(monkeypatch):
    """Record what `LLM` passes to the backend and the engine options, and stop before the model is built."""
    import deepinfer.api as api

    seen = {}
    select = api.select_backend

    def selected(name, cache_dir, env=None, invariant=False):
        seen["invariant"] = invariant
        return select(name, cache_dir, env)

    def assembled(cfg, model_dir, backend, dtype, env, opts, *rest, **kw):
        seen["opts"] = opts
        raise _Stop("stopped after the options")

    monkeypatch.setattr(api, "select_backend", selected)
    monkeypatch.setattr(api, "assemble_v4", assembled)
    return seen


@pytest.mark.parametrize("args, env, want", [(["--batch-invariant"], {}, True), ([], {}, False),
                                             ([], {"DEEPINFER_BATCH_INVARIANT": "1"}, True),
                                             (["--no-batch-invariant"], {"DEEPINFER_BATCH_INVARIANT": "1"}, False)])
def test_batch_invariant_flag_reaches_the_backend_and_engine_options(wiring, args, env, want):
    result = invoke(["--token-ids", "5", *args], env={"DEEPINFER_BATCH_INVARIANT": "", **env})
    assert "stopped after the options" in result.output, result.output
    assert wiring["invariant"] is want and wiring["opts"].batch_invariant is want


def test_batch_invariant_argument(wiring, monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    for arg, want in ((None, True), (False, False), (True, True)):
        with pytest.raises(_Stop):
            deepinfer.LLM(batch_invariant=arg)
        assert wiring["invariant"] is want and wiring["opts"].batch_invariant is want
    with pytest.raises(ConfigError, match="batch_invariant='yes' is invalid"):
        deepinfer.LLM(batch_invariant="yes")
    assert "batch_invariant" in deepinfer.api._LLM_ARGS  # rank workers get it too


def test_batch_invariance_refused_for_v41(tmp_path):
    from tests.v41_dirs import model_dir

    with pytest.raises(ConfigError, match="batch invariance is implemented for DeepSeek-V4.*V4.1"):
        deepinfer.LLM(model_dir(tmp_path), batch_invariant=True)


def test_a_responses_include_of_any_other_shape_is_a_400_not_a_crash():
    from deepinfer.serving.api_requests import _BadParam, _refuse_unsupported

    for include in ([{"x": 1}], [["message.output_text.logprobs"]], "message.output_text.logprobs", [3]):
        with pytest.raises(_BadParam, match="include=.*only 'message.output_text.logprobs' is supported"):
            _refuse_unsupported("responses", {"model": "m", "input": "hi", "include": include})
