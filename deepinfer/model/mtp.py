"""DeepSeek-V4's MTP (nextn) draft layer over the paged cache.

Row i of the layer reads the target's final residual streams at position i and the token at position i + 1:
`x = e_proj(enorm(embed(token))) + h_proj(hnorm(streams))` per stream, then a V4 block (sliding-window attention
over the layer's own window ring, top-k MoE), then its own HyperHead collapse and norm and the target's LM head:
logits for position i + 2. Applied again on its own output streams and the token it drafted, it drafts one
position further (vLLM's way of drafting k > 1 tokens with one MTP layer).

The layer keeps its window KV in `PagedCache.draft_layers` under the slot of its sequence, counted by the
sequence's `draft` share (`SeqCache.draft`): positions whose target streams and next token are known are
read and kept; the drafting chain's rows are tentative (dropped once drafted, `model.rollback`), so the window
holds only what the accepted tokens produced. The draft layer's state affects which tokens are proposed,
never which are accepted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deepinfer.model.attention import AttentionContext, finish, prefill_core, project
from deepinfer.model.moe import moe
from deepinfer.model.rollback import commit
from deepinfer.runtime.cache import PagedCache, SeqCache

if TYPE_CHECKING:
    from deepinfer.model.model import DeepseekV4

Chunks = list[tuple[SeqCache, int, int]]


class MTPDrafter:
    """The first MTP layer of a `DeepseekV4` (V4 checkpoints have one; more are not used for drafting)."""

    def __init__(self, model: DeepseekV4):
        if not model.weights.mtp:
            raise ValueError("the model has no MTP layer loaded (ModelWeights.mtp is empty)")
        cfg, rope = model.cfg, model.main_rope
        self.model, self.w = model, model.weights.mtp[0]
        self.ctx = AttentionContext(cfg, model.ops, cfg.num_hidden_layers, rope, rope)  # sliding: no compressor

    @torch.inference_mode()
    def forward(self, cache: PagedCache, streams: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                seqs: Chunks, logit_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of the draft layer: target (or draft) streams [N, hc, H] at `positions`, the tokens after them
        `next_ids` [N]; `seqs` lists (draft share, first row, rows), each chunk continuing its share's count.
        Returns fp32 logits of `logit_rows` and the layer's output streams [N, hc, H]. Advances the counts."""
        model, w, ops, cfg = self.model, self.w, self.model.ops, self.model.cfg
        eps, n, hc = cfg.rms_norm_eps, streams.shape[0], cfg.hc_mult
        embedded = ops.rms_norm(ops.embedding(next_ids, model.weights.embed), w.enorm, eps)
        normed = ops.rms_norm(streams.reshape(n * hc, -1), w.hnorm, eps)
        x = ops.linear(embedded, w.e_proj).unsqueeze(1) + ops.linear(normed, w.h_proj).view(n, hc, -1)
        rotated = positions.to(torch.int32)
        layer = cache.draft_layers[0]

        def attend(h: torch.Tensor) -> torch.Tensor:
            p = project(self.ctx, w.block.attn, h, rotated)
            return finish(self.ctx, w.block.attn, prefill_core(self.ctx, w.block.attn, p, positions, seqs, layer),
                          rotated)

        def ffn(h: torch.Tensor) -> torch.Tensor:
            return moe(ops, w.block.moe, h, cfg.num_experts_per_tok, cfg.scoring_func, cfg.routed_scaling_factor,
                       cfg.swiglu_limit)

        out = model.block(w.block, x.to(streams.dtype), attend, ffn)
        logits = model.head(out, logit_rows, w.hc_head, w.norm)
        for seq, _, length in seqs:
            seq.num_tokens += length
        return logits, out


def draft_share(seq: SeqCache, start: int) -> SeqCache:
    """The draft layers' share of a sequence's slot at position `start`: the share it has when its count is there,
    else a new one (empty window) starting at `start` (a first prefill, a preemption, a prefix hit)."""
    if seq.draft is None or seq.draft.num_tokens != start:
        seq.draft = SeqCache(slot=seq.slot, num_tokens=start, window_start=start)
    return seq.draft


def rollback_chain(seqs: list[SeqCache], ends: list[int]) -> None:
    """After drafting: each draft share back to the positions its target has kept (`ends`): what the chain wrote
    past them lies in the ring's lookahead rows (`model.rollback`)."""
    for s, end in zip(seqs, ends):
        commit(s, end)
