"""benchmarks/decode_v41.py without a GPU: its V4.1-Flash slice config, the CPU smoke run of the tiny slice (same
layer kinds and weight formats, reference ops), and its floor arithmetic checked by hand on the tiny config."""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks import decode_v41 as bench
from tilekernels.quant import BlockQuantized

FP4 = ("fp4", (1, 32), True)


@pytest.fixture(scope="module")
def tiny():
    return bench.slice_config(tiny=True)


def test_slice_config_has_the_real_widths_and_one_layer_of_each_kind():
    from deepinfer.config_v41 import read_config
    from deepinfer.model.v41_weights import tensor_specs

    cfg = read_config(bench.SLICE)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank) == (5120, 64, 512, 1280)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (384, 6, 2304)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, cfg.candidate_topk_blocks) == (32, 128, 512, 2048)
    assert [cfg.layer_kind(i) for i in range(7)] == [
        "window", "window + engram", "ratio-2 source + index source", "ratio-2 reader of 2",
        "ratio-1 source + index source + candidate source", "ratio-1 reader of 4 + index source",
        "ratio-1 reader of 4"]
    assert list(bench.hasher_for(cfg).table_rows) == list(cfg.engram.num_embeddings)  # the reduced table
    specs = tensor_specs(cfg)
    experts = sum(math.prod(s.shape) for n, s in specs.items() if ".ffn.experts." in n)
    assert experts == 7 * 384 * 3 * 5120 * 2304
    assert specs["layers.1.engram.embed.weight"].shape == (4803306, 256)
    # at their kept formats: 50.5 GB of FP4 experts, the rest a few GB (fits one H200 with a 32K x 128 cache)
    assert 50.5e9 < experts * bench.per_value(FP4, "model") < 50.6e9


def test_floor_arithmetic_by_hand(tiny):
    # 8 experts, top-2, I 32, D 64: 3 tokens miss an expert with probability (3/4)^3
    assert bench.distinct_experts(8, 2, 1) == pytest.approx(2)
    assert bench.distinct_experts(8, 2, 3) == pytest.approx(8 * (1 - 27 / 64))
    # an FP4 expert: 3 x 64 x 32 values at half a byte (3072) plus one ue8m0 byte per 32 (192)
    assert 3 * 64 * 32 * bench.per_value(FP4, "model") == 3264
    assert bench.per_value(("fp8", (32, 32), True), "model") == 1 + 1 / 1024
    floor = bench.decode_floor(tiny, batch=3, context=40)
    assert floor["experts"] == pytest.approx(7 * 8 * (1 - 27 / 64) * 3264)
    # window 8: 7 earlier rows of 64 bf16 values per layer and sequence
    assert floor["window"] == 3 * 7 * (7 * 64 * 2)
    # 5 compressed layers read their top-6 latents: ratio 2 sees 41 // 2 = 20, ratio 1 sees 41; FP4 as stored: 32
    # bytes of codes and 4 e4m3 scale bytes per 64-wide latent
    assert floor["latents"] == 3 * 5 * (6 * (32 + 4))
    # index keys (32 wide, 16 bytes of codes and one ue8m0 byte): layer 2 scores 20, layer 4 (the candidate
    # source) 41, layer 5 its 3 blocks of 4
    assert floor["index_keys"] == 3 * (20 + 41 + 12) * (16 + 1)
    # per token: the embedding row and 3 n-gram sizes x 2 heads Engram rows of 32 FP8 values + a scale
    assert floor["tokens"] == 3 * (64 * 2 + 6 * 33)
    win, lat, keys = bench.per_query(tiny, 5, torch.arange(10.0))
    assert win.tolist() == [min(t + 1, 8) for t in range(10)]
    assert lat.tolist() == [min(t + 1, 6) for t in range(10)] and keys.tolist() == list(range(1, 11))


def test_cpu_smoke_run(tiny, tmp_path, capsys):
    from deepinfer.model.v41 import DeepseekV41
    from tilekernels import reference_table

    out = tmp_path / "v41.json"
    res = bench.main(["--device", "cpu", "--tiny", "--budget", "0", "--contexts", "40", "--out", str(out)])
    assert json.loads(out.read_text())["decode"] == json.loads(json.dumps(res["decode"]))
    assert [(r["context"], r["batch"]) for r in res["decode"]] == [(40, 1), (40, 3)]
    assert all(r["step_ms"] > 0 and r["floor_ms"] > 0 and r["iters"] == 1 for r in res["decode"])
    prefill = res["prefill"][0]
    assert prefill["tokens"] == 40 and prefill["seconds"] > 0 and prefill["floor"]["flops"]["fp8"] > 0
    assert "| 40 | 3 |" in capsys.readouterr().out

    weights = bench.make_weights(tiny, torch.bfloat16, "cpu", log=lambda *_: None)
    moe, attn = weights.layers[4].moe, weights.layers[4].attn
    assert isinstance(moe.gate_up, BlockQuantized) and moe.gate_up.format == "fp4" and moe.gate_up.shape == (8, 64, 64)
    assert moe.gate_up.scales.dtype == torch.uint8 and attn.wq_a.format == "fp8" and attn.wq_a.block == (32, 32)
    # the floor's bytes are the bytes stored: every weight = dense + embedding + all experts + the Engram table
    floor, table = bench.decode_floor(tiny, 1, 40), tiny.engram.num_embeddings[0] * 33
    assert bench.nbytes(weights) == floor["dense"] + 256 * 64 * 2 + 7 * 8 * 3264 + table
    model = DeepseekV41(tiny, weights, reference_table(), bench.hasher_for(tiny))
    cache = model.new_cache(2, 48)
    ids = torch.randint(0, 256, (20,))
    assert torch.isfinite(model.prefill(cache, ids, 0)).all()
    assert torch.isfinite(model.prefill(cache, ids[:7], 1)).all()
    assert torch.isfinite(model.decode(cache, torch.tensor([5, 6]), [0, 1])).all()
