"""`deepinfer run offline` end to end: the default tiny model and a saved model directory, text and jsonl."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

from deepinfer.cli import main
from tests.helpers import TINY_A, hf_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "tiny"
    hf_model(TINY_A).save_pretrained(path)
    return path


def invoke(args, env=None):
    result = CliRunner().invoke(main, ["run", "offline", *args], env={"DEEPINFER_HF_MODEL_DIR": "", **(env or {})},
                                catch_exceptions=False)
    return result


def test_console_script_on_the_default_tiny_model():
    env = {k: v for k, v in os.environ.items() if k != "DEEPINFER_HF_MODEL_DIR"}
    proc = subprocess.run(
        [sys.executable, "-m", "deepinfer", "run", "offline", "--prompt", "Hello", "--max-new-tokens", "6",
         "--temperature", "0"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "RANDOM weights" in proc.stderr
    assert "=== request 0 (" in proc.stdout and "finish: length" in proc.stdout
    assert "decode" in proc.stderr and "tok/s" in proc.stderr and "first token" in proc.stderr


def test_jsonl_on_a_saved_model_with_a_prompts_file(saved, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"token_ids": list(range(2, 40)), "max_new_tokens": 5, "temperature": 0}) + "\n\n"
        + json.dumps({"token_ids": [5, 6, 7], "max_new_tokens": 3, "seed": 4, "stop": ["zzz"]}) + "\n"
    )
    out = tmp_path / "out.jsonl"
    result = invoke(["--model", str(saved), "--prompts-file", str(prompts), "--token-ids", "3,4,5",
                     "--max-new-tokens", "2", "--seed", "1", "--format", "jsonl", "--output", str(out)])
    assert result.exit_code == 0, result.output  # seeded: a random seed could draw an end token (finish "stop")
    rows = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["index"])
    assert [r["index"] for r in rows] == [0, 1, 2]  # completion order on disk; index: --token-ids, then the file
    assert [r["num_generated_tokens"] for r in rows] == [2, 5, 3]
    assert [r["num_prompt_tokens"] for r in rows] == [3, 38, 3]
    for r in rows:
        assert set(r) >= {"token_ids", "text", "finish_reason", "num_prompt_tokens", "num_generated_tokens"}
        assert r["finish_reason"] == "length" and len(r["token_ids"]) == r["num_generated_tokens"]


def test_text_output_on_a_saved_model_via_the_environment(saved):
    result = invoke(["--token-ids", "9,10,11", "--max-new-tokens", "3", "--temperature", "0"],
                    env={"DEEPINFER_HF_MODEL_DIR": str(saved)})
    assert result.exit_code == 0, result.output
    assert "=== request 0 (3 prompt tokens, 3 generated, finish: length) ===" in result.output, result.output
    assert "RANDOM" not in result.output


def test_chat_thinking_on_the_default_model():
    result = invoke(["--prompt", "Why?", "--thinking", "--max-new-tokens", "4", "--format", "jsonl", "--seed", "1"])
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout.strip().splitlines()[-1])
    assert row["num_generated_tokens"] == 4
    assert "reasoning_content" in row  # thinking mode: the generated text is parsed as reasoning


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "no prompt given"),
        (["--token-ids", "1,x"], "not a comma-separated list"),
        (["--prompt", "a", "--temperature", "-1"], "Invalid value for '--temperature': -1.0 is not in the range x>=0"),
        (["--prompt", "a", "--model", "/nonexistent/dir"], "does not exist"),
    ],
)
def test_bad_input_is_a_clear_error(args, message):
    result = CliRunner().invoke(main, ["run", "offline", *args], env={"DEEPINFER_HF_MODEL_DIR": ""})
    assert result.exit_code != 0
    assert message in result.output


def test_bad_prompts_file_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "colour": "red"}\n')
    bad.write_text('{"prompt": "a", "colour": "red"}\n{"prompt": "b", "max_new_tokens": 2}\n')
    result = invoke(["--prompts-file", str(bad), "--format", "jsonl"])
    assert result.exit_code == 3, result.output  # some requests failed; the others ran
    rows = {r["index"]: r for r in map(json.loads, result.stdout.strip().splitlines())}
    assert rows[0]["source"].endswith("bad.jsonl:1") and "unknown key(s) ['colour']" in rows[0]["error"]["message"]
    assert rows[1]["num_generated_tokens"] == 2


API_LINES = [
    {"custom_id": "chat", "url": "/v1/chat/completions",
     "body": {"model": "deepinfer", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 20,
              "so_args": {"regex": "(hello|goodbye) world"}}},
    {"custom_id": "resp", "url": "/v1/responses", "body": {"model": "deepinfer", "input": "Hi", "max_output_tokens": 4}},
    {"custom_id": "msg", "url": "/v1/messages",
     "body": {"model": "deepinfer", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}},
    {"custom_id": "broken", "url": "/v1/messages", "body": {"model": "deepinfer", "messages": "Hi"}},
]


@pytest.mark.parametrize("stream", [False, True])
def test_api_shaped_prompts_file(tmp_path, stream):
    path = tmp_path / "batch.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in API_LINES))
    result = invoke(["--prompts-file", str(path), *(["--stream"] if stream else [])])
    assert result.exit_code == 3, result.output  # the broken line failed, the others ran
    rows = [json.loads(line) for line in result.stdout.strip().splitlines()]
    if not stream:  # OpenAI batch-output lines, in completion order (the refused line first)
        assert rows[0]["custom_id"] == "broken"
        rows = sorted(rows, key=lambda r: ["chat", "resp", "msg", "broken"].index(r["custom_id"]))
        status = [r["response"]["status_code"] for r in rows]
        assert status == [200, 200, 200, 400]
        assert re.fullmatch("(hello|goodbye) world", rows[0]["response"]["body"]["choices"][0]["message"]["content"])
        assert rows[1]["response"]["body"]["object"] == "response"
        assert rows[2]["response"]["body"]["type"] == "message"
        assert rows[3]["response"]["body"]["error"]["message"]
        return
    done = [r["custom_id"] for r in rows if r.get("data") == "[DONE]"]
    assert sorted(done) == ["broken", "chat", "msg", "resp"]
    for cid in ("chat", "resp", "msg"):  # each stream's chunks come before its [DONE]
        mine = [i for i, r in enumerate(rows) if r["custom_id"] == cid]
        assert len(mine) > 3 and rows[mine[-1]]["data"] == "[DONE]"
    assert [r.get("event") for r in rows if r["custom_id"] == "msg"][-2] == "message_stop"
    assert [r for r in rows if r["custom_id"] == "broken"][0]["status_code"] == 400


def test_stream_needs_api_shaped_requests():
    result = CliRunner().invoke(main, ["run", "offline", "--prompt", "a", "--stream"], env={"DEEPINFER_HF_MODEL_DIR": ""})
    assert result.exit_code != 0 and "--stream needs requests in an API's shape" in result.output


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_an_interrupted_run_keeps_the_finished_outputs(tmp_path, sig):
    import signal
    import time

    prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    prompts.write_text(json.dumps({"token_ids": [5, 6], "max_new_tokens": 2}) + "\n"
                       + json.dumps({"token_ids": [7, 8], "max_new_tokens": 6000, "ignore_eos": True}) + "\n")
    env = {k: v for k, v in os.environ.items() if k != "DEEPINFER_HF_MODEL_DIR"}
    # SIGINT's default action restored in the child: a suite started in the background (`cmd &`) runs with SIGINT
    # ignored, which the child would inherit (and then rightly ignore)
    proc = subprocess.Popen([sys.executable, "-m", "deepinfer", "run", "offline", "--prompts-file", str(prompts),
                             "--format", "jsonl", "--output", str(out), "--max-num-seqs", "1", "--temperature", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 240
        while not (out.exists() and out.read_text().count("\n") >= 1):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the first request never finished"
            time.sleep(0.1)
        proc.send_signal(getattr(signal, sig))
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr and "Traceback" not in stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["index"] == 0 and rows[0]["num_generated_tokens"] == 2
