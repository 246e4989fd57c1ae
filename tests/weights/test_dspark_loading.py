"""Loading DSpark block drafting's tensors (`mtp.{j}.*` draft blocks with their own experts, `mtp.0.main_proj` /
`main_norm`, the last block's norm, HyperHead, Markov and confidence heads) on TINY_DSPARK: HF-style, DeepSeek's
upstream and DeepSpec's Markov-head spellings, plain and quantized (FP8 dense incl. main_proj, FP4 experts; kept
or dequantized), `load_mtp=False`, the errors (a partial or misshapen DSpark set, bad `dspark_*` config keys),
and `LLM(speculative_tokens=...)` on a DSpark checkpoint."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file

import deepinfer
from deepinfer.config import ModelConfig
from deepinfer.config_dspark import DSparkConfig
from deepinfer.errors import ConfigError, WeightsError
from deepinfer.model.dspark_weights import dspark_tensor_specs
from deepinfer.model.weights import ModelWeights, mtp_tensor_specs, tensor_specs
from deepinfer.tiny import random_tensors
from deepinfer.weights.loader import load_checkpoint, weight_bytes
from deepinfer.weights.names import canonical
from deepinfer.weights.synthetic import quantize_in_memory, write_checkpoint
from tests.helpers import TINY_A, TINY_DSPARK, TINY_MTP, save_model_dir
from tests.weights.test_mtp_loading import _UPSTREAM, _bytes, check_kept_and_dense, skipped_drafter, write
from tilekernels.quant import BlockQuantized

CFG = ModelConfig.from_dict(TINY_DSPARK)
DSPARK = list(mtp_tensor_specs(CFG))
QC = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [32, 32], "expert_dtype": "fp4"}
_DEEPSPEC = {"markov_head.embed.weight": "markov_head.markov_w1.weight",
             "markov_head.head.weight": "markov_head.markov_w2.weight"}
_MTP_NAME = re.compile(r"^mtp\.(\d+)\.(.*)$")


def spelled(tensors: dict[str, torch.Tensor], spelling: str) -> dict[str, torch.Tensor]:
    """Canonical tensors -> checkpoint tensors: all in HF in-memory names with `model.` ("hf"); the same with the
    Markov head in DeepSpec's names, `markov_head.markov_w1` / `markov_w2` ("deepspec"); or the draft blocks in
    DeepSeek's upstream names, per-expert `mtp.N.ffn.experts.E.w1.weight`, `mtp.N.hc_head_fn` ("upstream")."""
    out = {}
    for name, t in tensors.items():
        m = _MTP_NAME.match(name)
        if m is None or spelling == "hf":
            out["model." + name] = t
            continue
        lead, rest = f"mtp.{m.group(1)}.", m.group(2)
        if spelling == "deepspec":
            out["model." + lead + _DEEPSPEC.get(rest, rest)] = t
        elif rest.startswith("mlp.experts."):
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                parts = {"w2": t[e]} if rest.endswith("down_proj") else {"w1": t[e, :half], "w3": t[e, half:]}
                out.update({f"{lead}ffn.experts.{e}.{w}.weight": v.contiguous() for w, v in parts.items()})
        else:
            out[lead + _UPSTREAM.get(rest, rest)] = t
    return out


def check_dspark(weights: ModelWeights, src: dict[str, torch.Tensor]) -> None:
    """The loaded DSpark drafter holds `src`'s tensors (cast to the kept dtype), and no MTP layer."""
    ds = weights.dspark
    assert ds is not None and weights.mtp == () and weights.draft_layers == 2 and len(ds.blocks) == 2
    for got, name in [(ds.main_proj, "mtp.0.main_proj.weight"), (ds.main_norm, "mtp.0.main_norm.weight"),
                      (ds.norm, "mtp.1.norm.weight"), (ds.hc_head.fn, "mtp.1.hc_head.hc_fn"),
                      (ds.hc_head.base, "mtp.1.hc_head.hc_base"), (ds.hc_head.scale, "mtp.1.hc_head.hc_scale"),
                      (ds.markov_embed, "mtp.1.markov_head.embed.weight"),
                      (ds.markov_head, "mtp.1.markov_head.head.weight"),
                      (ds.confidence, "mtp.1.confidence_head.proj.weight")]:
        assert torch.equal(got, src[name].to(got.dtype)), name
    for j, block in enumerate(ds.blocks):
        for got, name in [(block.attn.kv_norm, "self_attn.kv_norm.weight"),
                          (block.attn.q_a_proj, "self_attn.q_a_proj.weight"),
                          (block.attn_hc.base, "attn_hc.base"), (block.moe.gate_up, "mlp.experts.gate_up_proj"),
                          (block.moe.down, "mlp.experts.down_proj"), (block.moe.gate, "mlp.gate.weight")]:
            assert torch.equal(got, src[f"mtp.{j}.{name}"].to(got.dtype)), (j, name)
        assert block.attn.compressor is None and block.moe.tid2eid is None and block.moe.down.shape[0] == 4


# ---- config, names and specs --------------------------------------------------------------------


def test_config_reads_the_dspark_keys():
    assert CFG.dspark == DSparkConfig(block_size=4, noise_token_id=7, target_layer_ids=(1, 3, 4), markov_rank=16,
                                      n_routed_experts=4, num_experts_per_tok=2)
    assert CFG.num_nextn_predict_layers == 2
    assert ModelConfig.from_dict(TINY_MTP).dspark is None and ModelConfig.from_dict(TINY_A).dspark is None
    assert ModelConfig.from_dict(dict(TINY_DSPARK, dspark_block_size=0)).dspark is None
    raw = {k: v for k, v in TINY_DSPARK.items() if k not in ("dspark_n_routed_experts", "dspark_num_experts_per_tok")}
    ds = ModelConfig.from_dict(raw).dspark
    assert (ds.n_routed_experts, ds.num_experts_per_tok) == (8, 2)  # the target's
    assert ModelConfig.from_dict({k: v for k, v in raw.items() if k != "dspark_markov_rank"}).dspark.markov_rank == 256


@pytest.mark.parametrize("change, message", [
    ({"dspark_target_layer_ids": [1, 5]}, r"dspark_target_layer_ids must list target layers in \[0, 5\), .*got \[1, 5\]"),
    ({"dspark_target_layer_ids": [-1]}, r"dspark_target_layer_ids .*got \[-1\]"),
    ({"dspark_target_layer_ids": []}, r"dspark_target_layer_ids .*got \[\]"),
    ({"dspark_target_layer_ids": [4, 1, 3]}, r"dspark_target_layer_ids .*increasing .*got \[4, 1, 3\]"),
    ({"dspark_target_layer_ids": [1, 1, 3]}, r"dspark_target_layer_ids .*increasing .*got \[1, 1, 3\]"),
    ({"num_nextn_predict_layers": 0, "compress_ratios": [0, 4, 128, 4, 128]},
     r"dspark_block_size 4 needs .*num_nextn_predict_layers must be >= 1.*got 0"),
    ({"dspark_noise_token_id": 512}, r"dspark_noise_token_id 512 is not a token id \(vocab_size 512\)"),
    ({"dspark_noise_token_id": -1}, r"dspark_noise_token_id must be an integer >= 0, got -1"),
    ({"dspark_noise_token_id": None}, r"dspark_noise_token_id must be an integer >= 0, got None"),
    ({"dspark_target_layer_ids": None}, r"dspark_target_layer_ids must list target layers .*got None"),
    ({"dspark_num_experts_per_tok": 5}, r"dspark_num_experts_per_tok 5 exceeds dspark_n_routed_experts 4"),
    ({"dspark_n_routed_experts": 0}, r"dspark_n_routed_experts must be an integer >= 1, got 0"),
    ({"dspark_block_size": -2}, r"dspark_block_size must be an integer >= 1, got -2"),
])
def test_bad_dspark_config_is_named(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(dict(TINY_DSPARK, **change))


def test_dspark_names_map_to_canonical_ones():
    for name, want in [("mtp.0.main_proj.weight", "mtp.0.main_proj.weight"),
                       ("model.mtp.0.main_norm.weight", "mtp.0.main_norm.weight"),
                       ("mtp.1.markov_head.markov_w1.weight", "mtp.1.markov_head.embed.weight"),
                       ("model.mtp.1.markov_head.markov_w2.weight", "mtp.1.markov_head.head.weight"),
                       ("mtp.1.markov_head.embed.weight", "mtp.1.markov_head.embed.weight"),
                       ("mtp.1.confidence_head.proj.weight", "mtp.1.confidence_head.proj.weight"),
                       ("mtp.1.hc_head_fn", "mtp.1.hc_head.hc_fn"), ("mtp.1.norm.weight", "mtp.1.norm.weight"),
                       ("mtp.1.attn.kv_norm.weight", "mtp.1.self_attn.kv_norm.weight")]:
        assert canonical(name) == want, name


def test_dspark_specs():
    specs = mtp_tensor_specs(CFG)
    assert specs == dspark_tensor_specs(CFG) and not set(specs) & set(tensor_specs(CFG))
    assert specs["mtp.0.main_proj.weight"].shape == (64, 3 * 64)  # three tapped layers
    assert specs["mtp.1.markov_head.embed.weight"].shape == specs["mtp.1.markov_head.head.weight"].shape == (512, 16)
    assert specs["mtp.1.confidence_head.proj.weight"].shape == (1, 64 + 16)
    assert specs["mtp.0.mlp.experts.down_proj"].shape[0] == specs["mtp.1.mlp.gate.weight"].shape[0] == 4
    assert not any(".compressor." in n or ".e_proj." in n or "tid2eid" in n for n in specs)
    assert "mtp.1.norm.weight" in specs and "mtp.0.norm.weight" not in specs  # the last block's heads only
    assert "mtp.1.main_proj.weight" not in specs and "mtp.0.markov_head.embed.weight" not in specs


# ---- loading ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spelling", ["hf", "upstream", "deepspec"])
def test_plain_checkpoint_loads_the_dspark_drafter(tmp_path, spelling, dtype):
    src = random_tensors(CFG, seed=5, dtype=dtype)
    written = spelled(src, spelling)
    if spelling == "upstream":
        assert {"mtp.0.main_proj.weight", "mtp.1.hc_head_fn", "mtp.1.ffn.experts.3.w2.weight",
                "mtp.0.attn.wq_a.weight", "mtp.1.markov_head.embed.weight"} <= set(written)
    if spelling == "deepspec":
        assert {"model.mtp.1.markov_head.markov_w1.weight", "model.mtp.1.markov_head.markov_w2.weight"} <= set(written)
    ckpt = load_checkpoint(write(tmp_path / "m", TINY_DSPARK, written), CFG, dtype)
    assert ckpt.mtp_layers == 2 and not ckpt.ignored and set(ckpt.tensors) == set(src)
    for name, t in src.items():
        assert torch.equal(ckpt.tensors[name], t.to(ckpt.tensors[name].dtype)), name
    weights = ModelWeights.from_tensors(CFG, ckpt.tensors)
    assert len(weights.layers) == 5 and weights.dspark.main_proj.dtype == dtype
    assert weights.dspark.main_norm.dtype == torch.float32
    check_dspark(weights, src)


@pytest.fixture(scope="module", params=["hf", "upstream"])
def quantized(request, tmp_path_factory):
    src = random_tensors(CFG, seed=6)
    return write_checkpoint(tmp_path_factory.mktemp("q") / request.param, TINY_DSPARK, src, request.param,
                            block=(32, 32)), src


def test_quantized_checkpoint_loads_the_dspark_drafter(quantized):
    path, src = quantized
    keys = set(load_file(str(path / "model.safetensors")))
    assert ({"mtp.0.main_proj.scale", "mtp.1.attn.wq_a.scale", "mtp.1.ffn.experts.3.w1.scale"} <= keys
            or {"model.mtp.0.main_proj.weight_scale_inv", "model.mtp.1.mlp.experts.gate_up_proj_scale_inv"} <= keys)
    cfg = ModelConfig.from_model_dir(path)
    made = quantize_in_memory({name: src[name] for name in DSPARK}, QC)
    assert made["mtp.0.main_proj.weight"].format == made["mtp.1.self_attn.q_a_proj.weight"].format == "fp8"
    assert made["mtp.0.mlp.experts.down_proj"].format == "fp4"
    assert not isinstance(made["mtp.1.markov_head.embed.weight"], BlockQuantized)
    kept = load_checkpoint(path, cfg, torch.float32, keep_quantized=True)  # --quantization auto
    dense = load_checkpoint(path, cfg, torch.float32)  # --quantization none
    assert kept.mtp_layers == dense.mtp_layers == 2 and not kept.ignored
    check_kept_and_dense(made, kept, dense, DSPARK)
    ds = ModelWeights.from_tensors(cfg, kept.tensors).dspark
    assert isinstance(ds.main_proj, BlockQuantized) and isinstance(ds.blocks[1].moe.gate_up, BlockQuantized)
    assert not isinstance(ds.markov_embed, BlockQuantized) and not isinstance(ds.confidence, BlockQuantized)
    as_dense = ModelWeights.from_tensors(cfg, dense.tensors)
    assert not isinstance(as_dense.dspark.main_proj, BlockQuantized)
    check_dspark(as_dense, {n: a.dequantize(torch.float32) if isinstance(a, BlockQuantized) else a
                            for n, a in made.items()})  # the plain ones as written, the quantized dequantized
    for keep, loaded in ((True, kept), (False, dense)):
        assert weight_bytes(path, cfg, torch.float32, keep) == _bytes(loaded.tensors)


def test_load_mtp_false_skips_the_dspark_tensors(quantized):
    path, _ = quantized
    weights = skipped_drafter(path)
    assert weights.dspark is None and weights.mtp == () and weights.draft_layers == 0


# ---- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize("missing", ["mtp.1.confidence_head.proj.weight", "mtp.0.main_norm.weight",
                                     "mtp.1.markov_head.head.weight", "mtp.0.mlp.experts.down_proj"])
def test_a_missing_dspark_tensor_is_named(tmp_path, missing):
    src = random_tensors(CFG, seed=10)
    del src[missing]
    path = write(tmp_path / "m", TINY_DSPARK, spelled(src, "hf"))
    pattern = rf"lacks 1 tensor\(s\) the config's 2 DSpark draft block\(s\).*requires: {re.escape(missing)}$"
    with pytest.raises(WeightsError, match=pattern):
        load_checkpoint(path, CFG, torch.float32)
    with pytest.raises(WeightsError, match=pattern):
        ModelWeights.from_tensors(CFG, src)


def test_a_misshapen_dspark_tensor_is_named(tmp_path):
    src = random_tensors(CFG, seed=11)
    src["mtp.0.main_proj.weight"] = torch.zeros(64, 128)  # two tapped layers' width, the config has three
    with pytest.raises(WeightsError, match=r"mtp.0.main_proj.weight.*\[64, 128\].*\[64, 192\]"):
        load_checkpoint(write(tmp_path / "m", TINY_DSPARK, spelled(src, "upstream")), CFG, torch.float32)
    with pytest.raises(WeightsError, match=r"tensor mtp.0.main_proj.weight has shape \[64, 128\]"):
        ModelWeights.from_tensors(CFG, src)


def test_target_experts_in_a_draft_block_are_named(tmp_path):
    src = random_tensors(CFG, seed=12)
    src["mtp.1.mlp.experts.down_proj"] = torch.zeros(8, *src["mtp.1.mlp.experts.down_proj"].shape[1:])
    with pytest.raises(WeightsError, match=r"mtp.1.mlp.experts.down_proj.*\[8, 64, 32\].*\[4, 64, 32\]"):
        load_checkpoint(write(tmp_path / "m", TINY_DSPARK, spelled(src, "hf")), CFG, torch.float32)


# ---- the engine ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dspark_dir(tmp_path_factory):
    return save_model_dir(tmp_path_factory.mktemp("llm") / "tiny-dspark", TINY_DSPARK, random_tensors(CFG, seed=1))


def _llm(path, **kw):
    return deepinfer.LLM(path, prefix_cache="off", max_num_seqs=2, **kw)


def test_llm_speculative_tokens_on_a_dspark_checkpoint(dspark_dir, monkeypatch):
    monkeypatch.delenv("DEEPINFER_USE_NEXTN_DECODE", raising=False)
    with pytest.raises(ConfigError, match=r"speculative_tokens=5: .*dspark_block_size=4 tokens; pass at most 4"):
        _llm(dspark_dir, speculative_tokens=5)
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "6")  # refused before anything loads, naming the variable
    with pytest.raises(ConfigError, match=r"DEEPINFER_USE_NEXTN_DECODE=6: .*pass at most 4"):
        _llm(dspark_dir)
    monkeypatch.delenv("DEEPINFER_USE_NEXTN_DECODE")
    llm = _llm(dspark_dir)  # the default: min(5, dspark_block_size)
    assert llm.speculative_tokens == 4 and llm.engine.speculator is not None
    assert llm.cache.spec.lookahead == 4  # rings and graphs sized for the block, not for 5
    assert llm.model.weights.dspark is not None and llm.model.weights.draft_layers == 2
    assert "4 DSpark drafts" in llm.describe()
    off = _llm(dspark_dir, speculative_tokens=0)
    assert off.speculative_tokens == 0 and off.engine.speculator is None
    assert off.model.weights.dspark is None  # not loaded: load_mtp=False
