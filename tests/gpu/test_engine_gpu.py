"""The engine on the H200: TileLang kernels (bf16) against the CPU reference path (fp32), and CUDA-graph
decode against eager decode. Run with `pytest -m gpu` on the GPU host."""

from __future__ import annotations

import pytest
import torch

import deepinfer
from deepinfer.runtime.graph import DecodeGraphs
from deepinfer.runtime.sampling import SamplingParams
from deepinfer.config import ModelConfig
from deepinfer.tiny import random_tensors
from tests.helpers import ODD_A, ODD_B, TINY_A, save_model_dir

pytestmark = pytest.mark.gpu
STEPS = 40
TOLERANCE = 0.05  # of the largest |logit|: bf16 kernels against the fp32 reference


@pytest.fixture(scope="module")
def confident(tmp_path_factory):
    """A tiny random model (the HF test config) with a sharpened LM head: greedy margins far above bf16
    rounding, so the bf16 kernels and the fp32 reference must agree token for token."""
    tensors = random_tensors(ModelConfig.from_dict(TINY_A), seed=0)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 30.0
    return save_model_dir(tmp_path_factory.mktemp("gpu-engine") / "tiny", TINY_A, tensors)


def prompts():
    g = torch.Generator().manual_seed(0)
    return [{"token_ids": torch.randint(2, 512, (n,), generator=g).tolist()} for n in (200, 37, 140)]


def test_tilelang_path_gives_the_cpu_reference_greedy_tokens(confident, cuda):
    """Greedy tokens agree until the reference itself is at a near-tie (top-2 gap within the bf16 tolerance of
    the logits; on the H200 one prompt met a gap of 0.05 at step 12, against a bf16 logit error of up to 0.29),
    and every decode step's logits, forced along the reference tokens, agree within that tolerance."""
    params = SamplingParams(temperature=0, max_new_tokens=STEPS, ignore_eos=True)
    ref = deepinfer.LLM(confident, backend="cpu")
    cpu = ref.generate(prompts(), params)
    gpu_llm = deepinfer.LLM(confident, backend="nvidia", dtype="bfloat16")
    gpu = gpu_llm.generate(prompts(), params)
    for p, a, b in zip(prompts(), cpu, gpu):
        assert len(b.token_ids) == STEPS
        k = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if k is None:
            continue
        want = _prefill_logits(ref, torch.tensor(p["token_ids"] + a.token_ids[:k]))[-1]
        top2 = want.topk(2).values
        assert top2[0] - top2[1] <= TOLERANCE * want.abs().max(), f"diverged at step {k} without a near-tie"
        assert b.token_ids[k] in want.topk(2).indices.tolist()
    # every one of the STEPS decode steps, forced along the reference's tokens (so a near-tie cannot end the
    # comparison early): logits within the bf16 tolerance
    for p, a in zip(prompts(), cpu):
        want = forced_logits(ref, p["token_ids"], a.token_ids)
        got = forced_logits(gpu_llm, p["token_ids"], a.token_ids)
        assert want.shape[0] == STEPS and ((got - want).abs().amax(-1) <= TOLERANCE * want.abs().amax(-1)).all()
    # logits of one prefill, kernels in bf16 against the reference in fp32
    ids = torch.tensor(prompts()[0]["token_ids"])
    got = _prefill_logits(gpu_llm, ids).float().cpu()
    want = _prefill_logits(ref, ids)
    assert (got - want).abs().max().item() <= TOLERANCE * want.abs().max().item()


@torch.inference_mode()  # the engine's decode buffers may have been made inside its (inference-mode) loop
def forced_logits(llm, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """fp32 logits [len(tokens), V] on the CPU: the prompt's last position, then each decode step (through the
    engine's decode graphs) fed the given tokens instead of its own picks."""
    seq = llm.cache.admit()
    llm.cache.grow(seq, len(prompt) + len(tokens))
    dev, n = llm.model.device, len(prompt)
    rows = [llm.model.prefill(llm.cache, torch.tensor(prompt, device=dev), torch.arange(n, device=dev), [(seq, 0, n)],
                              torch.tensor([n - 1], device=dev))[-1].float().cpu()]
    for i, token in enumerate(tokens[:-1]):
        rows.append(llm.engine.graphs.run([token], [n + i], [seq])[0].float().cpu())
        seq.num_tokens += 1
    llm.cache.release(seq)
    return torch.stack(rows)


def _prefill_logits(llm, ids):
    seq = llm.cache.admit()
    llm.cache.grow(seq, ids.numel())
    dev = llm.model.device
    out = llm.model.prefill(llm.cache, ids.to(dev), torch.arange(ids.numel(), device=dev), [(seq, 0, ids.numel())])
    llm.cache.release(seq)
    return out


def test_captured_decode_equals_eager_decode(confident, cuda):
    params = [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True) for n in (STEPS, 12, 25)]
    graphed = deepinfer.LLM(confident, backend="nvidia", dtype="bfloat16")
    eager = deepinfer.LLM(confident, backend="nvidia", dtype="bfloat16")
    eager.engine.graphs = DecodeGraphs(eager.model, eager.cache, 64, None)
    a = graphed.generate(prompts(), params)
    b = eager.generate(prompts(), params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert graphed.engine.graphs._graphs and all(g.replay is not None for g in graphed.engine.graphs._graphs.values())


def test_structured_output_on_the_gpu(confident, cuda):
    """Masks applied to CUDA logits inside captured decode steps: every output follows its constraint."""
    import json
    import re

    llm = deepinfer.LLM(confident, backend="nvidia", dtype="bfloat16")
    schema = {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3}
    items = [{"token_ids": p["token_ids"], "so_args": so} for p in prompts()
             for so in ({"regex": "(ab|ba)c{1,3}"}, {"json_schema": schema})]
    params = [SamplingParams(temperature=1.0, max_new_tokens=40, seed=i) for i in range(len(items))]
    outs = llm.generate(items, params)
    for item, out in zip(items, outs):
        assert out.finish_reason == "stop", out.text
        if "regex" in item["so_args"]:
            assert re.fullmatch("(ab|ba)c{1,3}", out.text), out.text
        else:
            value = json.loads(out.text)
            assert 1 <= len(value) <= 3 and set(value) <= {"a", "b"}
    assert llm.last_stats.mask_seconds > 0


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per row: max |got - want| as a fraction of the row's largest |want|."""
    return (got.float() - want).abs().amax(-1) / want.abs().amax(-1)


@pytest.mark.parametrize("raw", [ODD_A, ODD_B], ids=["odd_a", "odd_b"])
def test_odd_width_config_on_the_gpu(raw, tmp_path, cuda):
    """A valid config whose widths are multiples of no kernel tile (hidden 48/40, head_dim 24/20, 6/5 heads,
    vocab 301/257, 6/5 experts): its kernels build for sm90 and the bf16 engine matches the fp32 reference path,
    prefill logits and every forced decode step's logits. The bounds are derived from the bf16 reference's own
    error on this config (the reference path run in bf16 against fp32), never tighter than the TOLERANCE rule of
    the test above: with a top-3 indexer over few entries, one bf16 rounding can flip a near-tied pick and move a
    whole row's logits, in the reference as in the kernels."""
    tensors = random_tensors(ModelConfig.from_dict(raw), seed=1)
    model = save_model_dir(tmp_path / "odd", raw, tensors)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(2, raw["vocab_size"], (150,), generator=g).tolist()
    ref = deepinfer.LLM(model, backend="cpu", max_num_seqs=4)
    ref_bf16 = deepinfer.LLM(model, backend="cpu", dtype="bfloat16", max_num_seqs=4)
    gpu_llm = deepinfer.LLM(model, backend="nvidia", dtype="bfloat16", max_num_seqs=4)
    assert gpu_llm.backend.kernel_target == "sm90"
    tokens = ref.generate([{"token_ids": prompt}], SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True))
    tokens = tokens[0].token_ids
    want = forced_logits(ref, prompt, tokens)
    own = _relative_error(forced_logits(ref_bf16, prompt, tokens), want).max().item()
    got = _relative_error(forced_logits(gpu_llm, prompt, tokens), want).max().item()
    ids = torch.tensor(prompt)
    want_prefill = _prefill_logits(ref, ids)
    rows_own = _relative_error(_prefill_logits(ref_bf16, ids), want_prefill)
    rows_got = _relative_error(_prefill_logits(gpu_llm, ids).cpu(), want_prefill)
    scale = want_prefill.abs().max()  # the prefill rule of the test above: against the largest |logit|
    own_prefill = ((_prefill_logits(ref_bf16, ids).float() - want_prefill).abs().max() / scale).item()
    got_prefill = ((_prefill_logits(gpu_llm, ids).float().cpu() - want_prefill).abs().max() / scale).item()
    print(f"odd-width hidden {raw['hidden_size']} head_dim {raw['head_dim']}: worst decode step {got:.4f} "
          f"(bf16 reference {own:.4f}); prefill {got_prefill:.4f} (bf16 reference {own_prefill:.4f}) of the "
          f"largest |logit|; per prefill row median {rows_got.median():.4f} (bf16 reference {rows_own.median():.4f}), "
          f"rows above 0.05: {int((rows_got > 0.05).sum())} (bf16 reference {int((rows_own > 0.05).sum())})")
    assert got <= max(TOLERANCE, 2 * own)
    # prefill: typical rows within twice the bf16 reference's typical error, and the worst (a near-tied indexer
    # pick flipped by rounding, which the reference and the kernels meet on different rows) within three times its
    # worst. Measured on the H200 (ODD_A): median 0.0109 vs 0.0074, worst 0.133 vs 0.061, 9 vs 4 rows above 0.05.
    assert rows_got.median() <= 2 * rows_own.median()
    assert got_prefill <= max(TOLERANCE, 3 * own_prefill)


def test_decode_samples_through_the_captured_sampler(confident, cuda):
    """Sampled, penalized and biased requests: the decode steps' captured sampler gives the eager sampler's
    tokens (same logits from the same decode graphs), batch after batch."""
    llm = deepinfer.LLM(confident, backend="nvidia", dtype="bfloat16", max_num_seqs=8)
    assert llm.engine.sampler is not None
    kinds = [dict(temperature=0.9, top_p=0.9), dict(temperature=0, logit_bias={9: 4.0}),
             dict(temperature=1.0, top_k=20, min_p=0.05, presence_penalty=1.5),
             dict(temperature=0.8, frequency_penalty=1.0, repetition_penalty=1.3), dict(temperature=0)]
    params = [SamplingParams(seed=i, max_new_tokens=24, ignore_eos=True, **kinds[i % 5]) for i in range(6)]
    items = prompts() + prompts()
    graph = [o.token_ids for o in llm.generate(items, params)]
    sampler, llm.engine.sampler = llm.engine.sampler, None
    eager = [o.token_ids for o in llm.generate(items, params)]
    llm.engine.sampler = sampler
    assert graph == eager
