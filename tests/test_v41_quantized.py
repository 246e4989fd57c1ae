"""A V4.1 checkpoint in the released layout (fixture `a` quantized by `tests.v41_dirs.quantized_model_dir`: FP8
e4m3 with 32x32 e8m0 blocks, FP4 e2m1 routed experts with e8m0 per 1x32) kept FP8 / FP4 with `--quantization
auto` and dequantized with `none`: the tensors' forms, the weight bytes known before loading, the same logits on
the reference ops, the c kernels' greedy tokens, and bad quantized tensors named."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file

import deepinfer
from deepinfer.assemble import v41_weight_bytes
from deepinfer.config_v41 import V41Config
from deepinfer.errors import ConfigError, WeightsError
from deepinfer.model.v41 import DeepseekV41
from deepinfer.model.v41_weights import DOWN, GATE_UP, TABLE, V41Weights, tensor_specs
from deepinfer.model.weights import FP32
from deepinfer.runtime.sampling import SamplingParams
from deepinfer.weights import v41_loader
from deepinfer.weights.loader import ShardReader
from deepinfer.weights.quant import as_quantized
from deepinfer.weights.v41_formats import (checkpoint_format_v41, loaded_format_v41, stored_bytes,
                                           stored_format_v41)
from deepinfer.weights.v41_loader import kernel_form, load_v41
from tests.helpers import w8a8_reference
from tests.test_config_v41 import HF
from tests.v41_dirs import quantized_model_dir
from tilekernels.quant import BlockQuantized, is_exponent_bytes, quantize

GAP = 0.1  # greedy tokens compared where the top-2 gap exceeds this (tests/test_v41_engine.py)


@pytest.fixture(scope="module")
def qdir(tmp_path_factory):
    return quantized_model_dir(tmp_path_factory.mktemp("v41q"))


@pytest.fixture(scope="module")
def cfg(qdir):
    return V41Config.from_dict(json.loads((qdir / "config.json").read_text()))


def test_released_names_fp8_fp4_and_plain():
    cfg = V41Config.from_dict(HF)
    fp8, fp4 = ("fp8", (32, 32), True), ("fp4", (1, 32), True)
    for name in ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "ffn.shared_experts.w1",
                 "ffn.shared_experts.w2", "ffn.shared_experts.w3"):
        assert checkpoint_format_v41(f"layers.7.{name}.weight", cfg) == fp8, name
        assert checkpoint_format_v41(f"mtp.1.{name}.weight", cfg) == fp8, name
    assert checkpoint_format_v41("layers.24.attn.indexer.wq_b.weight", cfg) == fp8
    assert checkpoint_format_v41("mtp.0.main_proj.weight", cfg) == fp8
    for w in ("w1", "w2", "w3"):
        assert checkpoint_format_v41(f"layers.39.ffn.experts.383.{w}.weight", cfg) == fp4
        assert checkpoint_format_v41(f"mtp.2.ffn.experts.127.{w}.weight", cfg) == fp4
    # stored FP8 but read by the model as a plain tensor: dequantized even with `auto`
    assert stored_format_v41("layers.14.engram.wkv.weight", cfg) == fp8
    assert checkpoint_format_v41("layers.14.engram.wkv.weight", cfg) is None
    assert checkpoint_format_v41("layers.1.engram.embed.weight", cfg) == ("fp8", (1, 32), True)
    plain = ["layers.2.attn.compressor.wkv.weight", "layers.2.attn.compressor.wgate.weight",
             "layers.2.attn.indexer.wk.weight", "layers.2.attn.indexer.weights_proj.weight", "layers.0.ffn.gate.weight",
             "layers.0.attn.q_norm.weight", "layers.0.hc_attn_fn", "layers.0.attn.attn_sink", "embed.weight",
             "head.weight", "mtp.2.markov_head.head.weight", "mtp.2.confidence_head.proj.weight"]
    assert all(stored_format_v41(n, cfg) is None for n in plain)
    assert set(tensor_specs(cfg)) >= set(plain)
    fp8_experts = V41Config.from_dict({**HF, "quantization_config": {**HF["quantization_config"], "expert_dtype": "fp8"}})
    assert stored_format_v41("layers.0.ffn.experts.0.w1.weight", fp8_experts) == fp8
    assert checkpoint_format_v41("layers.0.ffn.experts.0.w1.weight", fp8_experts) is None  # the kernels take FP4
    no_qc = V41Config.from_dict({k: v for k, v in HF.items() if k != "quantization_config"})
    assert checkpoint_format_v41("layers.0.attn.wq_a.weight", no_qc) is None
    bad = V41Config.from_dict({**HF, "quantization_config": {"quant_method": "fp8", "weight_block_size": "32"}})
    with pytest.raises(ConfigError, match=r"weight_block_size '32' is not a pair of positive integers"):
        checkpoint_format_v41("layers.0.attn.wq_a.weight", bad)


def _bytes(tensors) -> int:
    return sum(t.nbytes if isinstance(t, BlockQuantized) else t.numel() * t.element_size() for t in tensors.values())


def test_auto_keeps_fp8_and_fp4_and_none_dequantizes(qdir, cfg):
    kept = load_v41(qdir, cfg, keep_quantized=True).tensors
    dense = load_v41(qdir, cfg).tensors
    assert set(kept) == set(dense)
    specs = tensor_specs(cfg)
    for name, spec in specs.items():
        if ".ffn.experts." in name:
            continue  # stacked: below
        fmt = checkpoint_format_v41(name, cfg)
        if fmt is None:
            assert not isinstance(kept[name], BlockQuantized) or spec.kind == TABLE, name
            continue
        q = kept[name]
        assert isinstance(q, BlockQuantized) and (q.format, q.block) == fmt[:2], name
        if spec.kind == TABLE:  # FP8 in both
            assert torch.equal(q.values, dense[name].values), name
            continue
        assert q.scales.dtype == torch.uint8, name  # ue8m0 as the exponent bytes the kernels read
        assert torch.equal(q.dequantize(torch.float32), dense[name]), name
    assert isinstance(kept["layers.0.attn.wo_a.weight"], BlockQuantized)  # grouped output projection
    assert not isinstance(kept["layers.1.engram.wkv.weight"], BlockQuantized)  # read as a plain tensor
    for i in range(cfg.num_hidden_layers):
        gate_up, down = kept[f"layers.{i}.ffn.{GATE_UP}"], kept[f"layers.{i}.ffn.{DOWN}"]
        assert isinstance(gate_up, BlockQuantized) and gate_up.format == "fp4" and gate_up.block == (1, 32)
        assert tuple(gate_up.shape) == (6, 64, 64) and tuple(gate_up.values.shape) == (6, 64, 32)
        assert tuple(down.shape) == (6, 64, 32) and tuple(down.scales.shape) == (6, 64, 1)
        assert torch.equal(gate_up.dequantize(), dense[f"layers.{i}.ffn.{GATE_UP}"])
        assert torch.equal(down.dequantize(), dense[f"layers.{i}.ffn.{DOWN}"])
    for tensors, keep in ((kept, True), (dense, False)):  # known from the config before anything is read
        assert v41_weight_bytes(cfg, torch.float32, keep) == _bytes(tensors)
    assert _bytes(kept) < 0.5 * _bytes(dense)


def test_experts_given_one_by_one_stack_as_the_loader_stacks_them(qdir, cfg):
    """`V41Weights.from_tensors` stacks per-expert block-quantized tensors (what a meta trace or a benchmark
    hands it) into the same values and scales the loader builds while reading."""
    raw = load_file(str(qdir / "model.safetensors"))
    loaded = load_v41(qdir, cfg, keep_quantized=True).tensors
    tensors = {k: v for k, v in loaded.items() if ".ffn.experts." not in k}
    for name in tensor_specs(cfg):
        if ".ffn.experts." in name:
            scale = raw[name[: -len("weight")] + "scale"]
            tensors[name] = kernel_form(name, as_quantized(name, raw[name], scale))
    one_by_one = V41Weights.from_tensors(cfg, tensors).layers[3].moe
    stacked = V41Weights.from_tensors(cfg, loaded).layers[3].moe
    for a, b in ((one_by_one.gate_up, stacked.gate_up), (one_by_one.down, stacked.down)):
        assert isinstance(a, BlockQuantized) and torch.equal(a.values, b.values) and torch.equal(a.scales, b.scales)
    shared = stacked.shared_gate_up
    assert isinstance(shared, BlockQuantized) and tuple(shared.shape) == (64, 64)  # w1 over w3 on a block edge


def _counting_reads(monkeypatch) -> Counter:
    """Every `read(key)` the V4.1 loader makes, counted by key."""
    reads: Counter = Counter()

    class Counting(ShardReader):
        def __call__(self, key, rows=None):
            reads[key] += 1
            return super().__call__(key, rows)

    monkeypatch.setattr(v41_loader, "ShardReader", Counting)
    return reads


@pytest.mark.parametrize("keep", [True, False])
def test_each_tensor_is_read_once_and_progress_ticks_once_per_tensor(qdir, cfg, keep, monkeypatch):
    """Routed expert 0 included (its form decides whether the stack stays FP4): every checkpoint tensor the model
    uses, scales too, read exactly once; `progress(1)` once per tensor of `tensor_specs` (V4's semantics), a
    routed expert's as it joins its stack."""
    reads = _counting_reads(monkeypatch)
    ticks: list[int] = []
    ckpt = load_v41(qdir, cfg, keep_quantized=keep, progress=ticks.append)
    assert set(reads) == set(load_file(str(qdir / "model.safetensors"))) - set(ckpt.ignored) - set(ckpt.vision)
    assert max(reads.values()) == 1, [k for k, n in reads.items() if n > 1]
    assert ticks == [1] * len(tensor_specs(cfg))
    assert isinstance(ckpt.tensors[f"layers.0.ffn.{GATE_UP}"], BlockQuantized) == keep


def test_an_expert_in_another_format_mid_stack_dequantizes_the_stack(tmp_path, qdir, cfg, monkeypatch):
    """An FP8 routed expert (layer 1, expert 3's up half) among FP4 ones: the layer's gate/up stack cannot stay
    FP4, so the experts stacked before it are dequantized in place and the rest dequantized as read: the same
    tensor as `none` gives, with every tensor still read once; the layer's down stack stays FP4."""
    key = "layers.1.ffn.experts.3.w3"

    def to_fp8(t):
        w = as_quantized(key, t[key + ".weight"], t[key + ".scale"]).dequantize()
        q = quantize(w, "fp8", (32, 32), pow2_scales=True)
        t[key + ".weight"], t[key + ".scale"] = q.values, q.scales

    path = _damaged(tmp_path, qdir, to_fp8)
    dense = load_v41(path, cfg).tensors
    reads = _counting_reads(monkeypatch)
    kept = load_v41(path, cfg, keep_quantized=True).tensors
    assert max(reads.values()) == 1
    gate_up = kept[f"layers.1.ffn.{GATE_UP}"]
    assert not isinstance(gate_up, BlockQuantized) and torch.equal(gate_up, dense[f"layers.1.ffn.{GATE_UP}"])
    assert isinstance(kept[f"layers.1.ffn.{DOWN}"], BlockQuantized)
    assert isinstance(kept[f"layers.2.ffn.{GATE_UP}"], BlockQuantized)


def test_stored_bytes_are_the_kept_tensors_bytes(qdir, cfg):
    """`stored_bytes` (what the memory check counts) equals each kept tensor's bytes: 2-D FP8 32x32, stacked
    [E, N, K] FP4 1x32, ue8m0 exponent bytes and fp32 scales; summed over the specs it is `v41_weight_bytes`."""
    kept = load_v41(qdir, cfg, keep_quantized=True).tensors
    quantized = [q for q in kept.values() if isinstance(q, BlockQuantized)]
    assert {(q.format, q.values.dim()) for q in quantized} == {("fp8", 2), ("fp4", 3)}
    for q in quantized:
        assert stored_bytes(q.shape, (q.format, q.block, is_exponent_bytes(q.scales))) == q.nbytes
    for form, block in (("fp8", (32, 32)), ("fp4", (1, 32))):
        q = quantize(torch.randn(3, 40, 64), form, block)  # fp32 scales, rows off the block grid
        assert stored_bytes(q.shape, (form, block, False)) == q.nbytes
    for keep in (True, False):
        plain = torch.empty((), dtype=torch.bfloat16).element_size()
        total = 0
        for name, spec in tensor_specs(cfg).items():
            fmt = loaded_format_v41(name, cfg, keep)
            numel = torch.Size(spec.shape).numel()
            total += stored_bytes(spec.shape, fmt) if fmt else numel * (4 if spec.kind == FP32 else plain)
        assert total == v41_weight_bytes(cfg, torch.bfloat16, keep)


def _logits(model: DeepseekV41, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    cache = model.new_cache(1, 64)
    out = [model.prefill(cache, prompt, 0)]
    for _ in range(steps):
        out.append(model.decode(cache, out[-1][-1:].argmax(-1), [0]))
    return torch.cat(out).float()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reference_logits_of_auto_equal_none(qdir, dtype):
    """Tolerance 0: the reference ops dequantize a kept weight (e4m3 / e2m1 code x power-of-two scale, exact in
    fp32) to the activations' dtype, which is the model dtype everywhere a kept weight is read, i.e. into the
    same tensor `none` builds at load; the GEMMs that follow are the same."""
    auto = deepinfer.LLM(qdir, backend="cpu", quantization="auto", dtype=dtype, max_num_seqs=1)
    none = deepinfer.LLM(qdir, backend="cpu", quantization="none", dtype=dtype, max_num_seqs=1)
    assert isinstance(auto.model.weights.layers[0].attn.wq_a, BlockQuantized)
    assert not isinstance(none.model.weights.layers[0].attn.wq_a, BlockQuantized)
    assert "(FP8/FP4 kept)" in auto.memory_report and "(FP8/FP4 kept)" not in none.memory_report
    assert auto.keep_quantized and auto.weight_bytes < none.weight_bytes
    prompt = torch.arange(5, 40)
    assert torch.equal(_logits(auto.model, prompt, 4), _logits(none.model, prompt, 4))


@pytest.mark.full  # slow (CI time): `pytest -m full` (README.md, Run the tests)
def test_c_kernels_on_kept_weights_give_the_w8a8_references_greedy_tokens(qdir, c_kernel_cache, monkeypatch):
    """The c target's FP8 GEMMs quantize their activations per 1x32 (as DeepSeek's reference does) where the
    reference ops keep them exact: on this 64-wide random model that alone moves logits by up to ~2 (the
    b_faithful fixture shows the same for DeepSeek's own reference), so the comparison is the reference ops
    with that rounding emulated (`tests.helpers.w8a8_reference`), which agrees with the kernels to fp32
    summation order: the reference's greedy token after each of its prefixes where its top-2 gap is clear.
    Every prefix stays in the decode-sized row buckets: fewer kernels to build."""
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(c_kernel_cache))
    kernels = deepinfer.LLM(qdir, backend="c", quantization="auto", max_num_seqs=1)
    assert isinstance(kernels.model.weights.layers[0].moe.gate_up, BlockQuantized)
    m = kernels.model
    prompt, steps = torch.arange(7, 31), 8
    reference = DeepseekV41(m.cfg, m.weights, w8a8_reference(), m.hasher)
    want = _logits(reference, prompt, steps)[len(prompt) - 1:]
    tokens = prompt.tolist() + want.argmax(-1).tolist()
    top2 = want.topk(2, -1).values
    sure = [k for k in range(steps + 1) if top2[k, 0] - top2[k, 1] > GAP]
    assert len(sure) >= 3, f"the reference's top-2 gap is clear for only {len(sure)} of {steps + 1} steps"
    greedy = SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True)
    got = kernels.generate([{"token_ids": tokens[: len(prompt) + k]} for k in sure], greedy, use_tqdm=False)
    assert [o.token_ids[0] for o in got] == [tokens[len(prompt) + k] for k in sure]


def _damaged(tmp_path, qdir, change):
    shutil.copy(qdir / "config.json", tmp_path / "config.json")
    tensors = load_file(str(qdir / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path


def _widen(key):
    return lambda t: t.update({key: t[key].repeat(1, 2)})


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("change,message", [
    (_widen("layers.0.attn.wq_a.scale"), r"layers.0.attn.wq_a.weight: scale shape \[1, 4\] does not match the "
                                         r"32x32 block grid \[1, 2\] of its 32x64 weight"),
    (_widen("layers.2.ffn.experts.4.w2.scale"), r"layers.2.ffn.experts.4.w2.weight: scale shape \[64, 2\] does not "
                                                r"match the 1x32 block grid \[64, 1\] of its 64x32 weight"),
    (lambda t: t.pop("layers.3.attn.wo_b.scale"), r"layers.3.attn.wo_b.weight is quantized \(torch.float8_e4m3fn\) "
                                                  r"but the checkpoint has no layers.3.attn.wo_b.scale"),
    (lambda t: t.pop("layers.1.ffn.experts.5.w3.scale"), r"layers.1.ffn.experts.5.w3.weight is quantized "
                                                         r"\(torch.int8\) but has no scale"),
    (lambda t: t.update({"layers.4.ffn.shared_experts.w2.scale": torch.ones(2, 1, dtype=torch.int32)}),
     r"the scale of tensor layers.4.ffn.shared_experts.w2.weight has dtype torch.int32; expected fp32, bf16, ue8m0"),
])
def test_bad_quantized_tensors_are_named(tmp_path, qdir, cfg, keep, change, message):
    path = _damaged(tmp_path, qdir, change)
    with pytest.raises(WeightsError, match=message):
        load_v41(path, cfg, keep_quantized=keep)
