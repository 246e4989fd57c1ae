"""Data-parallel ranks whose MoE layers exchange tokens (expert parallelism) must run their forward passes
together: every forward of any rank meets one forward on every other rank. `LockstepSteps` wraps a rank's
`V4Steps`: before each forward the ranks agree (a host all-reduce on the control group) whether some rank steps,
whether some rank prefills, and the most decode rows of any rank.

- Some rank prefills: every rank's forward is eager and the exchange carries each rank's row count (decoding
  ranks decode eagerly, idle ranks run an idle forward: the layers' exchanges without tokens).
- Every stepping rank decodes: they all run the decode bucket that holds the most rows of any rank, from its
  graph where the steps capture (the exchange inside has that bucket's rows on every rank: static shapes, so it
  is captured with the step); idle ranks run the same bucket with only padding rows.

A rank with nothing left (`drain`, at the end of its run) keeps answering until no rank steps.
`EagerLockstepSteps` (DeepSeek-V4.1's `V41Steps`, and `LockstepSteps`' base) keeps every forward eager, as in
the first case.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from deepinfer.parallel.comm import Comm


class EagerLockstepSteps:
    """The agreement for steps that decode eagerly on several ranks (DeepSeek-V4.1's `V41Steps`, and the base of
    `LockstepSteps`): every forward's expert exchange carries each rank's row count, a rank with nothing to run
    while others step runs idle forwards (its layers' exchanges without tokens), and `drain` keeps answering until
    no rank steps."""

    capture = None  # eager: no decode graphs (their exchange would need every rank's rows fixed per bucket)
    last_logits = None

    def __init__(self, steps, model, comm: Comm):
        self.steps, self.model, self.comm = steps, model, comm
        self.vocab_size, self.eos_token_ids = steps.vocab_size, steps.eos_token_ids
        self.max_positions, self.device = steps.max_positions, steps.device
        self.idle_steps = 0  # forwards this rank ran without tokens (others stepped)

    def capture_all(self) -> list[torch.Tensor]:
        return []

    def prefill(self, ids, positions, seqs, logit_rows, **kwargs):
        self.comm.agree(True, True, 0)
        return self.steps.prefill(ids, positions, seqs, logit_rows, **kwargs)

    def decode(self, ids, positions, seqs):
        self.comm.agree(True, False, len(seqs))
        return self.steps.decode(ids, positions, seqs)

    @torch.inference_mode()
    def drain(self) -> None:
        """Idle forwards while any other rank still steps; returns when every rank has drained."""
        while self.comm.agree(False, False, 0)[0]:
            self.model.idle()
            self.idle_steps += 1


class LockstepSteps(EagerLockstepSteps):
    """DeepSeek-V4's `V4Steps` (with its `DeepseekV4`): decoding ranks run the same decode bucket, from its graph
    where the steps capture."""

    @property
    def graphs(self):
        return self.steps.graphs

    @graphs.setter
    def graphs(self, graphs) -> None:
        self.steps.graphs = graphs

    @property
    def capture(self):
        return self.steps.capture

    @property
    def last_logits(self):
        return self.steps.last_logits

    def capture_all(self):
        with self._static():  # every bucket's exchange with its own rows (the same bucket on every rank)
            return self.steps.capture_all()

    def decode(self, ids, positions, seqs):
        _, mixed, rows = self.comm.agree(True, False, len(seqs))
        if mixed:
            return self.steps.decode(ids, positions, seqs, eager=True)
        with self._static():
            return self.steps.decode(ids, positions, seqs, rows=rows)

    @torch.inference_mode()
    def drain(self) -> None:
        """Idle forwards while any other rank still steps; returns when every rank has drained."""
        while True:
            active, mixed, rows = self.comm.agree(False, False, 0)
            if not active:
                return
            if mixed:
                self.model.idle()
            else:
                with self._static():
                    self.steps.graphs.run([], [], [], rows=rows)
            self.idle_steps += 1

    @contextmanager
    def _static(self):
        shard = self.model.expert_shard
        shard.static = True
        try:
            yield
        finally:
            shard.static = False
