"""Checkpoints kept in their own precision (`quantization="auto"` on the reference ops): FP8 dense weights and
FP4 experts stay quantized, give exactly the logits of the same weights dequantized at load, and bad quantized
tensors are named."""

from __future__ import annotations


import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import deepinfer
from deepinfer.cli import main
from deepinfer.errors import WeightsError
from deepinfer.runtime.sampling import SamplingParams
from deepinfer.tiny import random_tensors, tiny_config
from deepinfer.weights.synthetic import write_checkpoint
from tilekernels.quant import BlockQuantized

GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module", params=["hf", "upstream"])
def quantized(request, tmp_path_factory):
    cfg = tiny_config()
    return write_checkpoint(tmp_path_factory.mktemp("q") / request.param, cfg.raw, random_tensors(cfg, seed=1),
                            request.param, block=(32, 32))


def _bytes(weights) -> int:
    total = 0
    for t in weights.values():
        total += t.nbytes if isinstance(t, BlockQuantized) else t.numel() * t.element_size()
    return total


def test_kept_quantized_equals_dequantized_at_load(quantized):
    kept = deepinfer.LLM(quantized, quantization="auto", max_num_seqs=2)
    dense = deepinfer.LLM(quantized, quantization="none", max_num_seqs=2)
    layer = kept.model.weights.layers[0]
    assert isinstance(layer.attn.q_a_proj, BlockQuantized) and layer.attn.q_a_proj.format == "fp8"
    assert isinstance(layer.moe.gate_up, BlockQuantized) and layer.moe.gate_up.format == "fp4"
    assert isinstance(layer.moe.shared_gate_up, BlockQuantized)  # gate over up joined on a block boundary
    assert not isinstance(dense.model.weights.layers[0].attn.q_a_proj, BlockQuantized)
    ids = list(range(5, 60))
    for a, b in zip(kept.generate([{"token_ids": ids}, {"token_ids": ids[:7]}], GREEDY, use_tqdm=False),
                    dense.generate([{"token_ids": ids}, {"token_ids": ids[:7]}], GREEDY, use_tqdm=False)):
        assert a.token_ids == b.token_ids
    x = torch.randn(3, kept.config.hidden_size)
    assert torch.equal(kept.backend.ops.linear(x, layer.attn.q_a_proj),
                       dense.backend.ops.linear(x, dense.model.weights.layers[0].attn.q_a_proj))
    assert kept.weight_bytes < dense.weight_bytes


def test_weight_bytes_are_known_before_loading(quantized):
    from deepinfer.config import ModelConfig
    from deepinfer.weights.loader import load_checkpoint, weight_bytes

    cfg = ModelConfig.from_model_dir(quantized)
    for keep in (True, False):
        loaded = load_checkpoint(quantized, cfg, torch.float32, keep_quantized=keep).tensors
        assert weight_bytes(quantized, cfg, torch.float32, keep) == _bytes(loaded)


@pytest.mark.parametrize("quantization", ["auto", "none"])
def test_cli_runs_a_quantized_checkpoint(quantized, quantization):
    result = CliRunner().invoke(main, ["run", "offline", "--model", str(quantized), "--token-ids", "5,6,7",
                                       "--max-new-tokens", "3", "--quantization", quantization])
    assert result.exit_code == 0, result.output
    assert "3 generated" in result.output and "memory on cpu: weights" in result.output


def _edit(src, dst, edit):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _key(tensors, suffix):
    return next(k for k in sorted(tensors) if k.endswith(suffix))


@pytest.mark.parametrize("name, edit, message", [
    ("scale grid", lambda t: t.__setitem__(_key(t, "q_a_proj.weight_scale_inv"),
                                           t[_key(t, "q_a_proj.weight_scale_inv")][:, :1].contiguous()),
     "q_a_proj.weight): scale shape"),
    ("scale dtype", lambda t: t.__setitem__(_key(t, "kv_proj.weight_scale_inv"),
                                            torch.ones_like(t[_key(t, "kv_proj.weight_scale_inv")], dtype=torch.int32)),
     "the scale of tensor layers.0.self_attn.kv_proj.weight"),
    ("weight dtype", lambda t: t.__setitem__(_key(t, "o_b_proj.weight"), t[_key(t, "o_b_proj.weight")].float()),
     "o_b_proj.weight) has a scale but dtype torch.float32"),
    ("missing scale", lambda t: t.pop(_key(t, "q_b_proj.weight_scale_inv")),
     "q_b_proj.weight) is quantized (torch.float8_e4m3fn) but has no scale tensor"),
    ("expert scale grid", lambda t: t.__setitem__(_key(t, "experts.down_proj_scale_inv"),
                                                  t[_key(t, "experts.down_proj_scale_inv")][..., :1].contiguous()),
     "experts.down_proj"),
])
@pytest.mark.parametrize("quantization", ["auto", "none"])
def test_bad_quantized_tensors_are_named(tmp_path, name, edit, message, quantization):
    cfg = tiny_config()
    src = write_checkpoint(tmp_path / "src", cfg.raw, random_tensors(cfg, seed=2), "hf", block=(32, 32))
    bad = _edit(src, tmp_path / "bad", edit)
    with pytest.raises(WeightsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        deepinfer.LLM(bad, quantization=quantization, max_num_seqs=2)


def test_quantizing_in_memory_gives_what_the_loader_keeps(tmp_path):
    """The benchmarks' on-device generator (`quantize_in_memory`) and a checkpoint written then loaded with
    `keep_quantized` give the same values and scales (the decode benchmark's quantized slice is what a real
    checkpoint would load)."""
    from deepinfer.config import ModelConfig
    from deepinfer.weights.loader import load_checkpoint
    from deepinfer.weights.synthetic import V4_QUANTIZATION, quantize_in_memory

    cfg = tiny_config()
    tensors = random_tensors(cfg, seed=4)
    path = write_checkpoint(tmp_path / "q", cfg.raw, tensors, "upstream", block=(128, 128))
    loaded = load_checkpoint(path, ModelConfig.from_model_dir(path), torch.float32, keep_quantized=True).tensors
    made = quantize_in_memory(tensors, V4_QUANTIZATION)
    quantized = [name for name, t in made.items() if isinstance(t, BlockQuantized)]
    assert quantized and {n for n, t in loaded.items() if isinstance(t, BlockQuantized)} == set(quantized)
    for name in quantized:
        a, b = made[name], loaded[name]
        assert a.format == b.format and a.block == b.block
        assert torch.equal(a.values.view(torch.uint8), b.values.view(torch.uint8))
        assert torch.equal(a.scales.view(torch.uint8), b.scales.contiguous().view(torch.uint8))


def test_quantizing_generated_pairs_equals_quantizing_the_whole_set():
    """The benchmarks' quantized slice is made one generated tensor at a time (`random_quantized`:
    `iter_random_tensors` into `quantize_in_memory`): the same names, values and scales as generating every tensor
    first, and the config declaring the quantization."""
    from deepinfer.tiny import iter_random_tensors
    from deepinfer.weights.synthetic import V4_QUANTIZATION, quantize_in_memory, random_quantized

    cfg = tiny_config()
    whole = random_tensors(cfg, seed=5)
    assert list(dict(iter_random_tensors(cfg, seed=5))) == list(whole)
    qcfg, made = random_quantized(cfg, seed=5, dtype=torch.float32, device="cpu")
    assert qcfg.raw["quantization_config"] == V4_QUANTIZATION
    want = quantize_in_memory(whole, V4_QUANTIZATION)
    assert list(made) == list(want) and any(isinstance(t, BlockQuantized) for t in made.values())
    for name, t in made.items():
        if isinstance(t, BlockQuantized):
            assert torch.equal(t.values.view(torch.uint8), want[name].values.view(torch.uint8))
            assert torch.equal(t.scales.view(torch.uint8), want[name].scales.view(torch.uint8))
        else:
            assert torch.equal(t, want[name])


def test_fp32_fp4_scales_become_exponent_bytes_at_load(tmp_path):
    """FP4 experts whose checkpoint scales are fp32 powers of two are kept with the exponent bytes the FP4
    kernels read (converted once at load, same logits); other fp32 scales cannot be kept as FP4: named, and
    `--quantization none` still dequantizes them."""
    from tilekernels.quant import is_exponent_bytes

    cfg = tiny_config()
    src = write_checkpoint(tmp_path / "src", cfg.raw, random_tensors(cfg, seed=3), "hf", block=(32, 32))
    scale_keys = [k for k in load_file(str(src / "model.safetensors")) if ".experts." in k and "scale" in k]
    assert scale_keys

    def as_fp32(tensors, factor=1.0):
        for k in scale_keys:
            s = tensors[k]
            s = s.view(torch.uint8) if s.dtype != torch.float32 else s
            tensors[k] = ((s.float() - 127).exp2() if s.dtype == torch.uint8 else s) * factor
        return tensors

    fp32 = _edit(src, tmp_path / "fp32", as_fp32)
    kept = deepinfer.LLM(fp32, quantization="auto", max_num_seqs=2)
    assert is_exponent_bytes(kept.model.weights.layers[0].moe.gate_up.scales)
    ids = list(range(5, 30))
    want = deepinfer.LLM(src, quantization="auto", max_num_seqs=2).generate([{"token_ids": ids}], GREEDY, use_tqdm=False)
    assert kept.generate([{"token_ids": ids}], GREEDY, use_tqdm=False)[0].token_ids == want[0].token_ids
    odd = _edit(src, tmp_path / "odd", lambda t: as_fp32(t, 1.5))
    with pytest.raises(WeightsError, match="FP4 scales must be powers of two"):
        deepinfer.LLM(odd, quantization="auto", max_num_seqs=2)
    deepinfer.LLM(odd, quantization="none", max_num_seqs=2)
