"""Hostile and mistaken input on every surface: the model directory, checkpoint files, config values, CLI
flags, prompts-file lines, API bodies, the Python API and `compile`. Each case asserts the exception type (or
the exit status) and that the message names the bad value; none may end in a traceback or run past a bound."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import deepinfer
from deepinfer.cli import EXIT_FAILED_REQUESTS, main
from deepinfer.errors import ConfigError, RequestError, WeightsError
from deepinfer.runtime.request import RequestFailure
from deepinfer.runtime.sampling import SamplingParams
from deepinfer.serving.api_requests import APIError
from tests.helpers import TINY_A, hf_model

BOUND_S = 90  # no case may run longer (the slowest load the tiny model at most once)
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def llm():
    return deepinfer.LLM(max_num_seqs=8)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("bad") / "tiny"
    hf_model(TINY_A).save_pretrained(path)
    return path


def bounded(fn):
    start = time.monotonic()
    try:
        return fn()
    finally:
        assert time.monotonic() - start < BOUND_S


# ---- model directory, config values, checkpoint files ---------------------------------------------------

def _config(key, value):
    def mutate(path: Path) -> None:
        raw = json.loads((path / "config.json").read_text())
        raw[key] = value
        (path / "config.json").write_text(json.dumps(raw))
    return mutate


def _write(name, data: bytes | str):
    def mutate(path: Path) -> None:
        target = path / name
        target.write_bytes(data.encode() if isinstance(data, str) else data)
    return mutate


def _truncate(fraction):
    def mutate(path: Path) -> None:
        f = path / "model.safetensors"
        data = f.read_bytes()
        f.write_bytes(data[: int(len(data) * fraction)])
    return mutate


def _tensors(edit):
    def mutate(path: Path) -> None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(path / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(path / "model.safetensors"))
    return mutate


def _index(weight_map, move=True):
    def mutate(path: Path) -> None:
        if move:
            (path / "model.safetensors").rename(path / "shard-1.safetensors")
        (path / "model.safetensors.index.json").write_text(
            weight_map if isinstance(weight_map, str) else json.dumps({"weight_map": weight_map(path)}))
    return mutate


def _keys_of(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path / "shard-1.safetensors"), framework="pt") as f:
        return list(f.keys())


def _remove(name):
    return lambda path: (path / name).unlink()


def _shrink_first_weight(tensors):
    key = next(k for k in tensors if k.endswith("wq_a.weight"))
    tensors[key] = tensors[key][:-1]


def _drop_one(tensors):
    del tensors[next(k for k in tensors if k.endswith("wo_a.weight"))]


MODEL_DIR_CASES = [
    ("config: not JSON", _write("config.json", "{not json"), ConfigError, "not valid JSON"),
    ("config: a list", _write("config.json", "[1, 2]"), ConfigError, "got list"),
    ("config: no config.json", _remove("config.json"), ConfigError, "has no config.json"),
    ("config: hidden_size -1", _config("hidden_size", -1), ConfigError, "hidden_size must be an integer >= 1, got -1"),
    ("config: vocab_size text", _config("vocab_size", "big"), ConfigError, "vocab_size must be an integer >= 1, got 'big'"),
    ("config: kv heads 2", _config("num_key_value_heads", 2), ConfigError, "num_key_value_heads must be 1"),
    ("config: hidden_act gelu", _config("hidden_act", "gelu"), ConfigError, "'gelu'"),
    ("config: top-k > experts", _config("num_experts_per_tok", 99), ConfigError, "num_experts_per_tok (99)"),
    ("config: scoring func", _config("scoring_func", "tanh"), ConfigError, "'tanh'"),
    ("config: eos text", _config("eos_token_id", "eos"), ConfigError, "eos_token_id"),
    ("config: layer_types length", _config("layer_types", ["sliding_attention"]), ConfigError, "layer_types"),
    ("config: rope type", _config("rope_parameters", {"rope_type": "weird", "factor": 2}), ConfigError, "'weird'"),
    ("config: o_groups", _config("o_groups", 7), ConfigError, "o_groups (7)"),
    ("config: max_position 0", _config("max_position_embeddings", 0), ConfigError, "max_position_embeddings"),
    ("config: max_position huge", _config("max_position_embeddings", 2**62), ConfigError, str(2**62)),
    ("config: rms_norm_eps -1", _config("rms_norm_eps", -1), ConfigError, "rms_norm_eps must be a finite number > 0"),
    ("config: rope_theta 0", _config("rope_theta", 0), ConfigError, "rope_theta"),
    ("config: eos -1", _config("eos_token_id", -1), ConfigError, "got -1"),
    ("config: eos beyond vocab", _config("eos_token_id", [1, 10**9]), ConfigError, "1000000000"),
    ("config: bos text", _config("bos_token_id", "x"), ConfigError, "bos_token_id"),
    ("config: routed scaling -1", _config("routed_scaling_factor", -1), ConfigError, "routed_scaling_factor"),
    ("config: tie text", _config("tie_word_embeddings", "yes"), ConfigError, "tie_word_embeddings"),
    ("config: torch_dtype 5", _config("torch_dtype", 5), ConfigError, "torch_dtype"),
    ("checkpoint: zero bytes", _write("model.safetensors", b""), WeightsError, "model.safetensors"),
    ("checkpoint: truncated", _truncate(0.5), WeightsError, "truncated"),
    ("checkpoint: header only", _truncate(0.001), WeightsError, "model.safetensors"),
    ("checkpoint: garbage", _write("model.safetensors", b"\xff" * 64), WeightsError, "not a valid safetensors"),
    ("checkpoint: none", _remove("model.safetensors"), WeightsError, "holds no model.safetensors"),
    ("checkpoint: missing tensor", _tensors(_drop_one), WeightsError, "lacks 1 tensor(s)"),
    ("checkpoint: wrong shape", _tensors(_shrink_first_weight), WeightsError, "wq_a.weight) has shape"),
    ("index: not JSON", _index("{oops"), WeightsError, "model.safetensors.index.json"),
    ("index: weight_map a list", _index('{"weight_map": [1]}'), WeightsError, "weight_map"),
    ("index: shard outside", _index(lambda p: {k: "../evil.safetensors" for k in _keys_of(p)}), WeightsError,
     "'../evil.safetensors'"),
    ("index: absolute shard", _index(lambda p: {k: "/etc/passwd" for k in _keys_of(p)}), WeightsError, "'/etc/passwd'"),
    ("index: missing shard", _index(lambda p: {k: "shard-2.safetensors" for k in _keys_of(p)}), WeightsError,
     "'shard-2.safetensors'"),
    ("index: tensor not in shard", _index(lambda p: {**{k: "shard-1.safetensors" for k in _keys_of(p)},
                                                     "model.ghost.weight": "shard-1.safetensors"}), WeightsError,
     "'model.ghost.weight'"),
    ("index: shard name not text", _index(lambda p: {k: 5 for k in _keys_of(p)}), WeightsError, "maps to 5"),
    ("tokenizer: garbage", _write("tokenizer.json", "{}"), ConfigError, "tokenizer.json"),
]


@pytest.mark.parametrize("name, mutate, error, message", MODEL_DIR_CASES, ids=[c[0] for c in MODEL_DIR_CASES])
def test_bad_model_directory(saved, tmp_path, name, mutate, error, message):
    path = tmp_path / "model"
    shutil.copytree(saved, path)
    mutate(path)
    with pytest.raises(error, match=_re(message)):
        bounded(lambda: deepinfer.LLM(path, max_num_seqs=2))


def test_model_directory_that_is_missing_or_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    for bad in (tmp_path / "nope", tmp_path / "file"):
        with pytest.raises(ConfigError, match=_re(str(bad))):
            deepinfer.LLM(bad)


# ---- Python API ------------------------------------------------------------------------------------------

LLM_ARG_CASES = [
    ({"model": 123}, "model=123"),
    ({"max_num_seqs": "4"}, "max_num_seqs='4'"),
    ({"max_num_seqs": 0}, "max_num_seqs=0"),
    ({"max_prefill_tokens": -1}, "max_prefill_tokens=-1"),
    ({"max_model_len": 1}, "max_model_len=1"),
    ({"max_model_len": 10**9}, "max_model_len=1000000000"),
    ({"num_blocks": 0}, "num_blocks=0"),
    ({"num_blocks": 10**7}, "num_blocks=10000000"),
    ({"max_num_seqs": 10**6}, "max_num_seqs=1000000"),
    ({"dtype": "fp8"}, "'fp8'"),
    ({"dtype": 5}, "dtype=5"),
    ({"backend": "tpu"}, "'tpu'"),
    ({"backend": 7}, "backend=7"),
    ({"tokenizer": "/nope/tokenizer.json"}, "/nope/tokenizer.json"),
    ({"gpu_memory_utilization": 2}, "gpu_memory_utilization=2"),
    ({"random_seed": "x"}, "random_seed='x'"),
    ({"quantization": "int4"}, "quantization='int4'"),
    ({"random_seed": 2**70}, f"random_seed={2**70}"),
]


@pytest.mark.parametrize("kwargs, message", LLM_ARG_CASES, ids=[next(iter(c[0])) + "-" + str(i)
                                                                for i, c in enumerate(LLM_ARG_CASES)])
def test_bad_llm_arguments(kwargs, message):
    with pytest.raises(ConfigError, match=_re(message)):
        bounded(lambda: deepinfer.LLM(**kwargs))


GENERATE_CASES = [
    (lambda llm: llm.generate(None), "got None"),
    (lambda llm: llm.generate(5), "got 5"),
    (lambda llm: llm.generate([5]), "got int"),
    (lambda llm: llm.generate({"foo": 1}), "['foo']"),
    (lambda llm: llm.generate({"prompt": 5}), "got int"),
    (lambda llm: llm.generate({"token_ids": "abc"}), "got 'abc'"),
    (lambda llm: llm.generate({"token_ids": [1, -1]}), "token id -1"),
    (lambda llm: llm.generate({"token_ids": [10**7]}), "token id 10000000"),
    (lambda llm: llm.generate({"token_ids": []}), "the prompt is empty"),
    (lambda llm: llm.generate({"token_ids": [1] * 9000}), "9000 tokens"),
    (lambda llm: llm.generate({"prompt": "x", "colour": "red"}), "['colour']"),
    (lambda llm: llm.generate("hi", {"temperature": -1}), "temperature=-1"),
    (lambda llm: llm.generate("hi", {"bogus": 1}), "['bogus']"),
    (lambda llm: llm.generate("hi", "greedy"), "got str"),
    (lambda llm: llm.generate(["a", "b"], [SamplingParams()]), "1 sampling parameter sets for 2 prompts"),
    (lambda llm: llm.generate("\ud800"), "'\\ud800'"),
    (lambda llm: llm.generate({"messages": "hi"}), "got 'hi'"),
    (lambda llm: llm.generate({"messages": [{"role": "wizard", "content": "x"}]}), "wizard"),
    (lambda llm: llm.generate({"messages": USER, "thinking": "no"}), "got 'no'"),
    (lambda llm: llm.generate({"messages": USER, "thinking": True, "max_reasoning_tokens": -3}), "got -3"),
    (lambda llm: llm.generate({"messages": USER, "max_reasoning_tokens": 5}), "(5) needs thinking"),
    (lambda llm: llm.generate({"prompt": "x", "thinking": True}), "'thinking' applies to chat prompts"),
    (lambda llm: llm.generate({"prompt": "x", "so_args": {"regex": "("}}), "invalid regex"),
    (lambda llm: llm.generate({"prompt": "x", "so_args": {"json_schema": 5}}), "got int"),
    (lambda llm: llm.generate({"prompt": "x", "so_args": {"regex": "a", "ebnf": "b"}}), "['ebnf', 'regex']"),
    (lambda llm: llm.generate({"prompt": "x", "so_args": "json"}), "got 'json'"),
    (lambda llm: llm.generate("hi", errors="ignore"), "errors='ignore'"),
    (lambda llm: llm.generate("hi", {"logit_bias": {"999999": 1}}), "logit_bias token id 999999"),
    (lambda llm: llm.generate("hi", {"logit_bias": {"\u00b2": 1}}, errors="raise"), "logit_bias"),
    (lambda llm: llm.chat(["hello"]), "got ['hello']"),
    (lambda llm: llm.chat([]), "got []"),
    (lambda llm: llm.chat("hello"), "got 'hello'"),
    (lambda llm: llm.chat([[{"role": "user", "content": "a"}], "b"]), "got [[{"),
    (lambda llm: llm.serve("x"), "got str"),
    (lambda llm: SamplingParams(stop=5), "stop=5"),
    (lambda llm: SamplingParams(top_p=0), "top_p=0"),
    (lambda llm: SamplingParams(seed="x"), "seed='x'"),
    (lambda llm: SamplingParams(logit_bias={1: 500}), "{1: 500}"),
    (lambda llm: SamplingParams(max_new_tokens=1.5), "max_new_tokens=1.5"),
    (lambda llm: SamplingParams(presence_penalty=float("nan")), "presence_penalty=nan"),
]


@pytest.mark.parametrize("call, message", GENERATE_CASES, ids=[str(i) for i in range(len(GENERATE_CASES))])
def test_bad_python_api_calls(llm, call, message):
    with pytest.raises(RequestError, match=_re(message)):
        bounded(lambda: call(llm))


def test_errors_return_keeps_the_good_prompts(llm):
    seen = []
    out = llm.generate(["a", {"token_ids": []}, {"token_ids": [5, 6]}], SamplingParams(max_new_tokens=2),
                       errors="return", use_tqdm=False, on_output=seen.append)
    assert isinstance(out[1], RequestFailure) and out[1].index == 1 and "empty" in out[1].error
    assert [o.num_generated_tokens for o in (out[0], out[2])] == [2, 2]
    assert isinstance(seen[0], RequestFailure) and sorted(o.index for o in seen) == [0, 1, 2]


# ---- API bodies ------------------------------------------------------------------------------------------

def _chat(**body):
    return {"url": "/v1/chat/completions", "body": {"model": "deepinfer", "messages": USER, "max_tokens": 4, **body}}


def _resp(**body):
    return {"url": "/v1/responses", "body": {"model": "deepinfer", "input": "Hi", "max_output_tokens": 4, **body}}


def _msg(**body):
    return {"url": "/v1/messages", "body": {"model": "deepinfer", "messages": USER, "max_tokens": 4, **body}}


TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}
API_CASES = [
    ("not an object", [1, 2], "got list"),
    ("unknown url", {"url": "/v1/completions", "body": {}}, "'/v1/completions'"),
    ("no body", {"url": "/v1/chat/completions"}, "got NoneType"),
    ("body a string", {"url": "/v1/chat/completions", "body": "hi"}, "got str"),
    ("chat unknown field", _chat(foo=1), "['foo']"),
    ("chat logprobs", _chat(logprobs="yes"), 'logprobs="yes"'),
    ("chat top_logprobs", _chat(top_logprobs=5), "logprobs must be set to true if top_logprobs"),
    ("chat top_logprobs 21", _chat(logprobs=True, top_logprobs=21), "range of top_logprobs is [0, 20]"),
    ("chat seq_seed", _chat(seed=1, seq_seed=2), "seq_seed=2"),
    ("chat n", _chat(n=2), "n"),
    ("chat temperature", _chat(temperature=5), "temperature"),
    ("chat max_tokens 0", _chat(max_tokens=0), "max_tokens"),
    ("chat max_tokens text", _chat(max_tokens="x"), "\"x\""),
    ("chat messages text", _chat(messages="hi"), "\"hi\""),
    ("chat model", _chat(model="gpt-4"), "gpt-4"),
    ("chat response_format", _chat(response_format={"type": "yaml"}), "yaml"),
    ("chat tool_choice", _chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}), "nope"),
    ("chat presence_penalty", _chat(presence_penalty=3), "presence_penalty=3"),
    ("chat logit_bias key", _chat(logit_bias={"x": 1}), "'x'"),
    ("chat logit_bias value", _chat(logit_bias={"5": 500}), "500"),
    ("chat logit_bias id", _chat(logit_bias={"99999999": 1}), "99999999"),
    ("chat so_args", _chat(so_args={"regex": "("}), "invalid regex"),
    ("chat budget", _chat(max_reasoning_tokens=-3, thinking={"type": "enabled"}), "got -3"),
    ("chat budget no thinking", _chat(max_reasoning_tokens=5), "(5) needs thinking"),
    ("chat context", _chat(max_tokens=300000), "300000"),
    ("chat completion tokens", _chat(max_tokens=5, max_completion_tokens=6), "max_completion_tokens=6"),
    ("chat seed", _chat(seed=-1), "seed"),
    ("chat stream_options", _chat(stream_options={"include_usage": True}), "stream_options"),
    ("chat thinking no", _chat(thinking="no"), "ChatCompletionThinking"),
    ("chat min_p", _chat(min_p=2), "min_p=2"),
    ("chat repetition_penalty", _chat(repetition_penalty=0), "repetition_penalty=0"),
    ("chat top_k", _chat(top_k=-1), "top_k=-1"),
    ("chat ignore_eos", _chat(ignore_eos="yes"), "ignore_eos='yes'"),
    ("chat role", _chat(messages=[{"role": "wizard", "content": "x"}]), "wizard"),
    ("chat empty messages", _chat(messages=[]), "messages"),
    ("responses store", _resp(store=True), "store=True"),
    ("responses include", _resp(include=["reasoning.encrypted_content"]), "reasoning.encrypted_content"),
    ("responses truncation", _resp(truncation="auto"), "truncation='auto'"),
    ("responses previous id", _resp(previous_response_id="resp_1"), "['previous_response_id']"),
    ("responses regex format", _resp(text={"format": {"type": "regex", "pattern": "a"}}), "regex"),
    ("responses seed", _resp(seed="x"), "seed='x'"),
    ("responses max_output_tokens", _resp(max_output_tokens=-5), "max_output_tokens"),
    ("messages no max_tokens", {"url": "/v1/messages", "body": {"model": "deepinfer", "messages": USER}}, "max_tokens"),
    ("messages top_k", _msg(top_k=-1), "top_k=-1"),
    ("messages thinking no", _msg(thinking="no"), "MessagesThinking"),
    ("messages output format", _msg(output_config={"format": {"type": "regex"}}), "'regex'"),
    ("messages container", _msg(container="c1"), "['container']"),
    ("messages stop_sequences", _msg(stop_sequences=5), "stop_sequences"),
    ("messages server tool", _msg(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "server tools"),
    ("chat stream true", _chat(stream=True), "stream=True"),
    ("chat logit_bias digit", _chat(logit_bias={"\u00b2": 1}), "logit_bias"),
]


@pytest.fixture(scope="module")
def api_results(llm):
    lines = [dict(line, custom_id=name) if isinstance(line, dict) else line for name, line, _ in API_CASES]
    return bounded(lambda: llm.serve(lines, use_tqdm=False))


@pytest.mark.parametrize("i", range(len(API_CASES)), ids=[c[0] for c in API_CASES])
def test_bad_api_bodies_get_a_400_naming_the_value(api_results, i):
    name, line, message = API_CASES[i]
    result = api_results[i]
    assert isinstance(result, APIError), (name, result)
    assert result.status_code == 400 and message in result.message, (name, result.body)
    if isinstance(line, dict) and line.get("url") == "/v1/messages":  # Anthropic's error shape
        assert result.body["type"] == "error" and set(result.body["error"]) == {"type", "message"}
    else:
        assert set(result.body) == {"error"} and result.body["error"]["type"] == "invalid_request_error"


def test_anthropic_tool_choice_any_forces_a_tool_call(llm):
    tool = {"name": "pick", "input_schema": {"type": "object", "properties": {"c": {"type": "string", "enum": ["a"]}},
                                             "required": ["c"]}}
    lines = [dict(_msg(max_tokens=300, tools=[tool], tool_choice={"type": "any"}, temperature=1.0, top_k=50, seed=s),
                  custom_id=str(s)) for s in range(3)]
    for out in llm.serve(lines, use_tqdm=False):
        assert out.response["stop_reason"] == "tool_use", out.response
        assert [b["name"] for b in out.response["content"] if b["type"] == "tool_use"][:1] == ["pick"]


# ---- CLI flags -------------------------------------------------------------------------------------------

def run_cli(args, env=None):
    result = CliRunner().invoke(main, args, env={"DEEPINFER_HF_MODEL_DIR": "", **(env or {})})
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    return result


CLI_CASES = [
    (["--max-num-seqs", "0"], 2, "'--max-num-seqs': 0"),
    (["--max-prefill-tokens", "0"], 2, "'--max-prefill-tokens': 0"),
    (["--num-blocks", "0"], 2, "'--num-blocks': 0"),
    (["--num-blocks", "10000000"], 1, "num_blocks=10000000"),
    (["--max-num-seqs", "1000000"], 1, "max_num_seqs=1000000"),
    (["--max-model-len", "1"], 2, "'--max-model-len': 1"),
    (["--max-model-len", "100000000"], 1, "max_model_len=100000000"),
    (["--max-new-tokens", "0"], 2, "'--max-new-tokens': 0"),
    (["--temperature", "-1"], 2, "'--temperature': -1"),
    (["--top-p", "0"], 2, "'--top-p': 0"),
    (["--top-p", "1.5"], 2, "'--top-p': 1.5"),
    (["--top-k", "-1"], 2, "'--top-k': -1"),
    (["--min-p", "2"], 2, "'--min-p': 2"),
    (["--presence-penalty", "3"], 2, "'--presence-penalty': 3"),
    (["--repetition-penalty", "0"], 2, "'--repetition-penalty': 0"),
    (["--seed", "-1"], 2, "'--seed': -1"),
    (["--seed", "abc"], 2, "'abc'"),
    (["--stop", ""], 2, "stop=('',)"),
    (["--dtype", "fp8"], 2, "'fp8'"),
    (["--backend", "tpu"], 2, "'tpu'"),
    (["--format", "xml"], 2, "'xml'"),
    (["--quantization", "int4"], 2, "'int4'"),
    (["--token-ids", "1,x"], 2, "'1,x'"),
    (["--token-ids=-5"], 2, "'-5'"),
    (["--prompts-file", "/nonexistent.jsonl"], 2, "/nonexistent.jsonl"),
    (["--output", "/proc/nope/out.txt"], 1, "/proc/nope/out.txt"),
    (["--output", "/"], 1, "'/'"),
    (["--model", "/nonexistent/model"], 1, "/nonexistent/model"),
    (["--stream"], 1, "--stream needs"),
    (["--temperature", "nan"], 2, "--temperature: nan is not a finite number"),
    (["--repetition-penalty", "inf"], 2, "--repetition-penalty: inf is not a finite number"),
    (["--raw", "--thinking"], 2, "--thinking applies to chat prompts"),
]


@pytest.mark.parametrize("args, status, message", CLI_CASES, ids=[" ".join(c[0]) for c in CLI_CASES])
def test_bad_cli_flags(args, status, message):
    result = bounded(lambda: run_cli(["run", "offline", "--prompt", "a", *args]))
    assert result.exit_code == status and message in result.output, result.output


def test_bad_cli_environment_and_combinations(tmp_path):
    result = run_cli(["run", "offline", "--prompt", "a"], env={"DEEPINFER_ACCELERATOR": "tpu"})
    assert result.exit_code == 1 and "DEEPINFER_ACCELERATOR='tpu'" in result.output
    result = run_cli(["run", "offline"])
    assert result.exit_code == 1 and "no prompt given" in result.output
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps(_chat()) + "\n" + json.dumps({"prompt": "x"}) + "\n")
    result = run_cli(["run", "offline", "--prompts-file", str(mixed)])
    assert result.exit_code == 1 and "cannot be mixed" in result.output
    api = tmp_path / "api.jsonl"
    api.write_text(json.dumps(_chat()) + "\n")
    result = run_cli(["run", "offline", "--prompts-file", str(api), "--format", "text"])
    assert result.exit_code == 1 and "--format text" in result.output
    result = run_cli(["run", "offline", "--prompts-file", str(api), "--temperature", "0", "--stop", "x", "--thinking"])
    assert result.exit_code == 2 and "--stop, --temperature, --thinking: requests in an API's shape" in result.output
    result = run_cli(["run", "offline", "--prompts-file", str(tmp_path)])
    assert result.exit_code == 2 and str(tmp_path) in result.output
    (tmp_path / "model-file").write_text("x")
    result = run_cli(["run", "offline", "--prompt", "a", "--model", str(tmp_path / "model-file")])
    assert result.exit_code == 2 and "model-file" in result.output


# ---- prompts-file lines ----------------------------------------------------------------------------------

LINE_CASES = [
    (b"{not json", "not valid JSON"),
    (b'{"prompt": "caf\xe9"}', "not valid UTF-8 (byte 0xe9"),
    (b'{"prompt": "\\ud800"}', "'\\ud800'"),
    (b"[1, 2]", "got list"),
    (b'{"prompt": "x", "colour": "red"}', "['colour']"),
    (b'{"messages": [{"role": "user", "content": "x"}], "thinking": "no"}', "got 'no'"),
    (b'{"messages": [{"role": "user", "content": "x"}], "thinking": true, "max_reasoning_tokens": -3}', "got -3"),
    (b'{"token_ids": [1, 99999999]}', "token id 99999999"),
    (b'{"token_ids": []}', "the prompt is empty"),
    (b'{"prompt": "x", "temperature": "hot"}', "temperature='hot'"),
    (b'{"prompt": "x", "top_p": 0}', "top_p=0"),
    (b'{"prompt": "x", "max_new_tokens": 0}', "max_new_tokens=0"),
    (b'{"prompt": "x", "stop": 5}', "stop=5"),
    (b'{"prompt": "x", "so_args": {"regex": "("}}', "invalid regex"),
    (b'{"prompt": ""}', "the prompt is empty"),
    (b'{"prompt": "x", "messages": []}', "exactly one of"),
    (b'{"prompt": "x", "logit_bias": {"99999999": 1}}', "99999999"),
    (b'{"messages": [{"role": "wizard", "content": "x"}]}', "wizard"),
    (b'{"prompt": "x", "seed": -2}', "seed=-2"),
    (b'{"prompt": "x", "repetition_penalty": -1}', "repetition_penalty=-1"),
]


@pytest.fixture(scope="module")
def file_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lines")
    path, out = root / "prompts.jsonl", root / "out.jsonl"
    good = b'{"token_ids": [5, 6, 7], "max_new_tokens": 3}'
    path.write_bytes(b"\n".join([good] + [line for line, _ in LINE_CASES] + [good]) + b"\n")
    result = bounded(lambda: run_cli(["run", "offline", "--prompts-file", str(path), "--format", "jsonl",
                                      "--output", str(out)]))
    rows = {r["index"]: r for r in map(json.loads, out.read_text(encoding="utf-8").splitlines())}
    return result, rows, path


@pytest.mark.parametrize("i", range(len(LINE_CASES)), ids=[str(i) for i in range(len(LINE_CASES))])
def test_bad_prompts_file_line_gets_an_error_record(file_run, i):
    result, rows, path = file_run
    row = rows[i + 1]
    assert row["source"] == f"{path}:{i + 2}", row
    assert LINE_CASES[i][1] in row["error"]["message"], row


def test_a_batch_with_bad_lines_keeps_its_good_outputs(file_run):
    result, rows, _ = file_run
    assert result.exit_code == EXIT_FAILED_REQUESTS
    assert f"{len(LINE_CASES)} of {len(LINE_CASES) + 2} request(s) failed" in result.output
    last = len(LINE_CASES) + 1
    assert rows[0]["num_generated_tokens"] == 3 and rows[last]["num_generated_tokens"] == 3
    assert sorted(rows) == list(range(last + 1))


# ---- compile -----------------------------------------------------------------------------------------------

COMPILE_CASES = [
    (["--target", "bogus"], 2, "'bogus'"),
    ([], 2, "--target"),
    (["--target", "c", "--out", "/proc/nope"], 1, "/proc/nope"),
    (["--target", "c", "--jobs", "0"], 2, "'--jobs': 0"),
    (["--target", "c", "--model", "/nonexistent/model"], 1, "/nonexistent/model"),
    (["--target", "c", "--ops", "foo,linear"], 1, "['foo']"),
    (["--target", "c", "--dtype", "fp8"], 2, "'fp8'"),
    (["--target", "cpu"], 2, "'cpu'"),
    (["--target", "c", "--tensor-parallel-size", "3"], 1, "tensor_parallel_size=3 must divide"),
    (["--target", "c", "--eplb-redundant-experts", "2"], 1, "--eplb-redundant-experts needs --enable-expert-parallel"),
]


@pytest.mark.parametrize("args, status, message", COMPILE_CASES, ids=[" ".join(c[0]) or "none" for c in COMPILE_CASES])
def test_bad_compile_invocations(args, status, message):
    result = bounded(lambda: run_cli(["compile", *args]))
    assert result.exit_code == status and message in result.output, result.output


def _re(text: str) -> str:
    import re

    return re.escape(text)


def test_api_file_with_broken_lines_answers_the_others(tmp_path):
    path, out = tmp_path / "api.jsonl", tmp_path / "out.jsonl"
    path.write_text(json.dumps(dict(_chat(), custom_id="good")) + "\n{truncated\n[1]\n")
    result = run_cli(["run", "offline", "--prompts-file", str(path), "--output", str(out)])
    assert result.exit_code == EXIT_FAILED_REQUESTS, result.output
    rows = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["good"]["response"]["status_code"] == 200
    assert rows["line-2"]["response"]["status_code"] == 400 and "api.jsonl:2: not valid JSON" in \
        rows["line-2"]["response"]["body"]["error"]["message"]
    assert "got list" in rows["line-3"]["response"]["body"]["error"]["message"]


def test_sharded_checkpoint_through_symlinks_loads(saved, tmp_path):
    """The HF cache layout: snapshot files are symlinks into ../../blobs; names inside the directory are fine."""
    from deepinfer.weights.loader import checkpoint_files

    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    blobs.mkdir()
    snap.mkdir(parents=True)
    shutil.copy(saved / "model.safetensors", blobs / "abc123")
    (snap / "model-00001-of-00001.safetensors").symlink_to("../../blobs/abc123")
    shutil.copy(saved / "config.json", snap / "config.json")
    from safetensors import safe_open

    with safe_open(str(blobs / "abc123"), "pt") as f:
        keys = list(f.keys())
    (snap / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "model-00001-of-00001.safetensors" for k in keys}}))
    assert len(checkpoint_files(snap)) == len(keys)
    deepinfer.LLM(snap, max_num_seqs=2)


def test_a_uniform_next_to_one_never_draws_a_dropped_token(monkeypatch):
    import torch

    from deepinfer.runtime import sampler

    monkeypatch.setattr(sampler, "uniform", lambda key: 1 - 1e-12)
    logits = torch.randn(2, 50)
    logits[:, 40:] = float("-inf")
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=5)]
    tokens = sampler.sample(logits, params, [0, 1], [0, 0])
    assert tokens[0] < 40 and tokens[1] in logits[1].topk(5).indices.tolist()


def test_a_tiny_temperature_is_greedy():
    import torch

    from deepinfer.runtime.sampler import sample

    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=t) for t in (1e-50, 1e-40, 1e-6)]
    assert sample(logits, params, [0, 1, 2], [0, 0, 0]) == logits.argmax(-1).tolist()
