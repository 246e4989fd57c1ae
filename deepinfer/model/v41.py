"""DeepSeek-V4.1 text model on the CPU reference path, every op called through an `OpTable`.

Per token: embed, copy into `hc_mult` residual streams, and start from a one-hot pre mix on copy 0. Per layer:
the Engram lookup (its layers only) is added to the copies, then mHC "single pass": the attention input is the
copies collapsed with the pre mix the previous layer's FFN computed; the FFN input with the pre mix this layer's
attention computed (from the copies before attention); each sublayer's post/comb mixes expand its output back.
The final collapse uses the last FFN's pre mix (no HyperHead), then the final norm and the LM head.

One `forward` runs chunks of one or more sequences (`Chunk`: rows of the flat batch continuing a sequence at
its token count): a prefill is one chunk (or several: chunked prefill), a decode step is one one-token chunk
per sequence. Routing is V4.1's: top-k on sqrtsoftplus + bias for every layer (no hash routing).
"""

from __future__ import annotations

import itertools
import math
from functools import partial

import torch

from deepinfer.config_v41 import V41Config
from deepinfer.errors import ConfigError
from deepinfer.model.compressor import RopeTables
from deepinfer.model.engram_hash import DEAD, EngramHasher
from deepinfer.model.moe import moe
from deepinfer.model.rope import inv_freq
from deepinfer.model.v41_attention import LayerContext, attention
from deepinfer.model.v41_cache import V41Cache
from deepinfer.model.v41_compress import Chunk, Published
from deepinfer.model.v41_decode import DecodeBatch
from deepinfer.model.v41_weights import Engram41, Layer41, V41Weights
from tilekernels import OpTable

ENGRAM_DTYPE = torch.bfloat16  # the reference feeds the Engram projection bf16 rows (exact for FP8 tables)


class DeepseekV41:
    def __init__(self, cfg: V41Config, weights: V41Weights, ops: OpTable, hasher: EngramHasher | None,
                 parallel=None):
        """`parallel` (a `deepinfer.parallel.shard.ModelParallel`): this process is one rank of several; `weights`
        hold its attention heads (`parallel.attention_cfg`'s, whose outputs `parallel.attention_sum` adds over the
        tensor-parallel ranks) and, when `parallel.experts` splits the routed experts over the ranks, none of
        those."""
        if cfg.engram is not None:
            if hasher is None:
                raise ConfigError("this V4.1 config has Engram layers: the model needs their n-gram hasher "
                                  "(deepinfer.model.engram_hash.build from the model's tokenizer)")
            want = (len(cfg.engram.layer_ids), cfg.engram.max_ngram)
            classes = int(hasher.classes.max()) + 1
            if tuple(hasher.multipliers.shape) != want or classes != cfg.engram.compressed_vocab_size:
                raise ConfigError(f"the Engram hasher has {classes} token classes and multipliers "
                                  f"{list(hasher.multipliers.shape)}; the config declares "
                                  f"{cfg.engram.compressed_vocab_size} classes and {list(want)}")
            if hasher.table_rows != list(cfg.engram.num_embeddings):
                raise ConfigError(f"the Engram hasher's tables have {hasher.table_rows} rows; the config declares "
                                  f"{list(cfg.engram.num_embeddings)}")
        source = cfg.candidate_source_layer
        mixed = [i for i in cfg.index_source_layers if source is not None and i > source
                 and cfg.compress_ratios[i] != cfg.compress_ratios[source]]
        if mixed:
            raise ConfigError(f"index source layers {mixed} follow candidate source {source} but have another "
                              f"compress ratio: they cannot be restricted to its candidate blocks")
        device = weights.embed.device
        self.cfg, self.weights, self.ops = cfg, weights, ops
        self.hasher = None if hasher is None else hasher.to(device)
        main = RopeTables(inv_freq(cfg.rope_main, cfg.rope_head_dim).to(device), cfg.rope_main.attention_factor)
        comp = RopeTables(inv_freq(cfg.rope_compress, cfg.rope_head_dim).to(device),
                          cfg.rope_compress.attention_factor)
        self.main_rope = main  # ratio-0 layers and the DSpark blocks
        heads = cfg if parallel is None else parallel.attention_cfg  # this rank's heads and output groups
        self._ctx = [LayerContext.build(heads, ops, i, main, comp) for i in range(cfg.num_hidden_layers)]
        self._swiglu_limit = cfg.swiglu_limit if cfg.swiglu_limit > 0 else math.inf  # 0 means no clamp
        self.expert_shard = None if parallel is None else parallel.experts
        self.engram_shard = None if parallel is None else parallel.engram  # the tables split over ranks
        self._attention_sum = None if parallel is None else parallel.attention_sum

    @property
    def dtype(self) -> torch.dtype:
        return self.weights.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.weights.embed.device

    def new_cache(self, slots: int, max_len: int, packed: bool = True) -> V41Cache:
        return V41Cache.empty(self.cfg, slots, max_len, self.dtype, self.weights.embed.device, packed=packed)

    def prefill(self, cache: V41Cache, ids: torch.Tensor, slot: int) -> torch.Tensor:
        """One chunk of one sequence (its first, or a continuation: chunked prefill) -> fp32 logits [S, V] of
        every row."""
        cache.check_room(slot, ids.shape[0])  # names a bad slot before it is indexed
        chunk = Chunk(slot, 0, ids.shape[0], cache.num_tokens[slot])
        return self.forward(cache, ids, [chunk], logit_rows=torch.arange(ids.shape[0]))

    def decode(self, cache: V41Cache, ids: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """One token per sequence -> fp32 logits [B, V]."""
        for slot in slots:
            cache.check_room(slot, 1)
        chunks = [Chunk(slot, i, 1, cache.num_tokens[slot]) for i, slot in enumerate(slots)]
        return self.forward(cache, ids, chunks)

    @torch.inference_mode()
    def forward(self, cache: V41Cache, ids: torch.Tensor, chunks: list[Chunk],
                logit_rows: torch.Tensor | None = None, hidden: bool = False):
        """ids [N] holds every chunk's rows; returns fp32 logits of `logit_rows` (default: each chunk's last row)
        and advances the sequences' token counts. `hidden`: (logits, taps): also every row's input streams of the
        DSpark target layers, mean over the mHC copies, concatenated [N, taps * H] (`_layers`)."""
        slots = [ch.slot for ch in chunks]
        starts = list(itertools.accumulate((ch.length for ch in chunks[:-1]), initial=0))
        if [ch.start for ch in chunks] != starts or sum(ch.length for ch in chunks) != ids.shape[0]:
            raise ValueError(f"chunks (start, length) {[(ch.start, ch.length) for ch in chunks]} must cover the "
                             f"{ids.shape[0]} ids in order")
        if len(set(slots)) != len(slots):
            raise ValueError(f"chunks {slots} name one cache slot twice; one chunk per sequence per forward")
        for ch in chunks:
            if ch.length < 1:
                raise ValueError(f"the chunk of slot {ch.slot} holds {ch.length} tokens; a chunk holds at least one")
            cache.check_room(ch.slot, ch.length)
            if ch.t0 != cache.num_tokens[ch.slot]:
                raise ValueError(f"the chunk of slot {ch.slot} starts at {ch.t0}, but the slot holds "
                                 f"{cache.num_tokens[ch.slot]} tokens")
        pos = torch.cat([torch.arange(ch.t0, ch.t0 + ch.length) for ch in chunks]).to(ids.device)
        if all(ch.length == 1 for ch in chunks):  # a decode step: every sequence at once (`v41_decode`)
            # the indexers score every entry a slot can hold (masked past each sequence's own), as a captured step
            # must: eager and replayed steps launch the same kernels on the same shapes
            step = DecodeBatch(torch.tensor(slots, device=ids.device), pos, cache.max_len - 1)
            out = self.decode_step(cache, ids, step, hidden)
            if logit_rows is not None:
                out = (out[0][logit_rows], out[1]) if hidden else out[logit_rows]
        else:
            out = self._layers(cache, ids, pos, chunks, self._engram_rows(cache, ids, chunks), logit_rows, hidden)
        for ch in chunks:
            cache.num_tokens[ch.slot] += ch.length
        return out

    def decode_step(self, cache: V41Cache, ids: torch.Tensor, step: DecodeBatch, hidden: bool = False):
        """One token per row -> fp32 logits [B, V] (with `hidden`, and the taps: `forward`), tensor work only: no
        checks, no host reads, the token counts untouched (what a decode graph captures; `forward` checks and
        counts). Rows may continue one sequence at consecutive positions (a speculative verify step): each row
        writes its state before any row reads (`v41_decode`), within the cache's lookahead."""
        rows = None if self.hasher is None else self._ngram_rows(cache, ids, step.slot, step.t, 1)
        return self._layers(cache, ids, step.t, step, rows, None, hidden)

    def block(self, layer: Layer41, h: torch.Tensor, pre: torch.Tensor, attend, top_k: int, experts=None):
        """One block with mHC "single pass": h [N, hc, H] streams, `pre` [N, hc] the mix collapsing them for its
        attention (the previous block's FFN computed it), `attend(x)` its attention -> (streams, the mix for the
        next block). `experts`: what runs the routed experts when the ranks split them (`moe`)."""
        cfg, ops = self.cfg, self.ops
        eps, iters, hc_eps = cfg.rms_norm_eps, cfg.hc_sinkhorn_iters, cfg.hc_eps
        hc = layer.attn_hc
        attn_pre, post, comb = ops.hc_mixes(h, hc.fn, hc.base, hc.scale, iters, hc_eps, eps)
        a = ops.rms_norm(ops.hc_collapse(h, pre), layer.attn_norm, eps)
        h = ops.hc_post(h, attend(a), post, comb)
        hc = layer.ffn_hc
        pre, post, comb = ops.hc_mixes(h, hc.fn, hc.base, hc.scale, iters, hc_eps, eps)
        f = ops.rms_norm(ops.hc_collapse(h, attn_pre), layer.ffn_norm, eps)
        f = moe(ops, layer.moe, f, top_k, cfg.scoring_func, cfg.routed_scaling_factor, self._swiglu_limit,
                experts=experts)
        return ops.hc_post(h, f, post, comb), pre

    def _summed(self, attention: torch.Tensor) -> torch.Tensor:
        """The attention output summed over the tensor-parallel ranks' heads (as is on one rank)."""
        return attention if self._attention_sum is None else self._attention_sum(attention)

    def idle(self) -> None:
        """A forward pass without tokens: the Engram rows' exchange (when the ranks split the tables) and every
        layer's expert exchange with the other ranks (a data-parallel rank with nothing to run while others step,
        under expert parallelism)."""
        cfg = self.cfg
        if self.engram_shard is not None:
            e = cfg.engram
            rows = torch.zeros((0, len(e.layer_ids), (e.max_ngram - 1) * e.n_heads), dtype=torch.int64,
                               device=self.device)
            self._engram_values(rows)
        self.expert_shard.idle(cfg.num_hidden_layers, cfg.hidden_size, cfg.num_experts_per_tok, self._swiglu_limit,
                               self.dtype)

    def streams(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Embedded ids [N] as hc_mult copies [N, hc, H] and the starting pre mix (one-hot on copy 0)."""
        x = self.ops.embedding(ids, self.weights.embed)
        pre = torch.zeros(x.shape[0], self.cfg.hc_mult, dtype=torch.float32, device=x.device)
        pre[:, 0] = 1.0
        return x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous(), pre

    def _layers(self, cache: V41Cache, ids: torch.Tensor, pos: torch.Tensor, chunks: list[Chunk] | DecodeBatch,
                engram_rows: torch.Tensor | None, logit_rows: torch.Tensor | None, hidden: bool = False):
        cfg, w = self.cfg, self.weights
        h, pre = self.streams(ids)
        shared = Published()
        targets = cfg.dspark.target_layer_ids if hidden and cfg.dspark is not None else ()
        taps = []
        looked = None if self.engram_shard is None or engram_rows is None else self._engram_values(engram_rows)
        for i, layer in enumerate(w.layers):
            if layer.engram is not None:
                k = cfg.engram.layer_ids.index(i)
                values = (self.ops.engram_lookup(engram_rows[:, k], layer.engram.table, ENGRAM_DTYPE)
                          if looked is None else looked[:, k])
                h = self._engram(layer.engram, h, values)
            if i in targets:  # DSpark reads the input streams of its target layers (after the Engram)
                taps.append(h.mean(dim=1))
            experts = None if self.expert_shard is None else partial(self.expert_shard, i, ids)
            h, pre = self.block(layer, h, pre, lambda a, i=i, layer=layer: self._summed(attention(
                self._ctx[i], layer, cache, chunks, a, pos, shared)), cfg.num_experts_per_tok, experts)
        logits = self._head(h, pre, chunks, logit_rows)
        if not hidden:
            return logits
        return logits, torch.cat(taps, dim=-1) if taps else h.new_zeros((h.shape[0], 0))

    def _head(self, h: torch.Tensor, pre: torch.Tensor, chunks, logit_rows) -> torch.Tensor:
        ops, w, eps = self.ops, self.weights, self.cfg.rms_norm_eps
        if isinstance(chunks, DecodeBatch):
            logit_rows = slice(None)
        elif logit_rows is None:
            logit_rows = torch.tensor([ch.start + ch.length - 1 for ch in chunks], device=h.device)
        h, pre = h[logit_rows], pre[logit_rows]
        if h.shape[0] == 0:  # a prefill step that ends no prompt: no head (a kernel takes no empty grid)
            return h.new_zeros((0, self.cfg.vocab_size), dtype=torch.float32)
        out = ops.rms_norm(ops.hc_collapse(h, pre), w.norm, eps)
        # the reference's head runs in fp32; a kernel table takes one dtype, so the head's own (fp32 on the reference
        # path's default dtype: the same numbers)
        return ops.linear(out.to(w.head.dtype), w.head).float()

    def _engram(self, w: Engram41, h: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """h [N, hc, D] += gated Engram value; values [N, (max_ngram - 1) * heads * head_dim] the looked-up table
        rows of each token."""
        ops, n, d = self.ops, h.shape[0], h.shape[-1]
        # rows rounded to bf16 as the reference feeds them, the projection in the weights' dtype, its output rounded
        # to bf16 as the reference's bf16 matmul gives it (the same numbers, and kernel tables need one dtype)
        kv = ops.linear(values.to(w.wkv.dtype), w.wkv).to(ENGRAM_DTYPE).float()
        key, value = kv.split([self.cfg.hc_mult * d, d], dim=-1)
        return ops.engram_gate(h, key.view(n, self.cfg.hc_mult, d), value, w.q_weight, w.k_weight,
                               self.cfg.rms_norm_eps)

    def _engram_values(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [N, engram layers, C] -> the rows looked up over the ranks that split the tables [N, layers, C * d]
        (`parallel.engram`)."""
        tables = [self.weights.layers[i].engram.table for i in self.cfg.engram.layer_ids]
        return self.engram_shard(self.ops.engram_lookup, rows, tables, ENGRAM_DTYPE)

    def _engram_rows(self, cache: V41Cache, ids: torch.Tensor, chunks: list[Chunk]) -> torch.Tensor | None:
        """Each chunk's n-gram rows -> [N, engram layers, (max_ngram - 1) * heads]."""
        if self.hasher is None:
            return None
        dev = ids.device
        return torch.cat([self._ngram_rows(cache, ids[ch.rows], torch.tensor([ch.slot], device=dev),
                                           torch.tensor([ch.t0], device=dev), ch.length) for ch in chunks])

    def _ngram_rows(self, cache: V41Cache, ids: torch.Tensor, slot: torch.Tensor, first: torch.Tensor,
                    length: int) -> torch.Tensor:
        """Hash the n-grams ending at each of ids [B * length] (sequence i's tokens at positions first[i].. in
        cache slot slot[i]) from the classes of its last max_ngram positions (DEAD before the sequence start) ->
        [B * length, engram layers, (max_ngram - 1) * heads]. Tensor work only. The new classes enter the slot's
        ring (row pos % ring) before the history is read from it: with one-token rows several rows may continue
        one sequence (a verify step), each reading the rows before it."""
        back, dev = self.hasher.multipliers.shape[1] - 1, ids.device
        ring, slot = cache.classes.shape[1], slot.view(-1, 1)
        new = self.hasher.classes_of(ids.view(-1, length))
        if length == 1:
            cache.classes[slot, first.view(-1, 1) % ring] = new
            past = first.view(-1, 1) + torch.arange(-back, 1, device=dev)
            return self.hasher.hashes(torch.where(past >= 0, cache.classes[slot, past % ring], DEAD)).flatten(0, 1)
        # a chunk: the earlier positions from the ring (read before its own rows enter it), its own from the ids
        past = first.view(-1, 1) + torch.arange(-back, 0, device=dev)
        history = torch.cat([torch.where(past >= 0, cache.classes[slot, past % ring], DEAD), new], dim=1)
        keep = torch.arange(max(0, length - ring), length, device=dev)  # its last rows: earlier ones are overwritten
        cache.classes[slot, (first.view(-1, 1) + keep) % ring] = new[:, keep]
        return self.hasher.hashes(history).flatten(0, 1)
