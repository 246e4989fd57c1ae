"""The embedded default model: a tiny DeepSeek-V4 with random weights, made deterministically.

It has every structural feature of V4 (sliding, CSA and HCA layers; hash and top-k MoE; mHC; sinks; YaRN on
the compressed layers) at toy widths, and the real V4 vocabulary so the real tokenizer's ids are valid.
Its output is meaningless text: it exists so that the engine runs end to end without a checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from deepinfer.config import ModelConfig
from deepinfer.model.weights import FP32, INT, mtp_tensor_specs, tensor_specs

TINY_CONFIG = {
    "model_type": "deepseek_v4",
    "architectures": ["DeepseekV4ForCausalLM"],
    "vocab_size": 129280,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 64,
    "o_groups": 2,
    "o_lora_rank": 32,
    "sliding_window": 128,
    "compress_ratios": [0, 4, 128, 4],
    "num_hash_layers": 2,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "index_n_heads": 8,
    "index_head_dim": 32,
    "index_topk": 16,
    "hc_mult": 4,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 65536,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "float32",
}


def tiny_config() -> ModelConfig:
    return ModelConfig.from_dict(TINY_CONFIG, source="tiny default model")


def random_tensors(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Deterministic random weights for every tensor of `cfg` (canonical names), generated on `device`: the
    target's, then its MTP draft layers' (when the config has them; the target's values are the same either way)."""
    return dict(iter_random_tensors(cfg, seed, dtype, device))


def iter_random_tensors(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu",
                        rows: Callable[[str], int | None] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """`random_tensors` one (name, tensor) at a time, the same values in the same order: a consumer that converts
    each tensor (the quantized slice on an 80 GB GPU) never holds the whole set in full precision. `rows(name)`:
    a first dimension to make instead of the tensor's own (None: its own; a rank of several GPUs makes only its
    slots' experts; the values then differ from the whole model's)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, spec in {**tensor_specs(cfg), **mtp_tensor_specs(cfg)}.items():
        shape = spec.shape if rows is None or rows(name) is None else (rows(name), *spec.shape[1:])
        if spec.kind == INT:
            yield name, torch.randint(0, cfg.n_routed_experts, shape, generator=gen, device=device)
            continue
        leaf = name.rsplit(".", 1)[-1] if not name.endswith(".weight") else name.rsplit(".", 2)[-2]
        target = torch.float32 if spec.kind == FP32 else dtype
        t = torch.randn(shape, generator=gen, device=device, dtype=target)
        if spec.kind == FP32 and (name.endswith("norm.weight") or leaf in ("input_layernorm", "post_attention_layernorm")):
            t = 1.0 + 0.1 * t
        elif leaf in ("scale", "hc_scale"):
            t = 1.0 + 0.1 * t
        elif leaf in ("sinks", "position_bias", "base", "hc_base", "e_score_correction_bias"):
            t = 0.5 * t
        else:
            t = 0.02 * t
        yield name, t
        del t  # before the next one is made: a consumer that dropped it holds no second full-precision tensor
