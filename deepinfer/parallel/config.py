"""How a run is spread over devices: data-parallel attention, tensor-parallel attention projections and expert
parallelism for the routed experts, in the field's spelling (`--data-parallel-size`, `--tensor-parallel-size`,
`--enable-expert-parallel`).

World = data_parallel_size x tensor_parallel_size ranks; rank r is data-parallel rank r // tp and tensor-parallel
rank r % tp. Each data-parallel rank schedules its own requests and owns its cache; the ranks of one tensor-
parallel group run the same requests, each with its share of the attention heads. The routed experts are split
over all ranks with expert parallelism on, else every rank holds all of them (data parallelism is then plain
replication, and tensor parallelism covers the attention projections only).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from deepinfer.errors import ConfigError


@dataclass(frozen=True)
class ParallelConfig:
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("data_parallel_size", "tensor_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}={value!r} is invalid; accepted: an integer >= 1")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ConfigError(f"enable_expert_parallel={self.enable_expert_parallel!r} is invalid; accepted: True or False")

    @property
    def world(self) -> int:
        return self.data_parallel_size * self.tensor_parallel_size

    @property
    def expert_ranks(self) -> int:
        """Ranks the routed experts are split over (1: every rank holds all of them)."""
        return self.world if self.enable_expert_parallel else 1

    def check_model(self, heads: int, groups: int, experts: int, what: str = "the model", redundant: int = 0) -> None:
        """ConfigError when the model's widths (its routed experts + `redundant` EPLB slots) do not split over these
        sizes."""
        tp = self.tensor_parallel_size
        if heads % tp or groups % tp:
            raise ConfigError(f"tensor_parallel_size={tp} must divide {what}'s attention heads ({heads}) and output "
                              f"groups ({groups}); accepted: a common divisor of the two")
        if (experts + redundant) % self.expert_ranks:
            extra = f" + {redundant} redundant = {experts + redundant} slots" if redundant else ""
            raise ConfigError(f"expert parallelism over {self.expert_ranks} ranks (data_parallel_size x "
                              f"tensor_parallel_size) must divide {what}'s {experts} routed experts{extra}")


@dataclass(frozen=True)
class Rank:
    """This process's place in the world."""

    rank: int
    local_rank: int  # its device index on this host
    parallel: ParallelConfig

    @property
    def dp_rank(self) -> int:
        return self.rank // self.parallel.tensor_parallel_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.parallel.tensor_parallel_size


def eplb_config(parallel: ParallelConfig, enable: bool, redundant: int, interval: int):
    """The EPLB settings (an `experts.EplbConfig`), None when off; ConfigError naming a bad one."""
    if not enable:
        return None
    if not parallel.enable_expert_parallel or parallel.world < 2:
        raise ConfigError("enable_eplb balances experts split over several ranks: it needs enable_expert_parallel "
                          "and data_parallel_size x tensor_parallel_size > 1")
    from deepinfer.parallel.experts import EplbConfig

    return EplbConfig(redundant, interval)


def launched_rank(parallel: ParallelConfig, environ: Mapping[str, str] | None = None) -> Rank | None:
    """The rank this process is when a launcher started it (torchrun, or deepinfer's own workers: RANK,
    WORLD_SIZE and LOCAL_RANK set); None when it runs alone. ConfigError when WORLD_SIZE disagrees with the sizes."""
    environ = os.environ if environ is None else environ
    if "RANK" not in environ or "WORLD_SIZE" not in environ:
        return None
    try:
        rank, world = int(environ["RANK"]), int(environ["WORLD_SIZE"])
        local = int(environ.get("LOCAL_RANK", rank))
    except ValueError as exc:
        raise ConfigError(f"RANK / WORLD_SIZE / LOCAL_RANK must be integers: {exc}") from None
    if world != parallel.world:
        raise ConfigError(f"the launcher started {world} processes (WORLD_SIZE) but data_parallel_size x "
                          f"tensor_parallel_size = {parallel.data_parallel_size} x {parallel.tensor_parallel_size} "
                          f"= {parallel.world}; start one process per rank")
    if not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} is outside [0, {world})")
    return Rank(rank, local, parallel)
