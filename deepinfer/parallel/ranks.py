"""An `LLM` that is one rank of several: joining the world, its data-parallel share of a call's requests, and
the whole call's results (every rank's, in input order) put back together."""

from __future__ import annotations

import os
from typing import Any

import torch

from deepinfer.env import Env
from deepinfer.parallel.config import Rank
from deepinfer.runtime.backend import resolve
from deepinfer.runtime.engine import RunStats


def join(rank: Rank, backend: str | None, env: Env):
    """Bind this rank's device (LOCAL_RANK) and join the world: the rank's `Comm`."""
    from deepinfer.parallel.comm import Comm

    target = resolve(backend, env)
    if target.bind_device is not None:
        target.bind_device(rank.local_rank)
    else:  # ranks sharing the host's cores: each its share of the threads
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // rank.parallel.world))
    return Comm(rank, target.collectives, torch.device(target.device_type), env.dist_timeout)


def share(entries: list, comm) -> list:
    """The requests this rank runs: every data-parallel rank takes every dp-th request (by its index in the call);
    the ranks of one tensor-parallel group take the same ones."""
    return [e for e in entries if e.index % comm.dp == comm.rank.dp_rank]


def gathered(comm, results: list, stats: RunStats) -> tuple[list, RunStats]:
    """Every data-parallel rank's results (in input order) and their stats combined, on every rank."""
    leaders = comm.gather_objects((results, stats))[:: comm.tp]  # one rank per data-parallel rank
    outputs = sorted((o for part, _ in leaders for o in part), key=lambda o: o.index)
    return outputs, combine([s for _, s in leaders])


def combine(parts: list[RunStats]) -> RunStats:
    """Stats of ranks that ran side by side: tokens and steps add up, times are the longest rank's."""
    out = RunStats()
    for name, value in vars(out).items():
        values = [getattr(p, name) for p in parts]
        if name in ("expert_balance", "expert_rebalances"):  # the same on every rank
            setattr(out, name, values[0])
        elif name == "first_token_time":
            known = [v for v in values if v is not None]
            setattr(out, name, min(known) if known else None)
        elif name == "spec":  # speculative decoding runs on one device: no rank has verified anything
            setattr(out, name, values[0])
        elif isinstance(value, float):
            setattr(out, name, max(values))
        else:
            setattr(out, name, sum(values))
    return out


def describe(parallel: Any) -> str:
    p = parallel
    return (f"{p.world} ranks (data-parallel {p.data_parallel_size} x tensor-parallel {p.tensor_parallel_size}"
            + (f", experts over {p.expert_ranks} ranks)" if p.enable_expert_parallel else ", experts on every rank)"))
