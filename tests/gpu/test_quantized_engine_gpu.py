"""The engine on the H200 with a quantized checkpoint kept in its own precision (FP8 dense projections with
ue8m0 128x128 block scales, FP4 experts), against the fp32 CPU reference on the same weights. Run with
`pytest -m gpu` on the GPU host.

The kernels quantize activations to FP8 before each FP8 GEMM (W8A8, as DeepSeek's inference does); the
reference keeps them unquantized. The tolerance is therefore derived, not assumed: the fp32 reference with the
activations rounded as the kernels round them (`linear_fp8.emulated`) measures the format's own error on this
config, and the bf16 rule of the existing engine test applies on top of it."""

from __future__ import annotations

import pytest
import torch

import deepinfer
from deepinfer.config import ModelConfig
from deepinfer.tiny import random_tensors
from deepinfer.weights.synthetic import write_checkpoint
from tests.gpu.test_engine_gpu import TOLERANCE, _prefill_logits, forced_logits, prompts
from tests.helpers import TINY_A, w8a8_reference
from tilekernels.ops import DECLARED, grouped_linear, linear, linear_fp8
from tilekernels.quant import BlockQuantized

pytestmark = pytest.mark.gpu
STEPS = 24


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    tensors = random_tensors(ModelConfig.from_dict(TINY_A), seed=0)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 30.0  # greedy margins above bf16 rounding
    return write_checkpoint(tmp_path_factory.mktemp("gpu-quantized") / "tiny", TINY_A, tensors, "hf")


def test_quantized_checkpoint_on_the_kernels_matches_the_reference(quantized, cuda):
    gpu = deepinfer.LLM(quantized, backend="nvidia", dtype="bfloat16")
    layer = gpu.model.weights.layers[0]
    assert isinstance(layer.attn.q_a_proj, BlockQuantized) and layer.attn.q_a_proj.values.is_cuda
    assert isinstance(layer.moe.gate_up, BlockQuantized) and layer.moe.gate_up.format == "fp4"
    ref = deepinfer.LLM(quantized, backend="cpu")  # fp32; FP8/FP4 kept, dequantized inside the reference ops
    emu = deepinfer.LLM(quantized, backend="cpu")
    emu.model.ops = w8a8_reference()
    ids = torch.tensor(prompts()[0]["token_ids"])
    want, fmt = _prefill_logits(ref, ids), _prefill_logits(emu, ids)
    fmt_err = ((fmt - want).abs().max() / want.abs().max()).item()  # the activations' FP8 rounding, measured
    got = _prefill_logits(gpu, ids).float().cpu()
    bf16_err = ((got - want).abs().max() / want.abs().max()).item()
    print(f"of the largest logit: W8A8 emulation vs fp32 reference {fmt_err:.4f}, bf16 kernels vs fp32 reference "
          f"{bf16_err:.4f}, bf16 kernels vs emulation {((got - fmt).abs().max() / fmt.abs().max()).item():.4f}")
    # in bf16 the activations round differently (a bf16 change of x moves ~1/16 of its e4m3 codes a full step),
    # so the bf16 run draws its own W8A8 error: the bf16 rule plus two such errors
    assert bf16_err <= TOLERANCE + 2 * fmt_err
    # decode steps through the engine's graphs, forced along the emulated reference's greedy tokens
    params = deepinfer.SamplingParams(temperature=0, max_new_tokens=STEPS, ignore_eos=True)
    for p, a in zip(prompts()[:2], emu.generate(prompts()[:2], params, use_tqdm=False)):
        want_steps = forced_logits(emu, p["token_ids"], a.token_ids)
        got_steps = forced_logits(gpu, p["token_ids"], a.token_ids)
        limit = (TOLERANCE + 2 * fmt_err) * want_steps.abs().amax(-1)
        assert ((got_steps - want_steps).abs().amax(-1) <= limit).all()
    assert gpu.weight_bytes < deepinfer.LLM(quantized, backend="cpu", quantization="none").weight_bytes


def test_quantized_ops_at_the_tiny_shapes(cuda, sm90_ops):
    """The engine test's tolerance carries the W8A8 error; the kernels themselves are checked here at the tiny
    model's shapes (K below the 128-wide scale block, 8 experts) against the reference and the emulation."""
    from tests.gpu.test_fp8_gpu import check
    from tilekernels.ops import moe_experts

    torch.manual_seed(0)
    for n, k, groups in ((32, 64, 1), (128, 32, 1), (16, 64, 2), (64, 32, 1)):
        v = linear_fp8.Variant(n, k, "bfloat16", (128, 128), groups, ue8m0=True)
        op = grouped_linear if groups > 1 else linear
        for tokens in (3, 140):
            x, w = op.example(v, tokens, cuda)
            check(getattr(sm90_ops, op.OP.name)(x, w), x, w, groups)
    for tokens in (2, 140):
        args = moe_experts.example(moe_experts.Variant(64, 64, 8, "bfloat16", fp4=True), tokens, cuda)
        got, want = sm90_ops.moe_experts(*args).float(), moe_experts.reference(*args).float()
        atol, rtol = DECLARED["moe_experts"].tolerance["bfloat16"]
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
