"""V4.1 tensor specs from the released config (names and shapes as ../shared/design/model-v41.md lists them), and
the loader on the fixture checkpoints and damaged copies of them: FP8 32x32 / FP4 dequantization, the Engram
tables kept FP8, vision tensors skipped with one log line, draft (DSpark) tensors loaded, named errors."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer.config_v41 import V41Config
from deepinfer.errors import WeightsError
from deepinfer.model.v41_weights import TABLE, V41Weights, draft_specs, tensor_specs
from deepinfer.weights.v41_loader import load_v41
from tests.test_config_v41 import INFERENCE
from tests.v41_fixture import FIXTURES, fixture
from tilekernels.quant import BlockQuantized


def test_specs_of_the_released_config():
    specs = tensor_specs(V41Config.from_dict(INFERENCE))
    shape = {name: spec.shape for name, spec in specs.items()}
    assert shape["layers.0.attn.wq_a.weight"] == (1280, 5120) and shape["layers.0.attn.wq_b.weight"] == (32768, 1280)
    assert shape["layers.0.attn.wo_a.weight"] == (8192, 4096) and shape["layers.0.attn.wo_b.weight"] == (5120, 8192)
    assert shape["layers.0.hc_attn_fn"] == (24, 20480) and shape["layers.39.ffn.experts.383.w2.weight"] == (5120, 2304)
    for src in (2, 8, 14):  # ratio-2 kv and index sources
        assert shape[f"layers.{src}.attn.compressor.wgate.weight"] == (512, 5120)
        assert shape[f"layers.{src}.attn.indexer.wk.weight"] == (128, 512)
    assert "layers.20.attn.compressor.wgate.weight" not in shape  # ratio 1: no gate
    assert shape["layers.20.attn.indexer.k_norm.weight"] == (128,)
    for extra in (24, 28, 32, 36):  # index sources without keys
        assert shape[f"layers.{extra}.attn.indexer.wq_b.weight"] == (4096, 1280)
        assert f"layers.{extra}.attn.indexer.wk.weight" not in shape
    assert not any(n.startswith(("layers.21.attn.compressor", "layers.21.attn.indexer")) for n in shape)
    assert shape["layers.1.engram.embed.weight"] == (384006168, 256)
    assert specs["layers.1.engram.embed.weight"].kind == TABLE
    assert shape["layers.14.engram.wkv.weight"] == (25600, 6144) and "layers.2.engram.wkv.weight" not in shape
    drafts = draft_specs(V41Config.from_dict(INFERENCE))
    assert drafts["mtp.0.main_proj.weight"].shape == (5120, 15360)
    assert drafts["mtp.2.markov_head.head.weight"].shape == (129280, 256)
    assert drafts["mtp.2.confidence_head.proj.weight"].shape == (1, 5376)
    assert "mtp.1.ffn.experts.127.w1.weight" in drafts and "mtp.1.ffn.experts.128.w1.weight" not in drafts
    assert not any(".compressor." in n or ".indexer." in n or ".engram." in n for n in drafts)


def test_fp32_fixture_loads_and_keeps_the_engram_tables_fp8():
    fx = fixture("a")
    ckpt = load_v41(fx.path, fx.cfg)
    assert ckpt.quantized == 2 and not ckpt.vision
    table = ckpt.tensors["layers.1.engram.embed.weight"]
    assert isinstance(table, BlockQuantized) and table.format == "fp8" and table.block == (1, 32)
    assert ckpt.tensors["layers.0.hc_attn_fn"].dtype == torch.float32
    assert fx.weights.layers[3].compressor is None and fx.weights.layers[2].compressor.wgate is not None
    assert fx.weights.layers[4].compressor.wgate is None and fx.weights.layers[6].indexer.wk is None


def test_fp8_and_fp4_weights_are_dequantized_with_their_blocks():
    fx = fixture("b_faithful")
    raw = load_file(str(fx.path / "model.safetensors"))
    ckpt = load_v41(fx.path, fx.cfg)
    w, s = raw["layers.0.attn.wq_a.weight"], raw["layers.0.attn.wq_a.scale"]
    assert w.dtype == torch.float8_e4m3fn and s.shape == (1, 2)  # [32, 64] in 32x32 blocks
    want = w.float() * s.float().repeat_interleave(32, 0).repeat_interleave(32, 1)
    assert torch.equal(ckpt.tensors["layers.0.attn.wq_a.weight"], want)
    e, es = raw["layers.0.ffn.experts.3.w2.weight"], raw["layers.0.ffn.experts.3.w2.scale"]
    assert e.dtype == torch.int8 and tuple(e.shape) == (64, 16) and tuple(es.shape) == (64, 1)  # FP4 pairs, 1x32
    lut = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
    u = e.view(torch.uint8).long()
    codes = torch.stack([lut[u & 15], lut[u >> 4]], -1).flatten(1)  # low nibble first
    # routed experts come stacked, expert by expert as read: down [E, D, I], gate (w1) over up (w3) [E, 2I, D]
    assert torch.equal(ckpt.tensors["layers.0.ffn.experts.down_proj"][3], codes * es.float())
    up = raw["layers.0.ffn.experts.3.w3.weight"].view(torch.uint8).long()
    codes = torch.stack([lut[up & 15], lut[up >> 4]], -1).flatten(1)
    scale = raw["layers.0.ffn.experts.3.w3.scale"].float().repeat_interleave(32, 1)
    assert torch.equal(ckpt.tensors["layers.0.ffn.experts.gate_up_proj"][3, 32:], codes * scale)
    assert not any(".experts.3." in name for name in ckpt.tensors)
    n_fp8 = sum(1 for k, v in raw.items() if v.dtype == torch.float8_e4m3fn)
    n_fp4 = sum(1 for k, v in raw.items() if v.dtype == torch.int8)
    assert ckpt.quantized == n_fp8 + n_fp4 and n_fp4 == 8 * 4 * 3


def test_progress_ticks_once_per_tensor_of_the_specs():
    """As V4's `load_checkpoint(progress=...)`: `progress(1)` per tensor, routed experts counted one by one as
    they join their stacks, so a bar of `len(tensor_specs(cfg))` steps ends full."""
    fx = fixture("b_faithful")
    ticks: list[int] = []
    ckpt = load_v41(fx.path, fx.cfg, progress=ticks.append)
    assert ticks == [1] * len(tensor_specs(fx.cfg)) and len(ckpt.tensors) < len(ticks)


def copy_with(tmp_path, name, change, config=None):
    """The fixture `name` copied to tmp_path with its tensors passed through `change(dict)`."""
    src = FIXTURES / name
    shutil.copy(src / "logits.pt", tmp_path / "logits.pt")
    cfg = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config(cfg) if config else cfg))
    tensors = load_file(str(src / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return V41Config.from_dict(json.loads((tmp_path / "config.json").read_text()))


def test_vision_tensors_are_skipped_with_one_line(tmp_path, caplog):
    def add(t):
        t["vision.blocks.0.attn.qkv.weight"] = torch.zeros(8, 8)
        t["aligner.proj.weight"] = torch.zeros(8, 8)
        t["image_newline"] = torch.zeros(64)
        t["layers.0.ffn.gate.bias_vl"] = torch.zeros(6)
        t["model.layers.1.attn.attn_sink"] = t.pop("layers.1.attn.attn_sink")  # a `model.` prefix is accepted

    cfg = copy_with(tmp_path, "a", add)
    with caplog.at_level(logging.INFO, logger="deepinfer.weights"):
        ckpt = load_v41(tmp_path, cfg)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "skipped 4 vision tensor(s)" in lines[0] and "images are not supported yet" in lines[0]
    assert "layers.1.attn.attn_sink" in ckpt.tensors


@pytest.mark.parametrize("change,message", [
    (lambda t: t.pop("layers.3.attn.wq_b.weight"), "lacks 1 tensor.*layers.3.attn.wq_b.weight"),
    (lambda t: t.update({"layers.2.attn.compressor.wgate.weight": torch.zeros(64, 32)}),
     r"layers.2.attn.compressor.wgate.weight has shape \[64, 32\], but the V4.1 config requires \[64, 64\]"),
    (lambda t: t.pop("layers.1.engram.embed.scale"), "layers.1.engram.embed.weight is quantized .* no "
                                                     "layers.1.engram.embed.scale"),
])
def test_bad_checkpoints_are_named(tmp_path, change, message):
    cfg = copy_with(tmp_path, "a", change)
    with pytest.raises(WeightsError, match=message):
        load_v41(tmp_path, cfg)


def test_a_scale_off_its_block_grid_is_named(tmp_path):
    def widen(t):
        t["layers.0.attn.wq_a.scale"] = t["layers.0.attn.wq_a.scale"].repeat(1, 2)

    cfg = copy_with(tmp_path, "b_faithful", widen)
    with pytest.raises(WeightsError, match=r"layers.0.attn.wq_a.weight: scale shape \[1, 4\] does not match the "
                                           r"32x32 block grid \[1, 2\]"):
        load_v41(tmp_path, cfg)


def test_draft_blocks_are_loaded(tmp_path):
    def with_drafts(c):
        c.update(n_mtp_layers=1, compress_ratios=c["compress_ratios"] + [0], dspark_block_size=5,
                 dspark_noise_token_id=3, dspark_target_layer_ids=[5, 6, 7], dspark_markov_rank=32,
                 dspark_n_routed_experts=4, dspark_n_activated_experts=2)
        return c

    base = V41Config.from_dict(with_drafts(json.loads((FIXTURES / "a" / "config.json").read_text())))
    drafts = {n: torch.randn(s.shape).bfloat16() for n, s in draft_specs(base).items()}
    drafts["mtp.0.embed.weight"] = torch.zeros(1)  # an alias of the main embedding: ignored
    cfg = copy_with(tmp_path, "a", lambda t: t.update(drafts), with_drafts)
    weights = V41Weights.from_tensors(cfg, load_v41(tmp_path, cfg).tensors)
    # 18 block, 4 x 3 routed-expert, 3 shared-expert and 6 DSpark head tensors
    assert set(weights.drafts) == set(draft_specs(cfg)) and len(weights.drafts) == 39
    assert weights.drafts["mtp.0.main_proj.weight"].shape == (64, 192)
    assert torch.equal(weights.drafts["mtp.0.ffn.experts.3.w1.weight"], drafts["mtp.0.ffn.experts.3.w1.weight"].float())
    ticks: list[int] = []  # V4's progress semantics: one tick per tensor, draft experts one by one too
    load_v41(tmp_path, cfg, progress=ticks.append)
    assert ticks == [1] * len(tensor_specs(cfg))
    missing = dict(drafts)
    del missing["mtp.0.confidence_head.proj.weight"]
    cfg = copy_with(tmp_path, "a", lambda t: t.update(missing), with_drafts)
    with pytest.raises(WeightsError, match="mtp.0.confidence_head.proj.weight"):
        load_v41(tmp_path, cfg)
