"""DeepSeek-V4.1 behind the engine's `ModelSteps`: its paged cache (`V41Cache` over `spec.num_blocks` blocks) with
the scheduler's slot and block accounting on top, and prefill chunks / decode batches as `DeepseekV41.forward`
chunks.

A sequence's blocks (handed out by `SlotBlocks`) enter its slot's row of the cache's block table as it grows,
and leave it when it is released (preempted or finished); the compressed latents and index keys of every kv
source live in those blocks. Decode steps replay CUDA graphs where the backend captures (`v41_graphs`), else run
eagerly; slot `max_seqs` and block `num_blocks` are scratch.
"""

from __future__ import annotations

import torch

from deepinfer.config_v41 import V41Config
from deepinfer.model.v41 import DeepseekV41
from deepinfer.model.v41_cache import V41Cache
from deepinfer.model.rollback import check_tentative, commit
from deepinfer.model.v41_compress import Chunk
from deepinfer.model.v41_decode import DecodeBatch
from deepinfer.runtime.blocks import SeqCache, SlotBlocks
from deepinfer.runtime.staging import DeviceIds, ids_tensor
from deepinfer.runtime.v41_graphs import V41DecodeGraphs
from deepinfer.runtime.cache_layout import CacheSpec


class V41SlotCache(SlotBlocks):
    def __init__(self, cfg: V41Config, spec: CacheSpec, dtype: torch.dtype, device: torch.device | str):
        super().__init__(spec)
        self.paged = V41Cache.empty(cfg, spec.max_seqs + 1, spec.max_tokens, dtype, device,  # + the scratch slot
                                    spec.block_tokens, spec.num_blocks, lookahead=spec.lookahead,
                                    draft_layers=spec.draft_layers)
        self.tables = self.paged.tables

    def admit(self) -> SeqCache | None:
        seq = super().admit()
        if seq is not None:  # a reused slot: every read is bounded by the token count, so this resets it
            self.paged.num_tokens[seq.slot] = 0
        return seq

    @property
    def drafts(self) -> list[torch.Tensor]:
        """The DSpark blocks' window rings (`V41Cache.drafts`)."""
        return self.paged.drafts

    def tensors(self) -> list[torch.Tensor]:
        return self.paged.tensors()

    def num_bytes(self) -> int:
        return self.paged.num_bytes()


class V41Steps:
    def __init__(self, model: DeepseekV41, cache: V41SlotCache, capture=None):
        """`capture`: the backend's graph capture (None: decode steps run eagerly)."""
        cfg, spec = model.cfg, cache.spec
        self.model, self.cache = model, cache
        self.hidden = spec.draft_layers > 0  # DSpark: every step keeps its rows' taps
        self.decode_graphs = (None if capture is None else
                              V41DecodeGraphs(model, cache.paged, cache.scratch_slot,
                                              spec.max_seqs * (1 + spec.lookahead), capture, self.hidden))
        self.vocab_size, self.eos_token_ids, self.max_positions = (cfg.vocab_size, tuple(cfg.eos_token_ids),
                                                                   cfg.max_position_embeddings)
        self.device = model.weights.embed.device

    def prefill(self, ids: list[int], positions: list[int], seqs: list[tuple[SeqCache, int, int]],
                logit_rows: list[int], hidden: bool = False):
        """`hidden`: (logits, every row's DSpark taps)."""
        for seq, start, length in seqs:
            if positions[start] != seq.num_tokens:
                raise AssertionError(f"chunk starts at {positions[start]} but the sequence holds {seq.num_tokens}")
            self.cache.check_held(seq, length)
        chunks = [Chunk(seq.slot, start, length, seq.num_tokens) for seq, start, length in seqs]
        out = self.model.forward(self.cache.paged, torch.tensor(ids, device=self.device), chunks,
                                 torch.tensor(logit_rows, dtype=torch.long, device=self.device), hidden=hidden)
        for seq, _, length in seqs:
            seq.num_tokens += length
        return out

    @property
    def verify_graphs(self) -> V41DecodeGraphs | None:
        """The graphs verify steps replay (None: eager)."""
        return self.decode_graphs

    def verify(self, ids: list[int], positions: list[int], seqs: list[tuple[SeqCache, int, int]]):
        """A speculative verify step: each (sequence, first row, rows) continues its sequence with its last token
        and drafts, as rows of one decode step (its graphs where captured) -> (fp32 logits of every row, their
        DSpark taps). Advances the counts by every row; `commit` keeps what stands."""
        slots = []
        for seq, _, n in seqs:
            check_tentative(n, self.cache.spec.lookahead)
            self.cache.check_held(seq, n)
            slots += [seq.slot] * n
        if self.decode_graphs is not None:
            logits, taps = self.decode_graphs.run(ids, positions, slots), self.decode_graphs.last_taps
        else:
            with torch.inference_mode():
                step = DecodeBatch(torch.tensor(slots, device=self.device), torch.tensor(positions, device=self.device),
                                   self.cache.paged.max_len - 1)
                logits, taps = self.model.decode_step(self.cache.paged, ids_tensor(ids, self.device), step, True)
        for seq, _, n in seqs:
            seq.num_tokens += n
            self.cache.paged.num_tokens[seq.slot] += n
        return logits, taps

    def commit(self, seq: SeqCache, end: int) -> None:
        """Keep a verify step's positions before `end`: what it wrote past them lies in the rings' lookahead."""
        commit(seq, end)
        self.cache.paged.num_tokens[seq.slot] = end

    @property
    def capture(self):
        return None if self.decode_graphs is None else self.decode_graphs.capture

    @property
    def last_logits(self) -> torch.Tensor | None:
        return None if self.decode_graphs is None else self.decode_graphs.last_logits

    def capture_all(self) -> list[torch.Tensor]:
        return [] if self.decode_graphs is None else self.decode_graphs.capture_all()

    def decode(self, ids: list[int] | DeviceIds, positions: list[int], seqs: list[SeqCache]) -> torch.Tensor:
        if positions != [s.num_tokens for s in seqs]:
            raise AssertionError(f"decode positions {positions} differ from the sequences' token counts")
        for seq in seqs:
            self.cache.check_held(seq, 1)
        if self.decode_graphs is None:
            chunks = [Chunk(seq.slot, i, 1, seq.num_tokens) for i, seq in enumerate(seqs)]
            logits = self.model.forward(self.cache.paged, ids_tensor(ids, self.device), chunks)
        else:  # the graph's step leaves the model's token counts to its caller
            logits = self.decode_graphs.run(ids, positions, [seq.slot for seq in seqs])
            for seq in seqs:
                self.cache.paged.num_tokens[seq.slot] += 1
        for seq in seqs:
            seq.num_tokens += 1
        return logits
