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
from tilekernels.kernels import Recorder
from tilekernels.op import OpTable
from tilekernels.ops import DECLARED, V41_OPS

FLASH = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "v4-flash.json"


def _meta(x):
    if isinstance(x, torch.Tensor):
        return torch.empty_like(x, device="meta")
    if isinstance(x, (list, tuple)):
        return type(x)(_meta(v) for v in x)
    return x


def shadow_table(recorder: Recorder) -> OpTable:
    """Ops that compute their reference and, alongside, record what their kernel wrapper would launch for the
    same shapes (the wrapper runs on meta copies of the arguments)."""

    def call(name, op, *args, **kwargs):
        op.run(recorder.for_op(name), *_meta(args), **{k: _meta(v) for k, v in kwargs.items()})
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


@pytest.mark.parametrize("dtype, quantized", [("bfloat16", False), ("bfloat16", True)], ids=["bf16", "fp8-fp4-checkpoint"])
def test_plan_covers_the_v4_flash_config_at_any_batch(dtype, quantized):
    cfg = flash_config(quantized)
    plan = set(kernel_plan(cfg, dtype))
    recorder = Recorder()
    trace(cfg, dtype, recorder, (2, 3, 17, 64, 65, 100, 300, 511, 700, 2048), context=5000)
    assert set(recorder.seen) == plan
    kernels = {(op, kernel) for op, kernel, _ in plan}
    assert (("linear", "gemm_fp8") in kernels) == quantized and (("act_quant", "act_quant") in kernels) == quantized
    assert (("moe_experts", "grouped_gemm_fp4") in kernels) == quantized


def test_the_two_checkpoint_kinds_use_every_declared_kernel():
    used = {(op, kernel) for q in (False, True) for op, kernel, _ in kernel_plan(flash_config(q), "bfloat16")}
    # the exact K-permuted FP4 decoder serves only checkpoints with an FP4 scale above 2 (known once the weights
    # are read: built at first use); the plan lists the one-multiply decoder real checkpoints take
    data_dependent = {("moe_experts", "grouped_gemm_fp4_kperm")}
    assert used == {(name, k.name) for name, op in DECLARED.items() for k in op.kernels
                    if name not in V41_OPS} - data_dependent
    assert not any(k == "gemm_fp8" for _, k, _ in kernel_plan(flash_config(True), "bfloat16", quantized=False))
