"""The compile plan is derived from the model: it equals the set of kernels the engine launches, for the tiny
default model (real runs through the engine, prefill chunks and decode batches of every size bucket) and for the
V4-Flash config (meta runs at many batch sizes)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from deepinfer.compile.plan import kernel_plan, trace
from deepinfer.config import ModelConfig
from tests.helpers import meta_copy
from tilekernels.kernels import Recorder
from tilekernels.op import OpTable
from tilekernels.ops import DECLARED, V41_OPS

FLASH = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "v4-flash.json"


def shadow_table(recorder: Recorder) -> OpTable:
    """Ops that compute their reference and, alongside, record what their kernel wrapper would launch for the
    same shapes (the wrapper runs on meta copies of the arguments)."""

    def call(name, op, *args, **kwargs):
        op.run(recorder.for_op(name), *meta_copy(args), **{k: meta_copy(v) for k, v in kwargs.items()})
        return op.reference(*args, **kwargs)

    impls = {name: (functools.partial(call, name, op) if op.run is not None else op.reference)
             for name, op in DECLARED.items()}
    return OpTable(impls, DECLARED)


def test_plan_equals_what_the_engine_launches_for_the_tiny_model(monkeypatch):
    import backends
    import deepinfer.api
    from deepinfer import LLM, SamplingParams
    from deepinfer.runtime.backend import Backend
    from deepinfer.tiny import tiny_config

    recorder = Recorder()
    monkeypatch.setattr(deepinfer.api, "select_backend", lambda *a, **k: Backend(
        backends.get("reference"), torch.device("cpu"), shadow_table(recorder), None))
    llm = LLM(max_num_seqs=70, max_prefill_tokens=700, max_model_len=1024)
    g = torch.Generator().manual_seed(0)
    # a 600-token prompt and 69 short ones: prefill steps of 700 rows (the >= 512 GEMM bucket) and 245 (medium);
    # a first decode step of 70 rows (medium), then 4 sequences decoding on (narrow)
    prompts = [{"token_ids": torch.randint(2, 400, (600 if i == 0 else 5,), generator=g).tolist()} for i in range(70)]
    params = [SamplingParams(temperature=0, max_new_tokens=2 if 0 < i < 66 else 6, ignore_eos=True) for i in range(70)]
    llm.generate(prompts, params)
    plan = kernel_plan(tiny_config(), "float32")
    assert len(plan) == len(set(plan))
    assert set(recorder.seen) == set(plan)


def flash_config(quantized: bool) -> ModelConfig:
    from deepinfer.weights.synthetic import V4_QUANTIZATION

    raw = json.loads(FLASH.read_text())
    return ModelConfig.from_dict({**raw, "quantization_config": V4_QUANTIZATION} if quantized else raw)


@functools.lru_cache(maxsize=None)
def flash_plan(quantized: bool, keep: bool | None = None) -> tuple:
    """The V4-Flash config's bf16 plan (a trace of its 43 layers: seconds), traced once for the tests below;
    `keep` is kernel_plan's `quantized` (None: the config decides)."""
    return tuple(kernel_plan(flash_config(quantized), "bfloat16", quantized=keep))


@pytest.mark.parametrize("dtype, quantized", [("bfloat16", False), ("bfloat16", True)], ids=["bf16", "fp8-fp4-checkpoint"])
def test_plan_covers_the_v4_flash_config_at_any_batch(dtype, quantized):
    """The batch sizes run on V4-Flash cut to its first 5 layers, which hold each of its 43 layers' kinds
    (attention type x MLP type; a layer's kernels follow from its kind): what they launch is the whole
    config's plan, no more, no less (a kind the cut missed would miss kernels). 2 s where all 43 take 15."""
    cfg = flash_config(quantized)
    ratios = cfg.raw["compress_ratios"]  # cut too, keeping the MTP layer's slot (sliding) after the last layer
    cut = ModelConfig.from_dict({**cfg.raw, "num_hidden_layers": 5,
                                 "compress_ratios": ratios[:5] + ratios[cfg.num_hidden_layers:]})
    assert set(zip(cut.layer_types, cut.mlp_layer_types)) == set(zip(cfg.layer_types, cfg.mlp_layer_types))
    plan = set(flash_plan(quantized))
    recorder = Recorder()
    trace(cut, dtype, recorder, (2, 3, 17, 64, 65, 100, 300, 511, 700, 2048), context=5000)
    assert set(recorder.seen) == plan
    kernels = {(op, kernel) for op, kernel, _ in plan}
    assert (("linear", "gemm_fp8") in kernels) == quantized and (("act_quant", "act_quant") in kernels) == quantized
    assert (("moe_experts", "grouped_gemm_fp4") in kernels) == quantized


def test_the_two_checkpoint_kinds_use_every_declared_kernel():
    used = {(op, kernel) for q in (False, True) for op, kernel, _ in flash_plan(q)}
    # the exact K-permuted FP4 decoder serves only checkpoints with an FP4 scale above 2 (known once the weights
    # are read: built at first use); the plan lists the one-multiply decoder real checkpoints take
    data_dependent = {("moe_experts", "grouped_gemm_fp4_kperm")}
    assert used == {(name, k.name) for name, op in DECLARED.items() for k in op.kernels
                    if name not in V41_OPS} - data_dependent
    assert not any(k == "gemm_fp8" for _, k, _ in flash_plan(True, keep=False))
