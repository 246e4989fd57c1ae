"""DSpark block drafting's config (`dspark_*` keys of a V4 or V4.1 `config.json`; docs/speculative.md).

A checkpoint with DSpark carries `num_nextn_predict_layers` draft blocks under `mtp.{j}.*` (sliding-window-only
V4 blocks with their own experts), the projection of the target's tapped hidden states (`mtp.0.main_proj`,
`main_norm`) and, on the last block, the final norm, the Markov head and the confidence head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepinfer.errors import ConfigError


@dataclass(frozen=True)
class DSparkConfig:
    block_size: int  # draft tokens per block (gamma): one pass drafts them all
    noise_token_id: int  # the token filling the block after its first (the last accepted) token
    target_layer_ids: tuple[int, ...]  # target layers whose input streams (mean over the mHC copies) it reads
    markov_rank: int  # the Markov head's rank (V x rank embedding, rank -> V head)
    n_routed_experts: int  # the draft blocks' experts
    num_experts_per_tok: int


def dspark_from_hf(raw: dict[str, Any], layers: int, drafts: int, experts: int, top_k: int, vocab: int,
                   source: str) -> DSparkConfig | None:
    """The DSpark config of a V4 HF `config.json` (None without `dspark_block_size`). `layers`: the target's
    layers; `drafts`: `num_nextn_predict_layers` (the draft blocks); `experts`/`top_k`: the target's, the
    defaults of `dspark_n_routed_experts` / `dspark_num_experts_per_tok`."""
    def number(key: str, default: Any = None, minimum: int = 0) -> int:
        value = raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"{source}: {key} must be an integer >= {minimum}, got {value!r}")
        return value

    if raw.get("dspark_block_size") in (None, 0):
        return None
    block = number("dspark_block_size", minimum=1)
    if drafts < 1:
        raise ConfigError(f"{source}: dspark_block_size {block} needs its draft blocks: num_nextn_predict_layers "
                          f"must be >= 1 (the mtp.* blocks), got {drafts}")
    targets = raw.get("dspark_target_layer_ids")
    if (not isinstance(targets, (list, tuple)) or not targets
            or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < layers for t in targets)
            or list(targets) != sorted(set(targets))):
        raise ConfigError(f"{source}: dspark_target_layer_ids must list target layers in [0, {layers}), increasing "
                          f"(the tapped streams are read in layer order), got {targets!r}")
    noise = number("dspark_noise_token_id")
    if noise >= vocab:
        raise ConfigError(f"{source}: dspark_noise_token_id {noise} is not a token id (vocab_size {vocab})")
    n_experts = number("dspark_n_routed_experts", experts, minimum=1)
    k = number("dspark_num_experts_per_tok", top_k, minimum=1)
    if k > n_experts:
        raise ConfigError(f"{source}: dspark_num_experts_per_tok {k} exceeds dspark_n_routed_experts {n_experts}")
    return DSparkConfig(block, noise, tuple(targets), number("dspark_markov_rank", 256, minimum=1), n_experts, k)
