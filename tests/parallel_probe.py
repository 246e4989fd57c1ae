"""What the parallel tests run on each rank (importable by the spawned rank workers)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from deepinfer.api import LLM
from deepinfer.runtime.graph import DecodeGraphs

SIZES = dict(backend="reference", num_blocks=64, max_num_seqs=4)


class Probe:
    """An `LLM` (one rank's, or the whole model's) whose forward passes the tests drive directly."""

    def __init__(self, **kwargs):
        self.llm = LLM(**SIZES, **kwargs)

    def describe(self) -> str:
        return self.llm.describe()

    def logits(self, prompts: list[list[int]], steps: int, forced: list[list[int]] | None = None,
               captured: bool = False) -> list[torch.Tensor]:
        """fp32 logits of each prompt's prefill rows, then of `steps` greedy decode steps, prompt by prompt. On
        several ranks, data-parallel rank d runs prompts d, d + dp, ... (as many on every rank: the forwards meet).
        `forced`: the token each decode step feeds, per prompt (default: the step's own greedy token); `captured`:
        decode through graphs captured by the backend (CUDA graphs on the GPU; with lockstep ranks every rank's
        step brings its one row, so the expert exchange runs without its size exchange, as a captured engine step).
        The logits come back on the host."""
        llm = self.llm
        device = llm.model.device
        mine = self._share(prompts)
        feeds = self._share(forced) if forced is not None else [None] * len(mine)
        shard = llm.model.expert_shard
        out = []
        for ids, feed in zip(mine, feeds):
            seq = llm.cache.admit()
            llm.cache.grow(seq, len(ids))
            rows = [llm.model.prefill(llm.cache, torch.tensor(ids, device=device),
                                      torch.arange(len(ids), device=device), [(seq, 0, len(ids))])]
            graphs = DecodeGraphs(llm.model, llm.cache, 1, llm.backend.capture if captured else None)
            if shard is not None:
                shard.static = captured  # a graph replays its shapes: no size exchange inside
            for s in range(steps):
                llm.cache.grow(seq, seq.num_tokens + 1)
                token = feed[s] if feed is not None else int(rows[-1][-1].argmax())
                rows.append(graphs.run([token], [seq.num_tokens], [seq]).clone())  # a graph's output is reused
                seq.num_tokens += 1
            if shard is not None:
                shard.static = False
            llm.cache.release(seq)
            out.append(torch.cat(rows).float().cpu())
        return self._in_order(out, len(prompts))

    def _share(self, items: list) -> list:
        """This data-parallel rank's items: d, d + dp, ... (every item on one process)."""
        comm = self.llm._comm
        return items if comm is None else items[comm.rank.dp_rank::comm.dp]

    def _in_order(self, mine: list, n: int) -> list:
        """Every data-parallel rank's `mine` (its `_share` of n items' results) in the items' order."""
        comm = self.llm._comm
        if comm is None:
            return mine
        parts = comm.gather_objects(mine)[:: comm.tp]
        return [parts[i % comm.dp][i // comm.dp] for i in range(n)]

    def expert_shapes(self) -> list[int]:
        """The experts this rank holds, per layer and weight (gate_up, down)."""
        shard = self.llm.model.expert_shard
        return [w.shape[0] for pair in zip(shard.gate_up, shard.down) for w in pair]

    def generate(self, prompts, params):
        return self.llm.generate(prompts, params, use_tqdm=False), self.llm.last_stats

    def emulate_graphs(self) -> int:
        """Decode through graphs captured (emulated on the CPU: recorded once, replayed) at start, every rank at
        once; the buckets captured."""
        from tests.test_engine import EmulatedCapture

        capture = EmulatedCapture()
        self.llm.engine.graphs = DecodeGraphs(self.llm.model, self.llm.cache, SIZES["max_num_seqs"], capture)
        self.llm.engine.capture_all()
        return capture.captures

    def fail_on(self, rank: int, message: str) -> None:
        """Rank `rank` raises; the others wait for it in a collective."""
        if self.llm._comm.rank.rank == rank:
            raise ValueError(message)
        dist.barrier()

    def close(self) -> None:
        self.llm.close()


class Probe41(Probe):
    """`Probe` for a DeepSeek-V4.1 model directory: its forward passes on a cache of its own, eager."""

    def logits(self, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
        """fp32 logits of each prompt's prefill rows, then of `steps` greedy decode steps, prompt by prompt: data-
        parallel rank d runs prompts d, d + D, ... (as many on each: their forwards meet when the experts are
        split), the ranks of a tensor-parallel group the same ones; every prompt's rows on rank 0, in order."""
        model, comm, out = self.llm.model, self.llm._comm, []
        assert comm is None or len(prompts) % comm.dp == 0, "every data-parallel rank runs as many prompts"
        for ids in self._share(prompts):
            cache = model.new_cache(1, len(ids) + steps)
            rows = [model.prefill(cache, torch.tensor(ids), 0)]
            for _ in range(steps):
                rows.append(model.decode(cache, rows[-1][-1:].argmax(-1), [0]))
            out.append(torch.cat(rows))
        return self._in_order(out, len(prompts))

    def engram_tables(self) -> list[list[int]]:
        """Every rank's rows of each Engram table (rank order)."""
        model = self.llm.model
        mine = [model.weights.layers[i].engram.table.shape[0] for i in model.cfg.engram.layer_ids]
        return self.llm._comm.gather_objects(mine)
