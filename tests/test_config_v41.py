"""V4.1 config parsing: the released config in both spellings (HF nested `text_config` with HF key names, and
DeepSeek's `inference/config.json` names), the layer wiring the reference uses, and named errors."""

from __future__ import annotations

import copy

import pytest

from deepinfer.config import ModelConfig
from deepinfer.config_v41 import V41Config, read_config
from deepinfer.errors import ConfigError

RATIOS = [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0]
# The released V4.1-Flash text config as DeepSeek's inference code names it (values: ../shared/design/model-v41.md)
INFERENCE = dict(
    vocab_size=129280, dim=5120, moe_inter_dim=2304, n_layers=40, n_mtp_layers=3, dspark_block_size=5,
    dspark_noise_token_id=128799, dspark_target_layer_ids=[37, 38, 39], dspark_markov_rank=256,
    dspark_n_routed_experts=128, dspark_n_activated_experts=3, n_heads=64, n_routed_experts=384,
    n_shared_experts=1, n_activated_experts=6, score_func="sqrtsoftplus", route_scale=1.5, swiglu_limit=10.0,
    q_lora_rank=1280, head_dim=512, rope_head_dim=64, norm_eps=1e-20, o_groups=8, o_lora_rank=1024,
    window_size=128, kv_source_layers=[2, 8, 14, 20], index_source_layers=[2, 8, 14, 20, 24, 28, 32, 36],
    original_seq_len=65536, rope_theta=10000, rope_factor=16, beta_fast=32, beta_slow=1, index_n_heads=32,
    index_head_dim=128, index_topk=512, candidate_source_layer=20, candidate_topk_blocks=2048,
    candidate_block_size=8, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, engram_layer_ids=[1, 14],
    engram_vocab_size=16000000, engram_num_embeddings=[384006168, 384016682], engram_max_ngram_size=4,
    engram_pad_id=2, engram_compressed_vocab_size=99092, compress_rope_theta=160000, compress_ratios=RATIOS,
    engram_n_heads=8, engram_head_dim=256, image_token_id=129264,
)
# The same in the Hugging Face layout: model_type, nested text_config, HF names
HF = {
    "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "bos_token_id": 0, "eos_token_id": 1,
    "image_token_id": 129264, "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32],
                                                      "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
    "vision_config": {"hidden_size": 1024},
    "text_config": dict(
        model_type="deepseek_v41_text", vocab_size=129280, hidden_size=5120, num_hidden_layers=40,
        num_attention_heads=64, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1280, o_lora_rank=1024, o_groups=8,
        rms_norm_eps=1e-20, swiglu_limit=10.0, rope_theta=10000, compress_rope_theta=160000,
        rope_scaling={"type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                      "original_max_position_embeddings": 65536},
        n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=6, moe_intermediate_size=2304,
        scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, sliding_window=128, compress_ratios=RATIOS,
        kv_source_layer_ids=[2, 8, 14, 20], index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36],
        index_n_heads=32, index_head_dim=128, index_topk=512, candidate_source_layer_id=20,
        candidate_topk_blocks=2048, candidate_block_size=8, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
        engram_layer_ids=[1, 14], engram_num_embeddings=[384006168, 384016682], engram_max_ngram_size=4,
        engram_vocab_size=16000000, engram_n_heads=8, engram_head_dim=256, engram_pad_token_id=2,
        engram_compressed_vocab_size=99092, num_nextn_predict_layers=3, dspark_block_size=5,
        dspark_noise_token_id=128799, dspark_target_layer_ids=[37, 38, 39], dspark_markov_rank=256,
        dspark_n_routed_experts=128, dspark_num_experts_per_tok=3,
    ),
}


def test_both_spellings_give_the_same_config():
    a, b = V41Config.from_dict(INFERENCE), V41Config.from_dict(HF)
    assert a == b
    assert a.num_hidden_layers == 40 and a.draft_compress_ratios == (0, 0, 0) and a.num_nextn_predict_layers == 3
    assert a.rope_compress.rope_type == "yarn" and a.rope_compress.factor == 16 and a.rope_main.rope_type == "default"
    assert a.engram.layer_ids == (1, 14) and a.engram.max_ngram == 4 and a.dspark.target_layer_ids == (37, 38, 39)


def test_layer_wiring_follows_the_reference():
    cfg = V41Config.from_dict(HF)
    assert [cfg.kv_source(i) for i in (0, 1, 2, 7, 8, 13, 14, 19, 20, 39)] == [None, None, 2, 2, 8, 8, 14, 14, 20, 20]
    assert [cfg.index_source(i) for i in (2, 19, 20, 23, 24, 27, 36, 39)] == [2, 14, 20, 20, 24, 24, 36, 36]
    assert cfg.layer_kind(0) == "window" and cfg.layer_kind(1) == "window + engram"
    assert cfg.layer_kind(14) == "ratio-2 source + index source + engram"
    assert cfg.layer_kind(20) == "ratio-1 source + index source + candidate source"
    assert cfg.layer_kind(24) == "ratio-1 reader of 20 + index source" and cfg.layer_kind(3) == "ratio-2 reader of 2"


def broken(**changes):
    raw = copy.deepcopy(INFERENCE)
    raw.update(changes)
    return raw


@pytest.mark.parametrize("raw, match", [
    (broken(compress_ratios=RATIOS[:-1]), "compress_ratios has 42 entries; expected one per layer and draft layer"),
    (broken(compress_ratios=[4] + RATIOS[1:]), r"compress_ratios holds \[4\]; accepted ratios"),
    (broken(kv_source_layers=[2, 8, 14]), "layer 20 has ratio 1 but no kv source layer of that ratio"),
    (broken(kv_source_layers=[0, 2]), r"kv_source_layers \[0\] are not backbone layers with a compression ratio"),
    (broken(index_source_layers=[8, 20]), "layer 2 has ratio 2 but no index source layer"),
    (broken(candidate_source_layer=14), "candidate_source_layer 14 must be a ratio-1 kv and index source"),
    (broken(engram_num_embeddings=[5]), "one engram_num_embeddings entry each"),
    (broken(n_heads=60), "n_heads 60 is not a multiple of o_groups 8"),
    (broken(dspark_target_layer_ids=[40]), r"dspark_target_layer_ids \[40\] must be backbone layers"),
    (broken(window_size="128"), "window_size is '128'; expected int"),
    ({**{k: v for k, v in INFERENCE.items() if k != "index_topk"}}, "missing required key 'index_topk'"),
    ({"model_type": "deepseek_v4"}, "model_type is 'deepseek_v4'; a DeepSeek-V4.1 config has 'deepseek_v41'"),
])
def test_bad_configs_are_named(raw, match):
    with pytest.raises(ConfigError, match=match):
        V41Config.from_dict(raw)


def test_the_v4_path_names_v41_instead_of_rejecting_it_blindly():
    with pytest.raises(ConfigError, match="a DeepSeek-V4.1 config, not a V4 one; this path reads V4 "
                                          "configs only"):
        ModelConfig.from_dict(HF)


def test_read_config_tells_the_family(tmp_path):
    import json

    from tests.helpers import TINY_A

    for name, raw, kind in (("hf", HF, V41Config), ("inference", INFERENCE, V41Config), ("v4", TINY_A, ModelConfig)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(raw))
        assert type(read_config(tmp_path / name)) is kind
    assert read_config(tmp_path / "hf").max_position_embeddings == 1048576
    with pytest.raises(ConfigError, match="has no config.json"):
        read_config(tmp_path)


def test_dspark_experts_default_to_the_backbones():
    """0 or absent `dspark_n_routed_experts` / `dspark_n_activated_experts`: the backbone's (the reference's
    get_moe_config)."""
    raw = {k: v for k, v in INFERENCE.items() if k != "dspark_n_activated_experts"}
    cfg = V41Config.from_dict(dict(raw, dspark_n_routed_experts=0))
    assert (cfg.dspark.n_routed_experts, cfg.dspark.num_experts_per_tok) == (384, 6)
