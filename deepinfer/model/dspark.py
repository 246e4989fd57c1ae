"""DSpark block drafting over the paged cache (`config_dspark.DSparkConfig`, `model/dspark_weights.py`), as in
DeepSeek's reference (`DSparkBlock` of the V4.1 inference code), on V4 blocks.

Context: each draft block keeps a window ring per slot (`PagedCache.draft_layers`) of the KV of the target's
kept positions: `main = main_norm(main_proj(taps))`, where `taps` are the input streams of the target layers
`dspark_target_layer_ids`, averaged over the mHC copies and concatenated (`DeepseekV4.prefill/decode` with
`hidden`), then per block `rope(kv_norm(kv_proj(main)))` at the position. Only the target's rows are written,
so a rejected draft leaves nothing to roll back.

A draft pass: the block `[anchor, noise x (block_size - 1)]` (the anchor is the newest token, at position n,
not yet run through the target) at positions n .. n + block_size - 1 goes through every draft block: queries
see the window (positions n - W .. n - 1), every row of the block (bidirectional) and the sink; then the last
block's HyperHead collapse, its norm and the target's LM head give base logits per row. Token i + 1 is drawn
from row i's logits plus the Markov head's bias for token i (`markov_head(markov_embed[t_i])`), in order; the
confidence of draft i is `sigmoid(confidence . [collapsed row i ; markov_embed[t_i]])` (fp32), the drafter's
estimate that draft i is accepted when the ones before it were.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from deepinfer.model.attention import AttentionContext, finish, project
from deepinfer.model.moe import moe
from deepinfer.runtime.cache import PagedCache, SeqCache

if TYPE_CHECKING:
    from deepinfer.model.model import DeepseekV4

Chunks = list[tuple[SeqCache, int, int]]


def kept_rows(seqs: Chunks, window: int) -> tuple[list[int], list[int]]:
    """The rows of `seqs` (draft share, first row, rows) a drafter's window rings keep (each chunk's last `window`)
    and their slots; advances the shares' counts by every row."""
    rows, slots = [], []
    for share, first, n in seqs:
        keep = range(first + max(0, n - window), first + n)
        rows.extend(keep)
        slots.extend([share.slot] * len(keep))
        share.num_tokens += n
    return rows, slots


def pass_index(positions: torch.Tensor, starts: torch.Tensor, window: int, block: int) -> tuple[torch.Tensor, ...]:
    """A block pass's pool rows for R requests whose anchors sit at `positions` [R], each ring holding positions
    from `starts` [R]: every request's pool is its W window rows then its block's rows. -> (the window positions
    [R, W], each row's pool row list [R * block, W + block], -1 where the ring holds no position)."""
    r, device = positions.shape[0], positions.device
    held = positions.view(r, 1) + torch.arange(-window, 0, device=device)
    base = torch.arange(r, device=device).view(r, 1) * (window + block)
    listed = torch.cat([torch.where(held >= starts.view(r, 1), base + torch.arange(window, device=device), -1),
                        base + window + torch.arange(block, device=device)], dim=1)
    return held, listed.repeat_interleave(block, dim=0)  # every row of its request


class BlockDrafter:
    """What DSpark's drafters share (V4's below, V4.1's in `model/v41_dspark.py`): the kept rows' main hidden
    (`_main`), a pass per request from its `block` and the Markov head's drafts (`markov`)."""

    def _main(self, taps: torch.Tensor, positions: torch.Tensor, seqs: Chunks):
        """The rows of `seqs` the window rings keep (`kept_rows`, which advances the shares' counts): (their
        `main_norm(main_proj(taps))`, positions, slots), or None when no row is kept."""
        cfg, ops, w = self.model.cfg, self.model.ops, self.w
        rows, slots = kept_rows(seqs, cfg.sliding_window)
        if not rows:
            return None
        device = taps.device
        picked = torch.tensor(rows, device=device)
        main = ops.rms_norm(ops.linear(taps[picked], w.main_proj), w.main_norm, cfg.rms_norm_eps)
        return main, positions[picked], torch.tensor(slots, device=device)

    @torch.inference_mode()
    def draft(self, cache, anchors: torch.Tensor, positions: torch.Tensor, shares: list[SeqCache],
              choose: Callable[[torch.Tensor, int], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass per request: `anchors` [R] (the newest tokens) at `positions` [R], each share holding the
        positions before. `choose(logits [R, V], i)` picks draft i from its corrected logits. Returns the drafts
        [R, block_size] and their confidences [R, block_size] (fp32)."""
        device = anchors.device
        slots = torch.tensor([s.slot for s in shares], device=device)
        starts = torch.tensor([s.window_start for s in shares], device=device)
        return self.markov(*self.block(cache, anchors, positions, slots, starts), anchors, choose)

    def markov(self, logits: torch.Tensor, collapsed: torch.Tensor, anchors: torch.Tensor,
               choose: Callable[[torch.Tensor, int], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafts in order from `block`'s outputs and their confidences (`markov_drafts`)."""
        w = self.w
        return markov_drafts(self.model.ops, w.markov_embed, w.markov_head, w.confidence, logits, collapsed, anchors,
                             choose)


class DSparkDrafter(BlockDrafter):
    """The DSpark drafter of a `DeepseekV4` loaded with `weights.dspark`."""

    def __init__(self, model: DeepseekV4):
        if model.weights.dspark is None:
            raise ValueError("the model has no DSpark drafter loaded (ModelWeights.dspark is None)")
        cfg = model.cfg
        self.model, self.w, self.ds = model, model.weights.dspark, cfg.dspark
        self.ctx = AttentionContext(cfg, model.ops, cfg.num_hidden_layers, model.main_rope, model.main_rope)

    @torch.inference_mode()
    def read(self, cache: PagedCache, taps: torch.Tensor, positions: torch.Tensor, seqs: Chunks) -> None:
        """Rows the target kept: `taps` [N, taps * H] at `positions` [N]; `seqs` lists (draft share, first row,
        rows), each chunk continuing its share's count. Writes the last `sliding_window` rows of each chunk into
        every block's window ring (earlier ones would be overwritten); advances the counts."""
        ops, w, eps = self.model.ops, self.w, self.model.cfg.rms_norm_eps
        kept = self._main(taps, positions, seqs)
        if kept is None:
            return
        main, pos, slot = kept
        rotated, rope = pos.to(torch.int32), self.ctx.rope
        for block, layer in zip(w.blocks, cache.draft_layers):
            kv = ops.rms_norm(ops.linear(main, block.attn.kv_proj), block.attn.kv_norm, eps)
            kv = ops.rope(kv, rotated, rope.inv_freq, rope.attention_factor)
            layer.pool[layer.layout.window_rows(slot, pos)] = kv.to(layer.pool.dtype)

    def block(self, cache: PagedCache, anchors: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
              starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block pass of R requests (static shapes, no host reads: `runtime/draft_graphs.py` captures it):
        anchors, positions, their slots and the first position each window ring holds, [R] each. Returns the
        base logits [R, block_size, V] (the model's dtype: a captured bucket keeps them) and the collapsed rows
        [R, block_size, H]."""
        model, cfg, ops, w, ds = self.model, self.model.cfg, self.model.ops, self.w, self.ds
        r, b, win, device = anchors.shape[0], ds.block_size, cfg.sliding_window, anchors.device
        ids = torch.full((r, b), ds.noise_token_id, dtype=torch.long, device=device)
        ids[:, 0] = anchors
        rotated = (positions.view(r, 1) + torch.arange(b, device=device)).view(-1).to(torch.int32)
        window, listed = pass_index(positions, starts, win, b)
        listed = listed.to(torch.int32)

        def attention(block, layer) -> Callable[[torch.Tensor], torch.Tensor]:
            ring = layer.pool[layer.layout.window_rows(slots.view(r, 1), window.clamp(min=0))]  # [R, W, D]

            def attend(h: torch.Tensor) -> torch.Tensor:
                p = project(self.ctx, block.attn, h, rotated)
                pool = torch.cat([ring.to(p.kv.dtype), p.kv.view(r, b, -1)], dim=1).view(r * (win + b), -1)
                out = ops.sparse_attention(p.q, pool, listed, block.attn.sinks, cfg.head_dim**-0.5)
                return finish(self.ctx, block.attn, out, rotated)
            return attend

        def ffn(block) -> Callable[[torch.Tensor], torch.Tensor]:
            return lambda h: moe(ops, block.moe, h, ds.num_experts_per_tok, cfg.scoring_func,
                                 cfg.routed_scaling_factor, cfg.swiglu_limit)

        streams = ops.embedding(ids.view(-1), model.weights.embed).unsqueeze(1).expand(-1, cfg.hc_mult, -1)
        streams = streams.contiguous()
        for block, layer in zip(w.blocks, cache.draft_layers):
            streams = model.block(block, streams, attention(block, layer), ffn(block))
        collapsed = model.collapse_head(streams, w.hc_head)  # [R * b, H]
        logits = ops.linear(ops.rms_norm(collapsed, w.norm, cfg.rms_norm_eps), model.weights.lm_head)
        return logits.view(r, b, -1), collapsed.view(r, b, -1)

def markov_drafts(ops, embed_table: torch.Tensor, head: torch.Tensor, confidence: torch.Tensor, logits: torch.Tensor,
                  collapsed: torch.Tensor, anchors: torch.Tensor,
                  choose: Callable[[torch.Tensor, int], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """DSpark's heads over a block pass (V4 and V4.1): draft i from base logits row i [R, b, V] plus the Markov
    head's bias for the token before it (the anchor for the first), picked by `choose`; each draft's confidence
    `sigmoid(confidence . [collapsed row i ; markov_embed[t_i]])` in fp32 -> drafts [R, b], confidences [R, b]."""
    tokens, embeds, prev = [], [], anchors
    for i in range(logits.shape[1]):
        embed = ops.embedding(prev, embed_table)
        prev = choose(logits[:, i].float() + ops.linear(embed, head).float(), i)
        tokens.append(prev)
        embeds.append(embed)
    features = torch.cat([collapsed, torch.stack(embeds, dim=1)], dim=-1).float()
    return torch.stack(tokens, dim=1), torch.sigmoid(features @ confidence.float().view(-1))
