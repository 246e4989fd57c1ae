"""The per-sequence state of the V4.1 CPU reference path: dense tensors per cache slot (the paged cache for
V4.1 is later work).

- every layer: its sliding-window ring of K=V rows (post-RoPE, FP8-rounded), slot `pos % window`;
- kv-source layers: their compressed latents (post-RoPE, FP4-rounded), read by every layer that shares them,
  and for ratio > 1 the projected kv and gate score of the group still filling (fp32);
- key owners (kv and index sources): their index keys (post-RoPE, FP4-rounded);
- the Engram token classes of every position (the n-gram history).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.config_v41 import V41Config
from deepinfer.errors import ConfigError


@dataclass
class CompressState:
    latents: torch.Tensor  # [slots, ceil(max_len / ratio), head_dim]
    keys: torch.Tensor | None  # [slots, max_len // ratio, index_head_dim]
    partial_kv: torch.Tensor | None  # [slots, ratio, head_dim] fp32
    partial_score: torch.Tensor | None


@dataclass
class V41Cache:
    cfg: V41Config
    max_len: int
    windows: list[torch.Tensor]  # per layer [slots, window, head_dim]
    compressed: dict[int, CompressState]  # by kv-source layer
    classes: torch.Tensor  # [slots, max_len] int64 Engram classes
    num_tokens: list[int] = field(default_factory=list)

    @classmethod
    def empty(cls, cfg: V41Config, slots: int, max_len: int, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> V41Cache:
        if slots < 1 or max_len < 1:
            raise ConfigError(f"a V4.1 cache needs slots >= 1 and max_len >= 1, got {slots} and {max_len}")
        d = cfg.head_dim
        windows = [torch.zeros(slots, cfg.sliding_window, d, dtype=dtype, device=device)
                   for _ in range(cfg.num_hidden_layers)]
        compressed = {}
        for src in cfg.kv_source_layers:
            r = cfg.compress_ratios[src]
            owns_keys = src in cfg.index_source_layers
            partial = r > 1
            groups = -(-max_len // r)  # a last, open group too: a decode step writes its placeholder (v41_decode)
            compressed[src] = CompressState(
                torch.zeros(slots, groups, d, dtype=dtype, device=device),
                torch.zeros(slots, groups, cfg.index_head_dim, dtype=dtype, device=device) if owns_keys else None,
                torch.zeros(slots, r, d, device=device) if partial else None,
                torch.zeros(slots, r, d, device=device) if partial else None,
            )
        classes = torch.zeros(slots, max_len, dtype=torch.int64, device=device)
        return cls(cfg, max_len, windows, compressed, classes, [0] * slots)

    def check_room(self, slot: int, new_tokens: int) -> None:
        if not 0 <= slot < len(self.num_tokens):
            raise ValueError(f"cache slot {slot} is outside [0, {len(self.num_tokens) - 1}]")
        if self.num_tokens[slot] + new_tokens > self.max_len:
            raise ValueError(f"slot {slot} holds {self.num_tokens[slot]} tokens; {new_tokens} more exceed the cache's "
                             f"max_len {self.max_len}")
