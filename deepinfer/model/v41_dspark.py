"""DSpark block drafting for DeepSeek-V4.1 (`V41Weights.dspark`), as DeepSeek's reference (`DSparkAttention`,
`DSparkBlock` and `Transformer.forward_spec` of the V4.1 inference code; tools/v41_reference/NOTES.md), over
the V4.1 cache (`V41Cache.drafts`: a window ring per draft block and slot, row `pos % window`).

Context: for every position the target keeps, `main = main_norm(main_proj(taps))` (the taps: the input streams
of the layers `dspark_target_layer_ids`, after their Engram, averaged over the mHC copies and concatenated:
`DeepseekV41.forward(hidden=True)`), then per block `kv_norm(wkv(main))` rotated at the position with the
ratio-0 RoPE (theta `rope_theta`, no YaRN) and rounded through FP8 (groups of 32, as every window K=V) goes into
that block's ring. Only kept rows are written: a rejected draft leaves nothing to undo.

A draft pass: the block `[anchor, noise x (block_size - 1)]` (the anchor: the newest token, at position n, not yet
run through the target) at positions n .. n + block_size - 1 goes through the draft blocks, V4.1 blocks (mHC
"single pass": each block's FFN computes the mix that collapses the next block's attention input, starting from
one-hot on copy 0) whose attention is window-only: each row attends to the ring (positions n - W .. n - 1 the
sequence holds), to every row of the block (bidirectional) and to the sink. Then the streams collapse with the
last block's mix, its norm and the target's head give base logits per row; drafts and confidences come from the
Markov and confidence heads as in V4's drafter (`model/dspark.py`: `markov`), the confidence head reading the
collapsed rows before the norm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from deepinfer.model.attention import output_projection
from deepinfer.model.dspark import BlockDrafter, pass_index
from deepinfer.model.v41_attention import WINDOW_FP8_GROUP, fp8_round
from deepinfer.runtime.blocks import SeqCache

if TYPE_CHECKING:
    from deepinfer.model.v41 import DeepseekV41
    from deepinfer.model.v41_cache import V41Cache
    from deepinfer.runtime.v41_steps import V41SlotCache

Chunks = list[tuple[SeqCache, int, int]]


class V41DSparkDrafter(BlockDrafter):
    """The DSpark drafter of a `DeepseekV41` loaded with `weights.dspark`; the same calls as V4's
    (`model/dspark.py`: `draft`, `markov` shared), so the drafts source and its graphs drive either."""

    def __init__(self, model: DeepseekV41):
        if model.weights.dspark is None:
            raise ValueError("the model has no DSpark drafter loaded (V41Weights.dspark is None)")
        self.model, self.w, self.ds = model, model.weights.dspark, model.cfg.dspark

    @torch.inference_mode()
    def read(self, cache: V41Cache | V41SlotCache, taps: torch.Tensor, positions: torch.Tensor, seqs: Chunks) -> None:
        """Rows the target kept: `taps` [N, taps * H] at `positions` [N]; `seqs` lists (draft share, first row,
        rows), each chunk continuing its share's count. Writes the last `sliding_window` rows of each chunk into
        every block's ring (earlier ones would be overwritten); advances the counts."""
        kept = self._main(taps, positions, seqs)
        if kept is None:
            return
        main, pos, slot = kept
        for block, ring in zip(self.w.blocks, cache.drafts):
            ring[slot, pos % ring.shape[1]] = self._kv(block, main, pos).to(ring.dtype)

    def _kv(self, block, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """A block's window K=V of rows x [N, H] at positions [N]: normed, rotated, FP8-rounded."""
        ops, a, rope, eps = self.model.ops, block.attn, self.model.main_rope, self.model.cfg.rms_norm_eps
        kv = ops.rope(ops.rms_norm(ops.linear(x, a.wkv), a.kv_norm, eps), pos, rope.inv_freq, rope.attention_factor)
        return fp8_round(ops, kv, WINDOW_FP8_GROUP)

    def block(self, cache: V41Cache | V41SlotCache, anchors: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
              starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block pass of R requests (static shapes, no host reads: a graph can capture it): anchors, their
        positions, slots and the first position each ring holds, [R] each. Returns the base logits [R, block_size,
        V] (the model's dtype) and the collapsed rows [R, block_size, H] (before the norm)."""
        model, cfg, ops, w, ds = self.model, self.model.cfg, self.model.ops, self.w, self.ds
        r, b, win, device = anchors.shape[0], ds.block_size, cfg.sliding_window, anchors.device
        ids = torch.full((r, b), ds.noise_token_id, dtype=torch.long, device=device)
        ids[:, 0] = anchors
        pos = (positions.view(r, 1) + torch.arange(b, device=device)).view(-1)
        window, listed = pass_index(positions, starts, win, b)
        rope = model.main_rope

        def attention(block, ring: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
            held = ring[slots.view(r, 1), window.clamp(min=0) % ring.shape[1]]  # [R, W, D]

            def attend(x: torch.Tensor) -> torch.Tensor:
                a, n = block.attn, x.shape[0]
                qr = ops.rms_norm(ops.linear(x, a.wq_a), a.q_norm, cfg.rms_norm_eps)
                q = ops.linear(qr, a.wq_b).view(n, cfg.num_attention_heads, cfg.head_dim)
                q = ops.rope(q, pos, rope.inv_freq, rope.attention_factor)
                kv = self._kv(block, x, pos)
                pool = torch.cat([held.to(kv.dtype), kv.view(r, b, -1)], dim=1).view(r * (win + b), -1)
                out = ops.sparse_attention(q, pool, listed, a.sink, cfg.head_dim**-0.5)
                return output_projection(ops, out, pos, rope, cfg.o_groups, a.wo_a, a.wo_b)
            return attend

        h, pre = model.streams(ids.view(-1))
        for block, ring in zip(w.blocks, cache.drafts):
            h, pre = model.block(block, h, pre, attention(block, ring), ds.num_experts_per_tok)
        collapsed = ops.hc_collapse(h, pre)  # [R * b, H]
        normed = ops.rms_norm(collapsed, w.norm, cfg.rms_norm_eps)
        logits = ops.linear(normed.to(model.weights.head.dtype), model.weights.head).to(model.dtype)
        return logits.view(r, b, -1), collapsed.view(r, b, -1)
