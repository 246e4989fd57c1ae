"""Loading DeepSeek-V4's MTP (nextn) draft layer, `mtp.0.*`: HF-style and DeepSeek's upstream spellings, plain
(fp32 / bf16) and quantized (FP8 + FP4, kept or dequantized), `load_mtp=False`, and the errors (a missing or
misshapen MTP tensor, a compressed MTP slot in compress_ratios)."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer.config import ModelConfig
from deepinfer.errors import ConfigError, WeightsError
from deepinfer.model.weights import ModelWeights, mtp_tensor_specs, tensor_specs
from deepinfer.tiny import random_tensors
from deepinfer.weights.loader import load_checkpoint, weight_bytes
from deepinfer.weights.names import canonical, classify, is_mtp
from deepinfer.weights.synthetic import quantize_in_memory, write_checkpoint
from tests.helpers import TINY_A, TINY_MTP, hf_config, write_json
from tilekernels.quant import BlockQuantized

CFG = ModelConfig.from_dict(TINY_MTP)
MTP = list(mtp_tensor_specs(CFG))
QC = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [32, 32], "expert_dtype": "fp4"}

# canonical MTP-layer name (after `mtp.0.`) -> DeepSeek's upstream one (the rest are spelled alike)
_UPSTREAM = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    **{f"{hc}.{part}": f"hc_{hc[:-3]}_{part}" for hc in ("attn_hc", "ffn_hc") for part in ("fn", "base", "scale")},
    "self_attn.sinks": "attn.attn_sink", "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight", "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight", "self_attn.kv_norm.weight": "attn.kv_norm.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight", "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "mlp.gate.weight": "ffn.gate.weight", "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
    **{f"hc_head.hc_{part}": f"hc_head_{part}" for part in ("fn", "base", "scale")},
}


def spelled(tensors: dict[str, torch.Tensor], spelling: str) -> dict[str, torch.Tensor]:
    """Canonical tensors -> checkpoint tensors: every one in HF in-memory names with `model.` ("hf"; "hf-experts":
    the MTP layer's routed experts one tensor per expert, `mlp.experts.E.w1.weight`), or the MTP layer's in
    DeepSeek's upstream names ("upstream": `mtp.0.attn.wq_a.weight`, `mtp.0.ffn.experts.E.w1.weight`, ...)."""
    out = {}
    for name, t in tensors.items():
        if not name.startswith("mtp.0.") or spelling == "hf":
            out["model." + name] = t
            continue
        rest = name[len("mtp.0."):]
        lead = "mtp.0.ffn" if spelling == "upstream" else "model.mtp.0.mlp"
        if rest.startswith("mlp.experts."):
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                parts = {"w2": t[e]} if rest.endswith("down_proj") else {"w1": t[e, :half], "w3": t[e, half:]}
                out.update({f"{lead}.experts.{e}.{w}.weight": v.contiguous() for w, v in parts.items()})
        else:
            out[("mtp.0." + _UPSTREAM.get(rest, rest)) if spelling == "upstream" else "model." + name] = t
    return out


def write(path, raw: dict, tensors: dict[str, torch.Tensor]):
    path.mkdir(parents=True)
    write_json(path / "config.json", raw)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def _bytes(tensors) -> int:
    return sum(t.nbytes if isinstance(t, BlockQuantized) else t.numel() * t.element_size() for t in tensors.values())


# ---- config and names ---------------------------------------------------------------------------


def test_config_mtp_slot():
    assert CFG.has_mtp and CFG.num_nextn_predict_layers == 1 and len(CFG.layer_types) == 5
    assert not ModelConfig.from_dict(TINY_A).has_mtp  # absent: no MTP layers
    assert hf_config(TINY_MTP).num_nextn_predict_layers == 1  # HF's config takes it (and the 6th ratio) too
    with pytest.raises(ConfigError, match=r"compress_ratios\[5\] is 4; accepted ratios: 0 only, at an MTP layer's "
                                          r"slot \(index >= num_hidden_layers=5"):
        ModelConfig.from_dict(dict(TINY_MTP, compress_ratios=[0, 4, 128, 4, 128, 4]))
    with pytest.raises(ConfigError, match="num_nextn_predict_layers must be an integer >= 0, got -1"):
        ModelConfig.from_dict(dict(TINY_MTP, num_nextn_predict_layers=-1))


def test_mtp_names_map_to_canonical_ones():
    for name, want in [("mtp.0.norm.weight", "mtp.0.norm.weight"), ("model.mtp.0.norm.weight", "mtp.0.norm.weight"),
                       ("mtp.0.enorm.weight", "mtp.0.enorm.weight"), ("mtp.0.hnorm.weight", "mtp.0.hnorm.weight"),
                       ("mtp.0.hc_head_fn", "mtp.0.hc_head.hc_fn"), ("model.mtp.0.hc_head.hc_base", "mtp.0.hc_head.hc_base"),
                       ("mtp.0.attn.kv_norm.weight", "mtp.0.self_attn.kv_norm.weight"),
                       ("mtp.0.attn.q_norm.weight", "mtp.0.self_attn.q_a_norm.weight"),
                       ("mtp.0.attn_norm.weight", "mtp.0.input_layernorm.weight"),
                       ("mtp.0.hc_ffn_scale", "mtp.0.ffn_hc.scale"), ("mtp.0.ffn.gate.bias",
                                                                      "mtp.0.mlp.gate.e_score_correction_bias")]:
        assert canonical(name) == want, name
    names = {"mtp.0.e_proj.weight", "mtp.0.e_proj.scale", "mtp.0.ffn.experts.5.w3.weight", "mtp.0.attn_hc.scale"}
    assert classify("mtp.0.e_proj.scale", names).name == "mtp.0.e_proj.weight"
    assert classify("mtp.0.e_proj.scale", names).scale and not classify("mtp.0.attn_hc.scale", names).scale
    t = classify("mtp.0.ffn.experts.5.w3.weight", names)
    assert (t.kind, t.name, t.expert, t.part) == ("expert", "mtp.0.mlp.experts.gate_up_proj", 5, "up")
    assert t == classify("model.mtp.0.mlp.experts.5.w3.weight", names)
    assert classify("model.mtp.0.h_proj.weight_scale_inv", names).name == "mtp.0.h_proj.weight"
    assert is_mtp("model.mtp.0.norm.weight") and not is_mtp("layers.0.mtp.weight")


def test_mtp_specs_are_a_sliding_top_k_block():
    specs = mtp_tensor_specs(CFG)
    assert not set(specs) & set(tensor_specs(CFG))
    assert "mtp.0.mlp.gate.e_score_correction_bias" in specs and "mtp.0.mlp.gate.tid2eid" not in specs
    assert not any(".compressor." in name for name in specs)
    h, n = CFG.hidden_size, CFG.hc_mult
    assert specs["mtp.0.e_proj.weight"].shape == specs["mtp.0.h_proj.weight"].shape == (h, h)
    assert [specs[f"mtp.0.hc_head.hc_{p}"].shape for p in ("fn", "base", "scale")] == [(n, n * h), (n,), (1,)]
    assert mtp_tensor_specs(ModelConfig.from_dict(TINY_A)) == {}


# ---- loading ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spelling", ["hf", "hf-experts", "upstream"])
def test_plain_checkpoint_loads_the_mtp_layer(tmp_path, spelling, dtype):
    src = random_tensors(CFG, seed=5, dtype=dtype)
    written = spelled(src, spelling)
    if spelling == "upstream":
        assert {"mtp.0.norm.weight", "mtp.0.attn.kv_norm.weight", "mtp.0.hc_head_fn", "mtp.0.ffn.experts.7.w2.weight",
                "mtp.0.hc_attn_base", "mtp.0.attn.attn_sink"} <= set(written)
    ckpt = load_checkpoint(write(tmp_path / "m", TINY_MTP, written), CFG, dtype)
    assert ckpt.mtp_layers == 1 and not ckpt.ignored and set(ckpt.tensors) == set(src)
    for name, t in src.items():
        assert torch.equal(ckpt.tensors[name], t.to(ckpt.tensors[name].dtype)), name
    weights = ModelWeights.from_tensors(CFG, ckpt.tensors)
    assert len(weights.layers) == 5 and len(weights.mtp) == 1
    mtp = weights.mtp[0]
    assert mtp.e_proj.dtype == dtype and mtp.norm.dtype == torch.float32
    for got, name in [(mtp.e_proj, "e_proj.weight"), (mtp.h_proj, "h_proj.weight"), (mtp.enorm, "enorm.weight"),
                      (mtp.hnorm, "hnorm.weight"), (mtp.norm, "norm.weight"), (mtp.hc_head.fn, "hc_head.hc_fn"),
                      (mtp.hc_head.scale, "hc_head.hc_scale"), (mtp.block.attn.kv_norm, "self_attn.kv_norm.weight"),
                      (mtp.block.attn_hc.base, "attn_hc.base"), (mtp.block.moe.gate_up, "mlp.experts.gate_up_proj"),
                      (mtp.block.moe.down, "mlp.experts.down_proj"), (mtp.block.moe.bias,
                                                                      "mlp.gate.e_score_correction_bias")]:
        assert torch.equal(got, src["mtp.0." + name].to(got.dtype)), name
    assert mtp.block.attn.compressor is None and mtp.block.attn.indexer is None and mtp.block.moe.tid2eid is None


@pytest.fixture(scope="module", params=["hf", "upstream"])
def quantized(request, tmp_path_factory):
    src = random_tensors(CFG, seed=6)
    return write_checkpoint(tmp_path_factory.mktemp("q") / request.param, TINY_MTP, src, request.param,
                            block=(32, 32)), src


def test_quantized_checkpoint_loads_the_mtp_layer(quantized):
    path, src = quantized
    keys = set(load_file(str(path / "model.safetensors")))
    assert ({"mtp.0.e_proj.scale", "mtp.0.attn.wq_a.scale", "mtp.0.ffn.experts.3.w1.scale"} <= keys
            or {"model.mtp.0.h_proj.weight_scale_inv", "model.mtp.0.mlp.experts.gate_up_proj_scale_inv"} <= keys)
    cfg = ModelConfig.from_model_dir(path)
    made = quantize_in_memory({name: src[name] for name in MTP}, QC)
    assert made["mtp.0.e_proj.weight"].format == made["mtp.0.mlp.shared_experts.up_proj.weight"].format == "fp8"
    assert made["mtp.0.mlp.experts.down_proj"].format == "fp4"
    kept = load_checkpoint(path, cfg, torch.float32, keep_quantized=True)
    dense = load_checkpoint(path, cfg, torch.float32)
    assert kept.mtp_layers == dense.mtp_layers == 1
    check_kept_and_dense(made, kept, dense, MTP)
    mtp = ModelWeights.from_tensors(cfg, kept.tensors).mtp[0]
    assert isinstance(mtp.e_proj, BlockQuantized) and isinstance(mtp.block.moe.gate_up, BlockQuantized)
    assert isinstance(mtp.block.moe.shared_gate_up, BlockQuantized)  # gate over up joined on a block boundary
    assert not isinstance(ModelWeights.from_tensors(cfg, dense.tensors).mtp[0].h_proj, BlockQuantized)
    for keep, loaded in ((True, kept), (False, dense)):
        assert weight_bytes(path, cfg, torch.float32, keep) == _bytes(loaded.tensors)


def check_kept_and_dense(made, kept, dense, names) -> None:
    """The tensors `names` loaded kept quantized (`kept`) are `made`'s bytes; dequantized (`dense`), their values."""
    for name in names:
        a, b, d = made[name], kept.tensors[name], dense.tensors[name]
        if isinstance(a, BlockQuantized):
            assert isinstance(b, BlockQuantized) and (a.format, a.block) == (b.format, b.block), name
            assert torch.equal(a.values.view(torch.uint8), b.values.view(torch.uint8)), name
            assert torch.equal(a.scales.view(torch.uint8), b.scales.contiguous().view(torch.uint8)), name
            assert torch.equal(d, a.dequantize(torch.float32)), name
        else:
            assert not isinstance(b, BlockQuantized) and torch.equal(a, b) and torch.equal(a, d), name


def skipped_drafter(path) -> ModelWeights:
    """`load_mtp=False` on a checkpoint with drafter tensors: every `mtp.*` tensor skipped, not read."""
    cfg = ModelConfig.from_model_dir(path)
    n_mtp = sum(is_mtp(k) for k in load_file(str(path / "model.safetensors")))
    ckpt = load_checkpoint(path, cfg, torch.float32, load_mtp=False)
    assert ckpt.mtp_skipped == n_mtp > 0 and ckpt.mtp_layers == 0 and not ckpt.ignored
    assert not any(name.startswith("mtp.") for name in ckpt.tensors)
    assert weight_bytes(path, cfg, torch.float32, False, load_mtp=False) == _bytes(ckpt.tensors)
    return ModelWeights.from_tensors(cfg, ckpt.tensors)


def test_load_mtp_false_skips_the_mtp_tensors(quantized):
    path, _ = quantized
    weights = skipped_drafter(path)
    assert weights.mtp == () and weights.dspark is None


def test_checkpoint_without_mtp_tensors_loads_no_mtp_layer(tmp_path):
    src = random_tensors(ModelConfig.from_dict(TINY_A), seed=8)
    ckpt = load_checkpoint(write(tmp_path / "m", TINY_MTP, spelled(src, "hf")), CFG, torch.float32)
    assert ckpt.mtp_layers == 0 and ModelWeights.from_tensors(CFG, ckpt.tensors).mtp == ()


def test_unknown_mtp_tensors_are_ignored(tmp_path):
    src = random_tensors(CFG, seed=9)
    extra = {"mtp.1.e_proj.weight": torch.zeros(64, 64), "model.mtp.0.embed.weight": torch.zeros(4, 64)}
    ckpt = load_checkpoint(write(tmp_path / "m", TINY_MTP, {**spelled(src, "upstream"), **extra}), CFG, torch.float32)
    assert sorted(ckpt.ignored) == sorted(extra) and ckpt.mtp_layers == 1


# ---- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize("missing", ["mtp.0.hnorm.weight", "mtp.0.mlp.experts.down_proj", "mtp.0.hc_head.hc_scale"])
def test_a_missing_mtp_tensor_is_named(tmp_path, missing):
    src = random_tensors(CFG, seed=10)
    del src[missing]
    path = write(tmp_path / "m", TINY_MTP, spelled(src, "hf"))
    pattern = rf"lacks 1 tensor\(s\) the config's 1 MTP layer\(s\).*requires: {re.escape(missing)}$"
    with pytest.raises(WeightsError, match=pattern):
        load_checkpoint(path, CFG, torch.float32)
    with pytest.raises(WeightsError, match=pattern):
        ModelWeights.from_tensors(CFG, src)


def test_a_misshapen_mtp_tensor_is_named(tmp_path):
    src = random_tensors(CFG, seed=11)
    src["mtp.0.e_proj.weight"] = torch.zeros(64, 32)
    with pytest.raises(WeightsError, match=r"mtp.0.e_proj.weight.*\[64, 32\].*\[64, 64\]"):
        load_checkpoint(write(tmp_path / "m", TINY_MTP, spelled(src, "upstream")), CFG, torch.float32)
    with pytest.raises(WeightsError, match=r"tensor mtp.0.e_proj.weight has shape \[64, 32\]"):
        ModelWeights.from_tensors(CFG, src)
