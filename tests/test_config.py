"""config.json parsing: the real V4-Flash config, legacy keys, RoPE, and bad values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deepinfer.config import CSA, HCA, SLIDING, ModelConfig
from deepinfer.env import Env
from deepinfer.errors import ConfigError
from deepinfer.model.rope import inv_freq
from tests.helpers import TINY_B, hf_config

FLASH = Path(__file__).resolve().parents[1] / "benchmarks" / "configs" / "v4-flash.json"


def flash() -> dict:
    return json.loads(FLASH.read_text())


def test_v4_flash_config_yields_its_real_shapes():
    cfg = ModelConfig.from_dict(flash())
    assert cfg.layer_types[:2] == (SLIDING, SLIDING)
    assert cfg.layer_types.count(CSA) == 21 and cfg.layer_types.count(HCA) == 20 and len(cfg.layer_types) == 43
    assert cfg.mlp_layer_types[:4] == ("hash_moe",) * 3 + ("moe",)
    assert cfg.rope_head_dim == 64 and cfg.group_in_dim == 4096
    assert cfg.rope_compress.rope_type == "yarn" and cfg.rope_compress.factor == 16
    assert cfg.rope_compress.attention_factor == 1.0 and cfg.rope_main.rope_type == "default"
    assert cfg.eos_token_ids == (1,) and cfg.max_position_embeddings == 1048576


@pytest.mark.parametrize("raw", [flash(), TINY_B], ids=["flash", "tiny-b"])
def test_layer_schedule_and_rope_match_hf(raw):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    hf = hf_config(raw)
    cfg = ModelConfig.from_dict(raw)
    assert list(cfg.layer_types) == hf.layer_types and list(cfg.mlp_layer_types) == hf.mlp_layer_types
    rot = DeepseekV4RotaryEmbedding(hf)
    assert torch.equal(inv_freq(cfg.rope_main, cfg.rope_head_dim), rot.main_inv_freq)
    assert torch.equal(inv_freq(cfg.rope_compress, cfg.rope_head_dim), rot.compress_inv_freq)
    assert cfg.rope_compress.attention_factor == rot.compress_attention_scaling


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_key_value_heads": 8}, "num_key_value_heads must be 1"),
        ({"scoring_func": "softmax"}, "scoring_func 'softmax' is not supported"),
        ({"hidden_size": "4096"}, "hidden_size must be an integer"),
        ({"rope_scaling": {"type": "longrope"}}, "RoPE type 'longrope' is not supported"),
        ({"o_groups": 7}, "divisible by o_groups"),
        ({"num_hidden_layers": 50}, "layer_types has 44 entries but num_hidden_layers is 50"),
    ],
)
def test_bad_config_values_are_named(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict({**flash(), **change})


def test_env_accelerator_is_validated():
    assert Env.read({"DEEPINFER_ACCELERATOR": "ascend"}).accelerator == "ascend"
    assert Env.read({}).accelerator is None
    with pytest.raises(ConfigError, match="DEEPINFER_ACCELERATOR='tpu'.*cpu, nvidia, ascend"):
        Env.read({"DEEPINFER_ACCELERATOR": "tpu"})


def test_env_second_stream_is_validated():
    assert Env.read({}).second_stream and not Env.read({"DEEPINFER_SECOND_STREAM": "off"}).second_stream
    with pytest.raises(ConfigError, match="DEEPINFER_SECOND_STREAM='2' is not valid; accepted: 0, 1, false, true"):
        Env.read({"DEEPINFER_SECOND_STREAM": "2"})


def test_env_parallel_graphs_is_validated():
    assert not Env.read({}).parallel_graphs and Env.read({"DEEPINFER_PARALLEL_GRAPHS": "1"}).parallel_graphs
    with pytest.raises(ConfigError, match="DEEPINFER_PARALLEL_GRAPHS='yes' is not valid; accepted: 0, 1, false, true"):
        Env.read({"DEEPINFER_PARALLEL_GRAPHS": "yes"})
