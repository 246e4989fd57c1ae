"""Data-parallel ranks whose MoE layers exchange tokens (expert parallelism) must run their forward passes
together: every forward of any rank meets one forward on every other rank. `LockstepSteps` wraps a rank's
`ModelSteps`: before each forward the ranks agree that some rank steps (a host all-reduce on the control group);
a rank with nothing left (`drain`, at the end of its run) keeps answering, with an idle forward (the layers'
exchanges, no tokens) while any other rank still steps, and returns once no rank does.
"""

from __future__ import annotations

from deepinfer.model.model import DeepseekV4
from deepinfer.parallel.comm import Comm
from deepinfer.runtime.steps import ModelSteps


class LockstepSteps:
    def __init__(self, steps: ModelSteps, model: DeepseekV4, comm: Comm):
        self.steps, self.model, self.comm = steps, model, comm
        self.vocab_size, self.eos_token_ids = steps.vocab_size, steps.eos_token_ids
        self.max_positions, self.device = steps.max_positions, steps.device
        self.idle_steps = 0  # forwards this rank ran without tokens (others stepped)

    @property
    def capture(self):
        return self.steps.capture

    @property
    def last_logits(self):
        return self.steps.last_logits

    def capture_all(self):
        return self.steps.capture_all()

    def prefill(self, ids, positions, seqs, logit_rows):
        self.comm.any_rank(True)
        return self.steps.prefill(ids, positions, seqs, logit_rows)

    def decode(self, ids, positions, seqs):
        self.comm.any_rank(True)
        return self.steps.decode(ids, positions, seqs)

    def drain(self) -> None:
        """Idle forwards while any other rank still steps; returns when every rank has drained."""
        while self.comm.any_rank(False):
            self.model.idle()
            self.idle_steps += 1
