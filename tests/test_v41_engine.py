"""DeepSeek-V4.1 through deepinfer's engine, API and CLI on the CPU reference path (tiny fixture `a`): greedy
tokens equal the reference's, batched equals alone, chunked prefill equals one-shot, a reused cache slot starts
clean; the Engram hasher comes from the model directory's tokenizer; `deepinfer compile` builds its kernel set;
targets it never ran on, images and chat prompts without `<｜System｜>` are refused with errors that name what is
missing."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import deepinfer
from deepinfer.cli import main
from deepinfer.errors import ConfigError, RequestError
from deepinfer.runtime.request import RequestFailure
from deepinfer.runtime.sampling import SamplingParams
from tests.v41_dirs import model_dir, stand_in_tokenizer
from tests.v41_fixture import fixture

GAP = 0.1  # greedy tokens are compared where the reference's top-2 gap exceeds this (tests/test_v41_parity.py)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return model_dir(tmp_path_factory.mktemp("v41"))


@pytest.fixture(scope="module")
def llm(path):
    return deepinfer.LLM(path, max_num_seqs=4)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)


def model_greedy(prompts: list[list[int]], steps: int) -> list[list[int]]:
    """DeepseekV41 run directly (no engine; its hasher from the fixture's stored class map): each prompt
    prefilled alone, then greedy decode steps as one batch."""
    model = fixture("a").model()
    cache = model.new_cache(len(prompts), 64)
    tokens = [[int(model.prefill(cache, torch.tensor(p), i)[-1].argmax())] for i, p in enumerate(prompts)]
    for _ in range(steps - 1):
        logits = model.decode(cache, torch.tensor([t[-1] for t in tokens]), list(range(len(prompts))))
        for t, row in zip(tokens, logits):
            t.append(int(row.argmax()))
    return tokens


def test_greedy_tokens_equal_the_models_and_the_references(llm):
    ref = fixture("a").ref
    p, tokens, logits = int(ref["prompt_len"]), ref["tokens"], ref["logits"]
    prompts, steps = [tokens[i, :p].tolist() for i in range(tokens.shape[0])], logits.shape[1]
    outs = llm.generate([{"token_ids": q} for q in prompts], greedy(steps), use_tqdm=False)
    assert [o.token_ids for o in outs] == model_greedy(prompts, steps)
    assert all(o.finish_reason == "length" for o in outs) and llm.engine.max_len == 64  # max_seq_len
    # the reference's own greedy token after each of its prefixes, where its top-2 gap exceeds GAP
    top2 = logits.topk(2, -1).values
    sure = [(i, k) for i in range(len(prompts)) for k in range(steps) if top2[i, k, 0] - top2[i, k, 1] > GAP]
    assert len(sure) > steps
    forced = llm.generate([{"token_ids": tokens[i, : p + k].tolist()} for i, k in sure], greedy(1), use_tqdm=False)
    assert [o.token_ids[0] for o in forced] == [int(tokens[i, p + k]) for i, k in sure]
    assert llm.cache.used_blocks == 0 and llm.cache.free_slots == 4


def test_the_engine_has_no_decode_graphs_to_swap(llm):
    assert llm.engine.graphs is None and llm.engine.sampler is None  # V4.1 decodes eagerly
    with pytest.raises(TypeError, match="V41Steps has no decode graphs to swap"):
        llm.engine.graphs = object()


def test_batched_chunked_and_reused_slots_equal_alone(path, llm):
    g = torch.Generator().manual_seed(7)
    prompts = [{"token_ids": torch.randint(3, 256, (n,), generator=g).tolist()} for n in (29, 7, 18)]
    params = [greedy(n) for n in (12, 20, 9)]
    alone = [llm.generate(p, q, use_tqdm=False)[0].token_ids for p, q in zip(prompts, params)]
    batched = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in batched] == alone
    # chunks of 5 prompt tokens (several requests per prefill step); one block: one request at a time, each in
    # a slot another request used before
    chunked = deepinfer.LLM(path, max_num_seqs=2, max_prefill_tokens=5)
    assert [o.token_ids for o in chunked.generate(prompts, params, use_tqdm=False)] == alone
    serial = deepinfer.LLM(path, max_num_seqs=2, num_blocks=1)
    assert [o.token_ids for o in serial.generate(prompts, params, use_tqdm=False)] == alone


def test_cli_runs_offline_on_a_v41_directory(path):
    ref = fixture("a").ref
    prompt = ref["tokens"][0, : int(ref["prompt_len"])].tolist()
    result = CliRunner().invoke(main, ["run", "offline", "--model", str(path), "--token-ids",
                                       ",".join(map(str, prompt)), "--max-new-tokens", "5", "--temperature", "0",
                                       "--format", "jsonl"], env={"DEEPINFER_HF_MODEL_DIR": ""},
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout.strip().splitlines()[-1])
    assert row["token_ids"] == model_greedy([prompt], 5)[0]
    assert "V4.1 encoding" in result.stderr and "backend reference" in result.stderr


def test_decode_graphs_give_the_eager_steps_tokens(path, llm):
    """Decode steps through `V41DecodeGraphs` (static inputs padded to a batch bucket with the scratch slot, the
    indexers over every entry a slot can hold) under a stand-in capture that replays eagerly into the captured
    output buffer, as a CUDA graph does: the eager steps' greedy tokens, requests of three lengths batched."""
    from deepinfer.runtime.v41_steps import V41Steps

    def capture(fn):
        out = fn()
        return out, lambda: out.copy_(fn())

    g = torch.Generator().manual_seed(11)
    prompts = [{"token_ids": torch.randint(3, 256, (n,), generator=g).tolist()} for n in (21, 6, 13)]
    graphed = deepinfer.LLM(path, max_num_seqs=4)
    eager = graphed.engine.steps
    graphed.engine.steps = V41Steps(eager.model, eager.cache, capture)
    params = [greedy(n) for n in (12, 5, 8)]  # the batch shrinks 3 -> 2 -> 1: buckets 4, 2 and 1
    got = graphed.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert sorted(graphed.engine.steps.decode_graphs._graphs) == [1, 2, 4]


def test_compile_builds_the_v41_kernel_set(path, c_kernel_cache):
    """`deepinfer compile --model <V4.1 dir>` plans V4.1's kernels (its own ops among them) and builds them; the
    c-kernel test below then finds them in the cache."""
    from codegen.driver import read_manifest
    from deepinfer.compile.plan import kernel_plan
    from deepinfer.config_v41 import read_config

    result = CliRunner().invoke(main, ["compile", "--target", "c", "--model", str(path), "--out", str(c_kernel_cache)])
    assert result.exit_code == 0, result.output
    plan = kernel_plan(read_config(path), "float32")
    built = {(e["op"], e["kernel"]) for e in read_manifest(c_kernel_cache / "c")["entries"]}
    assert {(op, kernel) for op, kernel, _ in plan} <= built
    assert {"hc_mixes", "engram_lookup", "engram_gate", "candidate_blocks", "fp4_act_qdq", "sparse_attention",
            "moe_experts"} <= {op for op, _, _ in plan}


def test_targets_v41_never_ran_on_are_refused_naming_where_it_runs(path):
    for name in ("ascend", "sm100"):
        with pytest.raises(ConfigError, match=rf"backend '{name}': DeepSeek-V4.1 runs on reference, c, sm90 for now "
                                              r"\(--backend cpu: the reference ops; .*never run there"):
            deepinfer.LLM(path, backend=name)


def test_the_c_kernels_give_the_reference_paths_greedy_tokens(path, llm, c_kernel_cache, monkeypatch):
    """V4.1 through its TileLang kernels (every op's portable body on the CPU `c` target, fp32) and through the
    reference ops: the same greedy tokens where the reference's top-2 gap is clear (kernels sum in another order;
    `GAP` is the parity tests' bound)."""
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(c_kernel_cache))
    ref = fixture("a").ref
    prompt = ref["tokens"][0, : int(ref["prompt_len"])].tolist()
    kernels = deepinfer.LLM(path, backend="c", max_num_seqs=2)
    want = llm.generate([{"token_ids": prompt}], greedy(6), use_tqdm=False)[0].token_ids
    got = kernels.generate([{"token_ids": prompt}], greedy(6), use_tqdm=False)[0].token_ids
    assert got == want


def test_an_image_fails_alone_and_chat_needs_the_system_token(llm):
    image = fixture("a").cfg.image_token_id
    ok, bad = llm.generate([{"token_ids": [5, 6, 7]}, {"token_ids": [5, image, 7]}], greedy(3), use_tqdm=False,
                           errors="return")
    assert ok.num_generated_tokens == 3
    assert isinstance(bad, RequestFailure) and f"image token {image}: images are not supported yet" in bad.error
    with pytest.raises(RequestError, match="DeepSeek-V4.1 chat prompts need the special token <｜System｜>, "
                                           "which the tokenizer .*tokenizer.json does not have"):
        llm.chat([{"role": "user", "content": "hi"}])


def test_the_engram_hasher_comes_from_the_directorys_tokenizer(tmp_path):
    from deepinfer.serving.recipe import default_tokenizer_path

    with pytest.raises(ConfigError, match=f"the tokenizer {default_tokenizer_path()} gives 99092 Engram token classes; "
                                          "the V4.1 config declares engram_compressed_vocab_size 175"):
        deepinfer.LLM(model_dir(tmp_path), tokenizer=default_tokenizer_path())
    merged = json.loads(stand_in_tokenizer().to_str())  # two tokens of one class no longer: 176 classes
    vocab = merged["model"]["vocab"]
    vocab["THE_OTHER1"] = vocab.pop("THE1")  # was one class with "the1"
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "tokenizer.json").write_text(json.dumps(merged))
    with pytest.raises(ConfigError, match="gives 176 Engram token classes"):
        deepinfer.LLM(model_dir(tmp_path), tokenizer=tmp_path / "other" / "tokenizer.json")
