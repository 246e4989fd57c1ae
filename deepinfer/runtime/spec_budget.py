"""Confidence-sized verification (`DEEPINFER_ENABLE_MTP_VARLEN=1`, `--speculative-varlen`): how many of each
request's drafts one verify step checks, chosen across the batch from the drafts' confidences and the measured
cost of a step by its rows.

A draft's confidence c is the drafter's estimate that it is accepted if the ones before it were; the survival of
draft j of a request is the product of the confidences up to j (the chance that it is reached and accepted). The
(request, draft) pairs are admitted in order of survival, highest first, while the step's expected tokens per
second (requests + admitted survivals, over the cost of the step's rows) keeps rising, and the admission STOPS at
the first drop: searching past it over the current confidences would make the verify lengths depend on the drafts'
own contents in a way that biases the output distribution (DSpark's appendix A). With match verification the
tokens do not depend on the lengths at all (docs/speculative.md); the rule still keeps the step's expected gain
monotone.

`StepCosts` keeps the cost of a step by its graph bucket: measured at start (each captured bucket replayed) where
graphs exist, then refined with every verify step's measured time.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch


def verify_budget(confidences: Sequence[Sequence[float]], cost: Callable[[int], float]) -> list[int]:
    """Drafts to verify per request (a prefix of each request's drafts), from each draft's confidence [request][j]
    and `cost(rows)` of a verify step of that many rows (one per request plus the admitted drafts)."""
    order = []
    for r, cs in enumerate(confidences):
        survival = 1.0
        for j, c in enumerate(cs):
            survival *= min(max(float(c), 0.0), 1.0)
            order.append((-survival, j, r))
    order.sort()  # highest survival first; within a request survival never rises, ties go by position
    counts = [0] * len(confidences)
    rows = expected = float(len(confidences))
    rate = expected / cost(int(rows))
    for minus, j, r in order:
        if j != counts[r]:  # not the request's next draft (only on equal survivals): keep the prefix
            continue
        nxt = (expected - minus) / cost(int(rows) + 1)
        if nxt <= rate:
            break  # the first drop (or no gain) ends the admission
        counts[r] += 1
        rows += 1
        expected -= minus
        rate = nxt
    return counts


class StepCosts:
    """Seconds of a verify step by its rows. Where the decode graphs are captured, each bucket's replay is timed
    at start (`profile`), and a step of r rows costs the replay time interpolated linearly at r between the
    profiled bucket sizes, plus the host's share of a step (sampling, appending, drafting: the average of
    measured steps less their replay). Elsewhere the average of measured steps by bucket, interpolated the same
    way (flat with one bucket measured, constant with none: everything is admitted until a step is measured).

    The interpolation is what lets the greedy admission cross a bucket: a padded bucket's whole cost would make
    the first draft past it a drop every time (measured on the H200: no draft admitted at batch 32)."""

    def __init__(self, buckets: Sequence[int]):
        self.buckets = tuple(buckets)
        self.seconds: dict[int, float] = {}  # measured steps, by bucket
        self.device: dict[int, float] = {}  # profiled replays, by bucket
        self.host: float | None = None  # a step's time beyond its replay

    def bucket(self, rows: int) -> int:
        return next((b for b in self.buckets if b >= rows), self.buckets[-1])

    def record(self, rows: int, seconds: float) -> None:
        b = self.bucket(rows)
        if b in self.device:
            extra = max(seconds - self.device[b], 0.0)
            self.host = extra if self.host is None else 0.8 * self.host + 0.2 * extra
            return
        old = self.seconds.get(b)
        self.seconds[b] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def __call__(self, rows: int) -> float:
        if self.device:
            return _interpolate(self.device, rows) + (self.host or 0.0)
        return _interpolate(self.seconds, rows) if self.seconds else 1.0

    def profile(self, replays: dict[int, Callable[[], object]], repeats: int = 5) -> None:
        """Time each captured bucket's replay (`DecodeGraphs.replays()`: padding rows only, scratch state)."""
        for size, replay in replays.items():
            replay()
            torch.accelerator.synchronize()
            begin = time.perf_counter()
            for _ in range(repeats):
                replay()
            torch.accelerator.synchronize()
            self.device[size] = (time.perf_counter() - begin) / repeats


def _interpolate(table: dict[int, float], x: int) -> float:
    """Piecewise-linear through the (rows, seconds) points of `table`, extended by its end segments (flat with
    one point)."""
    keys = sorted(table)
    if len(keys) == 1:
        return table[keys[0]]
    hi = next((k for k in keys if k >= x), keys[-1])
    i = max(keys.index(hi), 1)
    lo, hi = keys[i - 1], keys[i]
    value = table[lo] + (table[hi] - table[lo]) * (x - lo) / (hi - lo)
    return max(value, 1e-9)
