"""Loading HF-format directories: save_pretrained names, HF in-memory names, upstream names, shards,
FP8/FP4-quantized tensors, and the errors for broken checkpoints."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer.config import ModelConfig
from deepinfer.errors import ConfigError, WeightsError
from deepinfer.model.weights import ModelWeights
from deepinfer.weights.loader import load_checkpoint
from tests.helpers import TINY_A, Runner, canonical_state, hf_model, write_json
from tilekernels import reference_table

IDS = torch.arange(150) * 7 % 512


def logits_of(cfg: ModelConfig, tensors) -> torch.Tensor:
    run = Runner(cfg, ModelWeights.from_tensors(cfg, tensors), reference_table(), tokens=256, seqs=1)
    return run.prefill(run.new_seq(), IDS)


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Same weights give the same logits up to fp32 summation-order noise (BLAS picks kernels by alignment)."""
    assert a.shape == b.shape and (a - b).abs().max().item() <= 1e-6


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    hf = hf_model(TINY_A)
    path = tmp_path_factory.mktemp("tiny") / "saved"
    hf.save_pretrained(path)
    return path, canonical_state(hf)


def copy_config(src, dst):
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", dst / "config.json")
    return ModelConfig.from_model_dir(dst)


def write_shards(tensors: dict, dst, n_shards: int = 3) -> None:
    names = sorted(tensors)
    weight_map = {}
    for s in range(n_shards):
        fname = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {k: tensors[k].contiguous() for k in names[s::n_shards]}
        save_file(part, str(dst / fname))
        weight_map.update({k: fname for k in part})
    write_json(dst / "model.safetensors.index.json", {"metadata": {}, "weight_map": weight_map})


def test_save_pretrained_names_load_to_the_same_logits(saved):
    path, state = saved
    names = load_file(str(path / "model.safetensors"))
    assert "model.layers.1.attn.wq_a.weight" in names and "head.weight" in names  # upstream-style, unfused
    cfg = ModelConfig.from_model_dir(path)
    ckpt = load_checkpoint(path, cfg, torch.float32)
    assert set(ckpt.tensors) == set(state)
    for k, v in state.items():
        assert torch.equal(ckpt.tensors[k], v.to(ckpt.tensors[k].dtype)), k
    assert_same(logits_of(cfg, ckpt.tensors), logits_of(cfg, state))


def test_sharded_copy_gives_the_same_logits(saved, tmp_path):
    path, _ = saved
    cfg = ModelConfig.from_model_dir(path)
    write_shards(load_file(str(path / "model.safetensors")), tmp_path)
    shutil.copy(path / "config.json", tmp_path / "config.json")
    one = load_checkpoint(path, cfg, torch.float32).tensors
    sharded = load_checkpoint(tmp_path, cfg, torch.float32).tensors
    for k in one:
        assert torch.equal(one[k], sharded[k]), k
    assert_same(logits_of(cfg, one), logits_of(cfg, sharded))


def test_hf_in_memory_and_upstream_names(saved, tmp_path):
    path, state = saved
    cfg = copy_config(path, tmp_path / "hf")
    save_file({("model." + k if not k.startswith("lm_head") else k): v.contiguous() for k, v in state.items()},
              str(tmp_path / "hf" / "model.safetensors"))
    expected = logits_of(cfg, state)
    assert_same(logits_of(cfg, load_checkpoint(tmp_path / "hf", cfg, torch.float32).tensors), expected)
    # DeepSeek's upstream layout: no "model." prefix, embed/head names, hc_head_* flat names
    saved_names = load_file(str(path / "model.safetensors"))
    upstream = {}
    for k, v in saved_names.items():
        k = k.removeprefix("model.")
        k = {"embed_tokens.weight": "embed.weight"}.get(k, k)
        k = k.replace("hc_head.hc_", "hc_head_")
        upstream[k] = v
    copy_config(path, tmp_path / "up")
    save_file(upstream, str(tmp_path / "up" / "model.safetensors"))
    assert_same(logits_of(cfg, load_checkpoint(tmp_path / "up", cfg, torch.float32).tensors), expected)


def _quantize_fp8(w: torch.Tensor, block: int):
    rows, cols = w.shape
    grid = (-(-rows // block), -(-cols // block))
    exps = torch.randint(-8, -4, grid)
    scale = exps.float().exp2()
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    q = (w / full).to(torch.float8_e4m3fn)
    return q, (exps + 127).to(torch.uint8).view(torch.float8_e8m0fnu), q.float() * full


def _quantize_fp4(w: torch.Tensor):
    rows, cols = w.shape
    codes = torch.randint(0, 16, (rows, cols), dtype=torch.uint8)
    exps = torch.randint(-8, -5, (rows, cols // 32))
    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    values = lut[codes.long()] * exps.float().exp2().repeat_interleave(32, 1)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)
    return packed, (exps + 127).to(torch.uint8).view(torch.float8_e8m0fnu), values


def test_fp8_dense_and_fp4_expert_checkpoint(saved, tmp_path):
    path, _ = saved
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [16, 16], "scale_fmt": "ue8m0",
                                  "expert_dtype": "fp4"}
    write_json(tmp_path / "config.json", raw)
    cfg = ModelConfig.from_model_dir(tmp_path)
    src = load_file(str(path / "model.safetensors"))
    out, expected_src = {}, {}
    for k, v in src.items():
        bare = k.removeprefix("model.")
        if ".experts." in k and k.endswith(".weight"):  # per-expert w1/w2/w3: FP4 with 1x32 ue8m0 scales
            q, s, deq = _quantize_fp4(v)
            out[k], out[k[: -len(".weight")] + ".scale"], expected_src[k] = q, s, deq
        elif ".attn.w" in k and k.endswith(".weight") and "compressor" not in bare and "indexer" not in bare:
            q, s, deq = _quantize_fp8(v, 16)  # dense attention projections: FP8 e4m3, 16x16 blocks here
            out[k], out[k[: -len(".weight")] + ".scale"], expected_src[k] = q, s, deq
        else:
            out[k] = expected_src[k] = v
    save_file(out, str(tmp_path / "model.safetensors"))
    ckpt = load_checkpoint(tmp_path, cfg, torch.float32)
    assert ckpt.quantized > 20
    ref_dir = tmp_path / "ref"
    copy_config(path, ref_dir)
    save_file(expected_src, str(ref_dir / "model.safetensors"))
    reference = load_checkpoint(ref_dir, cfg, torch.float32).tensors
    for k in reference:
        assert torch.equal(ckpt.tensors[k], reference[k]), k


def test_mtp_tensors_of_a_config_without_mtp_layers_are_ignored(saved, tmp_path):
    """(tests/weights/test_mtp_loading.py loads the MTP layers of configs that have them.)"""
    path, _ = saved
    raw = json.loads((path / "config.json").read_text())
    assert raw["num_nextn_predict_layers"] == 1  # HF's default, saved with a model that has no mtp.* tensors
    assert load_checkpoint(path, ModelConfig.from_dict(raw), torch.float32).mtp_layers == 0
    write_json(tmp_path / "config.json", dict(raw, num_nextn_predict_layers=0))
    tensors = load_file(str(path / "model.safetensors"))
    tensors["mtp.0.e_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    ckpt = load_checkpoint(tmp_path, ModelConfig.from_model_dir(tmp_path), torch.float32)
    assert ckpt.ignored == ["mtp.0.e_proj.weight"] and ckpt.mtp_layers == 0
    assert not any(k.startswith("mtp") for k in ckpt.tensors)


# ---- errors ------------------------------------------------------------------------------------


def test_missing_config_json(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_model_dir(tmp_path)


def test_wrong_model_type(saved, tmp_path):
    raw = json.loads((saved[0] / "config.json").read_text())
    raw["model_type"] = "deepseek_v3"
    write_json(tmp_path / "config.json", raw)
    with pytest.raises(ConfigError, match="model_type is 'deepseek_v3'.*deepseek_v4"):
        ModelConfig.from_model_dir(tmp_path)


def test_unknown_layer_type():
    raw = dict(TINY_A, layer_types=["sliding_attention", "local_attention", "sliding_attention",
                                    "sliding_attention", "sliding_attention"])
    with pytest.raises(ConfigError, match=r"layer_types\[1\] is 'local_attention'.*accepted"):
        ModelConfig.from_dict(raw)
    with pytest.raises(ConfigError, match=r"compress_ratios\[2\] is 64"):
        ModelConfig.from_dict(dict(TINY_A, compress_ratios=[0, 4, 64, 4, 128]))


def test_missing_shard(saved, tmp_path):
    path, _ = saved
    cfg = copy_config(path, tmp_path)
    write_shards(load_file(str(path / "model.safetensors")), tmp_path)
    (tmp_path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(WeightsError, match="shard 'model-00002-of-00003.safetensors'.*missing"):
        load_checkpoint(tmp_path, cfg, torch.float32)


def test_missing_tensor_and_wrong_shape(saved, tmp_path):
    path, _ = saved
    cfg = copy_config(path, tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.attn.compressor.ape"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightsError, match="lacks 1 tensor.*layers.1.self_attn.compressor.position_bias"):
        load_checkpoint(tmp_path, cfg, torch.float32)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.2.attn.wq_a.weight"] = torch.zeros(31, 64)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightsError, match=r"layers.2.self_attn.q_a_proj.weight.*\[31, 64\].*\[32, 64\]"):
        load_checkpoint(tmp_path, cfg, torch.float32)
