"""Run a Python script with the NVIDIA targets' kernels built and launched without CUDA's programmatic dependent
launch (no `griddepcontrol` in them, a plain launch): the other half of an A/B when a GPU run hangs or goes wrong
and dependent launch is a suspect (`backends.tl.dependent_launch`).

    python tools/no_dependent_launch.py benchmarks/async_steps.py --batches 1 ...
    python tools/no_dependent_launch.py tools/gpu_prebuild.py default slice     # build them ahead (CPU machine too)

The sm90 and sm100 targets' traits are replaced in this process before the script runs. The traits are part of
every kernel's cache key, so these kernels sit beside the usual ones in the same cache, under their own keys (a
first run builds them). Builds run in this process (`codegen.driver.build_all` with one job): a build worker is a
new interpreter that would import the unchanged targets. For triage only: it patches module attributes, which the
engine itself never does."""

from __future__ import annotations

import dataclasses
import inspect
import runpy
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]


def without_dependent_launch(target: Any) -> Any:
    return dataclasses.replace(target, traits=dataclasses.replace(target.traits, dependent_launch=False))


def serial(build_all: Callable[..., Any]) -> Callable[..., Any]:
    """`build_all` with every call's `jobs` set to 1 (the builds in this process)."""
    signature = inspect.signature(build_all)

    def build_here(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.arguments["jobs"] = 1
        return build_all(*bound.args, **bound.kwargs)

    build_here.__wrapped__ = build_all
    return build_here


def install() -> None:
    sys.path.insert(0, str(ROOT))
    import backends.nvidia as nvidia
    import codegen.driver as driver

    nvidia.SM90, nvidia.SM100 = without_dependent_launch(nvidia.SM90), without_dependent_launch(nvidia.SM100)
    driver.build_all = serial(driver.build_all)


def main(argv: list[str]) -> None:
    if not argv or not Path(argv[0]).is_file():
        raise SystemExit(f"usage: python tools/no_dependent_launch.py SCRIPT [ARGS...]; no script {argv[:1]}")
    install()
    print("no_dependent_launch: sm90 / sm100 kernels without programmatic dependent launch", file=sys.stderr,
          flush=True)
    sys.argv = list(argv)
    sys.path.insert(0, str(Path(argv[0]).resolve().parent))
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
