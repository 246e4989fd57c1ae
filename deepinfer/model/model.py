"""DeepSeek-V4 forward passes over the paged cache, every op called through an `OpTable`.

Per token: embed, copy into `hc_mult` residual streams; per layer: mHC collapse -> attention -> mHC mix, then
mHC collapse -> MoE (hash or top-k routed, plus the shared expert) -> mHC mix; finally the HyperHead collapse,
the final norm and the LM head. `prefill` runs chunks of one or more sequences eagerly; `decode` runs one
token per sequence with static shapes (what the runtime graph captures).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, Callable

import torch

from deepinfer.runtime.cache import PagedCache, SeqCache
from deepinfer.config import HASH_MOE, SLIDING, ModelConfig
from deepinfer.model.attention import AttentionContext, finish, prefill_core, project
from deepinfer.model.compressor import RopeTables
from deepinfer.model.decode import DecodeInputs, decode_attention
from deepinfer.model.step_rows import StepRows
from deepinfer.model.moe import moe
from deepinfer.model.rollback import check_tentative
from deepinfer.model.rope import inv_freq
from deepinfer.model.hyper_head import HeadAsPre, collapse
from deepinfer.model.weights import HyperConnection, Layer, MoE, ModelWeights
from tilekernels import OpTable

if TYPE_CHECKING:
    from deepinfer.parallel.shard import ModelParallel


class DeepseekV4:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, ops: OpTable, parallel: ModelParallel | None = None,
                 side: Any | None = None):
        """`parallel`: this rank's share (its heads and experts, and the sums over ranks) when the model runs on
        several; `weights` are then that share. `side`: the target's second stream (`Target.side_stream`), on which
        a decode step runs each layer's independent halves (`side_stream.py`); None: one stream."""
        self.cfg, self.weights, self.ops = cfg, weights, ops
        self._attention_sum = parallel.attention_sum if parallel is not None else None
        self.expert_shard = self._experts = parallel.experts if parallel is not None else None
        heads = parallel.attention_cfg if parallel is not None else cfg
        # DSpark drafting reads the input streams of these layers (mean over the mHC copies), concatenated
        self.taps = cfg.dspark.target_layer_ids if weights.dspark is not None else ()
        device = weights.embed.device
        self.side = side
        self.main_rope = main = RopeTables(inv_freq(cfg.rope_main, cfg.rope_head_dim).to(device),
                                           cfg.rope_main.attention_factor)  # sliding layers' (and the MTP layer's)
        comp = RopeTables(inv_freq(cfg.rope_compress, cfg.rope_head_dim).to(device), cfg.rope_compress.attention_factor)
        self._attn_ctx = [
            AttentionContext(heads, ops, i, main if kind == SLIDING else comp, comp)
            for i, kind in enumerate(cfg.layer_types)
        ]
        # every HyperHead (the target's, the MTP layers', DSpark's) laid out once as a pre-block's (`hyper_head`)
        hcs = [weights.hc_head, *(m.hc_head for m in weights.mtp)]
        if weights.dspark is not None:
            hcs.append(weights.dspark.hc_head)
        self._heads = {id(hc): HeadAsPre.of(hc) for hc in hcs}

    def collapse_head(self, streams: torch.Tensor, hc: HyperConnection, norm: torch.Tensor | None = None) -> torch.Tensor:
        """The HyperHead collapse of `hc` (one of the model's heads) [T, N, H] -> [T, H]; `norm`: RMS-normalized with
        that weight (the head's final norm) in the same kernel."""
        cfg = self.cfg
        return collapse(self.ops, streams, self._heads[id(hc)], cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps,
                        norm)

    @property
    def device(self) -> torch.device:
        return self.weights.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.weights.embed.dtype

    @torch.inference_mode()
    def prefill(self, cache: PagedCache, ids: torch.Tensor, positions: torch.Tensor,
                seqs: list[tuple[SeqCache, int, int]], logit_rows: torch.Tensor | None = None,
                hidden: bool = False, tentative: bool = False):
        """Chunks of sequences: `seqs` lists (sequence, first row, rows) of the flat `ids`/`positions`; each chunk
        continues its sequence (its first position is the sequence's token count). Returns fp32 logits of
        `logit_rows` (every row when None), and with `hidden` also every row's final residual streams [N, hc, H]
        (what the MTP draft layer reads). Advances each sequence's token count.

        `tentative` (verifying draft tokens): the chunks' sequences may keep fewer positions than they wrote
        (`model.rollback.commit`); each chunk then writes at most the cache's lookahead past its first row."""
        for seq, start, length in seqs if not positions.is_meta else ():  # a meta trace has no values to check
            if int(positions[start]) != seq.num_tokens:
                raise AssertionError(f"chunk starts at {int(positions[start])} but the sequence holds {seq.num_tokens}")
            if tentative:
                check_tentative(length, cache.spec.lookahead)

        rotated = positions.to(torch.int32)  # the RoPE kernels' position type, converted once per step

        def attend(layer: int, x: torch.Tensor) -> torch.Tensor:
            ctx, w = self._attn_ctx[layer], self.weights.layers[layer].attn
            p = project(ctx, w, x, rotated)
            return self._gathered(finish(ctx, w, prefill_core(ctx, w, p, positions, seqs, cache.layers[layer]), rotated))

        taps = [] if hidden else None
        streams = self.blocks(ids, attend, taps)
        logits = self.head(streams, logit_rows)
        for seq, _, length in seqs:
            seq.num_tokens += length
        return (logits, self._for_drafter(streams, taps)) if hidden else logits

    @torch.inference_mode()
    def decode(self, cache: PagedCache, inp: DecodeInputs, hidden: bool = False):
        """One token per row (static shapes; the caller advances token counts). Returns fp32 logits [B, V] (and with
        `hidden` what the drafter reads of the rows, as `prefill`'s). Rows of one sequence at consecutive positions (a
        verify step's) write their state before any row reads it, so each sees the rows before it."""

        rows = StepRows(inp.positions, inp.slots, inp.blocks, inp.rows, inp.kept)  # the layers' shared cache rows
        rotated = rows.get(("rotated",), lambda: inp.positions.to(torch.int32))  # the RoPE kernels' position type

        def attend(layer: int, x: torch.Tensor) -> torch.Tensor:
            ctx, w = self._attn_ctx[layer], self.weights.layers[layer].attn
            out = decode_attention(ctx, w, x, rotated, cache.layers[layer], rows, self.side)
            return self._gathered(finish(ctx, w, out, rotated))

        taps = [] if hidden else None
        # the last layer's mHC post-block and the HyperHead's pre-block in one `hc_mid`: every row gets logits
        head = (self._heads[id(self.weights.hc_head)], self.weights.norm)
        streams, normed = self.blocks(inp.ids, attend, taps, self.side, head)
        logits = self.logits(normed)
        return (logits, self._for_drafter(streams, taps)) if hidden else logits

    @staticmethod
    def _for_drafter(streams: torch.Tensor, taps: list[torch.Tensor]) -> torch.Tensor:
        """What the drafter reads of the rows: DSpark's tapped streams concatenated, else the final streams."""
        return torch.cat(taps, dim=-1) if taps else streams

    def _gathered(self, attention: torch.Tensor) -> torch.Tensor:
        """The attention output summed over the tensor-parallel ranks' heads (as is on one rank)."""
        return attention if self._attention_sum is None else self._attention_sum(attention)

    @torch.inference_mode()
    def idle(self) -> None:
        """A forward pass without tokens: every layer's expert exchange with the other ranks (a data-parallel rank
        with nothing to run while others step, under expert parallelism)."""
        cfg = self.cfg
        self._experts.idle(cfg.num_hidden_layers, cfg.hidden_size, cfg.num_experts_per_tok, cfg.swiglu_limit,
                           self.weights.embed.dtype)

    def blocks(self, ids: torch.Tensor, attend: Callable[[int, torch.Tensor], torch.Tensor],
               taps: list[torch.Tensor] | None = None, side: Any | None = None,
               head: tuple[HeadAsPre, torch.Tensor] | None = None) -> Any:
        """Embed, then every layer: the final residual streams [N, hc, H]. `taps` (DSpark): gets the input streams
        of the layers of `self.taps`, each averaged over the mHC copies [N, H], in layer order. `side`: the MoE's
        shared expert runs on it. `head`: a HyperHead laid out as a pre-block (`hyper_head.py`) and its final norm, run
        with the last layer's post-block -> (streams, the head's normalized collapse [N, H])."""
        cfg, layers = self.cfg, self.weights.layers
        emb = self.ops.embedding(ids, self.weights.embed)  # hc copies side by side (cat: a vectorized copy)
        streams = torch.cat([emb] * cfg.hc_mult, dim=1).view(emb.shape[0], cfg.hc_mult, -1)
        mixes = None
        for i, layer in enumerate(layers):
            if taps is not None and i in self.taps:
                taps.append(streams.mean(dim=1))
            ffn = partial(self._moe, i, layer.moe, input_ids=ids, side=side)
            if i + 1 == len(layers) and head is None:
                return self.block(layer, streams, partial(attend, i), ffn, mixes)
            if i + 1 == len(layers):
                streams, (_, _, normed) = self.block(layer, streams, partial(attend, i), ffn, mixes, head)
                return streams, normed
            following = (layers[i + 1].attn_hc, layers[i + 1].input_norm)
            streams, mixes = self.block(layer, streams, partial(attend, i), ffn, mixes, following)
        return streams

    def block(self, layer: Layer, streams: torch.Tensor, attend: Callable[[torch.Tensor], torch.Tensor],
              ffn: Callable[[torch.Tensor], torch.Tensor], mixes: tuple | None = None,
              following: tuple[HyperConnection | HeadAsPre, torch.Tensor] | None = None) -> Any:
        """One V4 block on the residual streams: mHC collapse -> norm -> attention -> mHC mix, mHC collapse -> norm ->
        FFN -> mHC mix; each collapse with its norm in one kernel, each mix and the next collapse in one `hc_mid`
        (decode rows: one kernel less). `mixes`: this block's first pre-block (post, comb, normalized collapse) when
        the previous block computed it; `following`: the next sublayer's mHC and input norm (the next block's
        attention, or a HyperHead and its final norm), whose pre-block then runs with this block's last mix ->
        (streams, its mixes); without it -> streams."""
        cfg, ops = self.cfg, self.ops
        args = (cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        hc = layer.attn_hc
        post, comb, x = mixes or ops.hc_pre(streams, hc.fn, hc.base, hc.scale, *args, layer.input_norm)
        out = attend(x)
        hc = layer.ffn_hc
        streams, post, comb, x = ops.hc_mid(streams, out, post, comb, hc.fn, hc.base, hc.scale, *args,
                                            layer.post_attention_norm)
        out = ffn(x)
        if following is None:
            return ops.hc_post(streams, out, post, comb)
        hc, norm = following
        streams, *mixes = ops.hc_mid(streams, out, post, comb, hc.fn, hc.base, hc.scale, *args, norm)
        return streams, tuple(mixes)

    def head(self, streams: torch.Tensor, logit_rows: torch.Tensor | None, hc: HyperConnection | None = None,
             norm: torch.Tensor | None = None) -> torch.Tensor:
        """The HyperHead collapse, the final norm and the LM head of `logit_rows` (every row when None): fp32
        logits. `hc`/`norm`: another head's collapse and norm (an MTP layer's) before the shared LM head."""
        cfg, w = self.cfg, self.weights
        hc, norm = hc or w.hc_head, w.norm if norm is None else norm
        if logit_rows is not None:
            streams = streams[logit_rows]
            if streams.shape[0] == 0:  # a prefill step that ends no prompt: no head (a kernel takes no empty grid)
                return streams.new_zeros((0, cfg.vocab_size), dtype=torch.float32)
        return self.logits(self.collapse_head(streams, hc, norm))

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The LM head of a HyperHead's normalized collapse [T, H] -> fp32 logits."""
        return self.ops.linear(normed, self.weights.lm_head).float()

    def _moe(self, layer: int, w: MoE, x: torch.Tensor, input_ids: torch.Tensor,
             side: Any | None = None) -> torch.Tensor:
        cfg = self.cfg
        hashed = cfg.mlp_layer_types[layer] == HASH_MOE
        experts = None if self._experts is None else partial(self._experts, layer, input_ids)
        return moe(self.ops, w, x, cfg.num_experts_per_tok, cfg.scoring_func, cfg.routed_scaling_factor,
                   cfg.swiglu_limit, input_ids if hashed else None, experts, side)
