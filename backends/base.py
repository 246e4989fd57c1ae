"""What a backend is: a compile target described as data (traits for the portable facade, lowering stages,
toolchain, runtime). Nothing above this layer branches on a target's name; it reads these fields."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol


class BackendError(RuntimeError):
    """A toolchain or runtime failure; `log` is the path of the tool's log when there is one."""

    def __init__(self, message: str, log: Path | None = None):
        super().__init__(message if log is None else f"{message} (log: {log})")
        self.log = log


@dataclass(frozen=True)
class Traits:
    """How the portable facade spells the constructs that differ between targets (kernels.md section 3)."""

    dialect: str  # the TileLang dialect module the kernel body is written in
    launch: str  # "grid": one CTA per tile | "persistent": a core grid looping over tiles
    cores: int  # persistent launch: cores in the grid
    io_scope: str  # staging / vector tiles (GPU shared memory, Ascend UB, CPU static shared)
    operand_scope: str  # GEMM operands (shared memory, Ascend L1)
    acc: str  # GEMM accumulator: "fragment" | "tmem" | "l0c" | "local"
    vec: str  # state that lives across vector regions: "fragment" | "shared" (UB) | "local"
    reg: str  # temporaries inside one vector region: "fragment" | "local"
    vector_region: bool  # vector code must sit in an explicit SIMT region (Ascend `T.SimtVF`)
    vector_halves: bool  # an accumulator tile reaches the vector units split in two halves (Ascend AIV pair)
    dependent_launch: bool = False  # every kernel waits on its predecessor in-kernel (CUDA PDL: `tl.dependent_launch`)


@dataclass
class StageContext:
    """What a lowering stage sees: the kernel, the staging directory and the files earlier stages wrote."""

    func: Any  # tvm PrimFunc
    out_dir: Path
    pass_configs: dict[str, Any] = field(default_factory=dict)  # the target's, updated by the kernel's
    files: dict[str, Path] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Stage:
    """One named build step; `run` writes its outputs under ctx.out_dir and returns them by name (an output it
    cannot make here, e.g. for a missing toolchain, is left out, with a note in ctx.notes). `outputs` names what
    it can produce; the first stage is the one lowering of the kernel, the later ones compile its outputs."""

    name: str
    run: Callable[[StageContext], dict[str, Path]]
    outputs: tuple[str, ...] = ()


class Runtime(Protocol):
    def load(self, artifact_dir: Path, func: Any, pass_configs: dict[str, Any]) -> Callable[..., Any]: ...


INVARIANCE = ("tested", "untested", "unsupported")  # what `--batch-invariant` is on a target


@dataclass(frozen=True)
class Target:
    """A target as data: everything the runtime and the compile path ask about it, so that nothing above this
    layer branches on a target's name. `stages` is empty for the PyTorch reference pseudo-target."""

    name: str  # the name users type: sm90, sm100, ascend, c, reference
    description: str
    family: str  # nvidia | ascend | cpu: what the `--backend` aliases group (nvidia = detect the SM)
    device_type: str  # torch device type the runtime runs on: cuda | npu | cpu
    default_dtype: str  # the activation dtype `--dtype auto` means on this target
    present: Callable[[], bool]  # is this target's device visible here (compute capability, NPU, ...)
    tvm_target: Any = None  # dict or str accepted by tilelang / tvm (None: no kernels)
    traits: Traits | None = None
    stages: tuple[Stage, ...] = ()
    pass_configs: dict[str, Any] = field(default_factory=dict)
    toolchain: Callable[[], dict[str, str]] = dict  # tool name -> version string ("" when absent)
    runtime: Runtime | None = None
    graphs: Callable[[], Callable[..., Any]] | None = None  # graph-capture factory (None: decode runs eagerly)
    # a second stream on a device, for a decode step's independent halves (`branch()`, `join()`; None: one stream)
    side_stream: Callable[[Any], Any] | None = None
    memory: Callable[[Any], tuple[int, int]] | None = None  # (free, total) bytes of a device (None: unknown)
    needs: str = ""  # what must be installed / present to run on it (for errors)
    collectives: str = "gloo"  # the torch.distributed backend of several ranks on this target (nccl, hccl, gloo)
    bind_device: Callable[[int], None] | None = None  # make device `local_rank` this process's own (None: CPU)
    # `--batch-invariant` here: "tested" (bit for bit, by the test suite), "untested" (the same split rules, never
    # run: a warning), "unsupported" (an error naming why)
    batch_invariant: str = "tested"
    batch_invariant_note: str = ""

    def __post_init__(self) -> None:
        if self.batch_invariant not in INVARIANCE:
            raise ValueError(f"target {self.name}: batch_invariant={self.batch_invariant!r}; accepted: {INVARIANCE}")

    @property
    def kernels(self) -> bool:
        """Whether this target runs compiled TileLang kernels (False: the PyTorch reference ops)."""
        return bool(self.stages)


def run_tool(cmd: list[str], log: Path, what: str, timeout: int = 600) -> None:
    """Run an external tool, keeping its full output in `log`; raise BackendError naming the log on failure."""
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.write_text(f"$ {' '.join(cmd)}\n{exc}\n")
        raise BackendError(f"{what} could not run: {exc}", log) from exc
    log.write_text(f"$ {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}\n")
    if proc.returncode != 0:
        raise BackendError(f"{what} failed with exit code {proc.returncode}", log)
