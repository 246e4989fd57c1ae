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
graphs exist, then the host's share refined with every verify step's measured time.
"""

from __future__ import annotations

import itertools
import time
from typing import Callable, Sequence

import numpy as np
import torch

from deepinfer.runtime.graph import bucket_for


SMALL = 48  # (request, draft) pairs up to which the admission sorts them in Python: numpy's per-call overhead
# (tens of microseconds a call on a GPU host's CPU) is most of a batch-1 step's host work otherwise


def verify_budget(confidences: Sequence[Sequence[float]], cost: Callable[[int], float],
                  steps: Sequence[int] | None = None) -> list[int]:
    """Drafts to verify per request (a prefix of each request's drafts), from each draft's confidence [request][j]
    and `cost(rows)` of a verify step of that many rows (one per request plus the admitted drafts). `steps`: the
    row counts where the cost changes (graph buckets: a step of r rows costs its bucket's replay); the admission
    then moves a bucket at a time, each move filling the next bucket with the highest survivals (within a bucket
    more rows cost nothing more), and stops at the first move whose rate does not rise."""
    n = len(confidences)
    lengths = [len(cs) for cs in confidences]
    width = max(lengths, default=0)
    if not n or not width:
        return [0] * n
    # the pairs by survival, highest first; ties by draft, then request: within a request survival never rises,
    # so every admitted set is a prefix of each request's drafts
    if n * width <= SMALL:
        pairs = []
        for r, cs in enumerate(confidences):
            survival = 1.0
            for j, c in enumerate(cs):
                survival *= c if 0.0 <= c <= 1.0 else 1.0 if c > 1.0 else 0.0  # NaN: 0
                pairs.append((-survival, j, r))
        pairs.sort()
        requests = [r for _, _, r in pairs]
        gains = list(itertools.accumulate((-s for s, _, _ in pairs), initial=0.0))
    else:
        if min(lengths) == width:
            conf = np.asarray(confidences, dtype=np.float64)
        else:
            conf = np.zeros((n, width))
            for r, cs in enumerate(confidences):
                conf[r, : len(cs)] = cs
        survival = np.cumprod(np.clip(np.nan_to_num(conf, nan=0.0), 0.0, 1.0), axis=1).ravel()
        draft, request = np.tile(np.arange(width), n), np.repeat(np.arange(n), width)
        order = np.lexsort((request, draft, -survival))
        if min(lengths) < width:
            order = order[(draft < np.repeat(lengths, width))[order]]
        requests = request[order]
        gains = np.concatenate([[0.0], np.cumsum(survival[order])])  # expected tokens of the first i
    total = len(requests)
    taken = 0
    rate = n / cost(n)
    while taken < total:
        room = next((b for b in steps or () if b > n + taken), None)
        end = min(total, room - n if room is not None else taken + 1)
        nxt = (n + gains[end]) / cost(n + end)
        if nxt <= rate:
            break  # the first drop (or no gain) ends the admission
        taken, rate = end, nxt
    if isinstance(requests, np.ndarray):
        return np.bincount(requests[:taken], minlength=n).tolist()
    counts = [0] * n
    for r in requests[:taken]:
        counts[r] += 1
    return counts


class StepCosts:
    """Seconds of a verify step by its rows. Where the decode graphs are captured, each bucket's replay is timed
    at start (`profile`), and a step of r rows costs its bucket's replay plus the host's share of a step of that
    bucket (sampling, appending, drafting: measured steps less their replay; before one is measured, the average
    over the buckets measured so far); the admission then moves a bucket at a time (`steps`: a padded bucket
    costs its whole replay, so the first draft past a bucket alone is always a drop: measured on the H200, no draft
    admitted at batch 32 before the admission moved by buckets). Elsewhere (eager, no padding) the average of
    measured steps by bucket, interpolated linearly in rows (flat with one bucket measured, constant with none:
    everything is admitted until a step is measured)."""

    def __init__(self, buckets: Sequence[int]):
        self.buckets = tuple(buckets)
        self.seconds: dict[int, float] = {}  # measured steps, by bucket
        self.device: dict[int, float] = {}  # profiled replays, by bucket
        self.host: dict[int, float] = {}  # a step's time beyond its replay, by bucket

    @property
    def steps(self) -> tuple[int, ...] | None:
        """The row counts where the cost changes (profiled buckets), for `verify_budget`; None: continuous."""
        return tuple(sorted(self.device)) if self.device else None

    def bucket(self, rows: int) -> int:
        return bucket_for(self.buckets, rows) or self.buckets[-1]

    def record(self, rows: int, seconds: float) -> None:
        b = self.bucket(rows)
        table, value = (self.host, max(seconds - self.device[b], 0.0)) if b in self.device else (self.seconds, seconds)
        old = table.get(b)
        table[b] = value if old is None else 0.8 * old + 0.2 * value

    def __call__(self, rows: int) -> float:
        if self.device:
            b = self.bucket(rows)
            host = self.host.get(b)
            if host is None:
                host = sum(self.host.values()) / len(self.host) if self.host else 0.0
            device = self.device.get(b)
            return (device if device is not None else _interpolate(self.device, rows)) + host
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
