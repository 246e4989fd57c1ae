"""The whole model's weight memory at native precision, from a config alone, against one device's memory: on one
device and on each rank of N data-parallel ranks with the routed experts split over them (expert parallelism), as
`deepinfer/parallel/shard.py` lays it out: V4.1's Engram tables split by rows over the same ranks
(`deepinfer/parallel/engram.py`), everything else whole on every rank.

DeepSeek-V4 (a config.json file): FP8 dense, FP4 experts, as `deepinfer.weights.synthetic` lays it out.
DeepSeek-V4.1 (a model directory): as `load_v41` keeps its checkpoint with `--quantization auto` (FP8 dense, FP4
experts, the Engram tables FP8), the fit check's count (`assemble.v41_weight_bytes`).

    python benchmarks/memory.py [--config benchmarks/configs/v4-flash.json | benchmarks/configs/v41-flash]
                                [--ranks 1,2,4,8] [--device-gib 139.8]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GIB = 2**30


def v4_classes(cfg) -> dict[str, int]:
    from deepinfer.weights.synthetic import native_bytes

    return native_bytes(cfg)


def v41_classes(cfg) -> dict[str, int]:
    """V4.1's loaded bytes by class: routed experts, Engram tables, the rest (DSpark draft blocks included)."""
    from deepinfer.assemble import v41_weight_bytes
    from deepinfer.weights.v41_loader import ROUTED

    def only(test):
        return v41_weight_bytes(cfg, torch.bfloat16, True, lambda name: 1.0 if test(name) else 0.0)

    experts = only(ROUTED.match)
    tables = only(lambda name: ".engram.embed." in name)
    return {"fp4 experts": experts, "engram tables": tables,
            "the rest": v41_weight_bytes(cfg, torch.bfloat16, True) - experts - tables}


def report(config: Path, ranks: list[int], device_gib: float) -> dict:
    """{'parameters', 'classes' (bytes), 'per_rank' {N: bytes}} of the config, printed as a table."""
    from deepinfer.config import ModelConfig
    from deepinfer.config_v41 import V41Config, read_config

    cfg = read_config(config) if config.is_dir() else ModelConfig.from_dict(json.loads(config.read_text()))
    if isinstance(cfg, V41Config):
        from deepinfer.model.v41_weights import tensor_specs

        classes = v41_classes(cfg)
    else:
        from deepinfer.model.weights import tensor_specs

        classes = v4_classes(cfg)
    params = sum(math.prod(s.shape) for s in tensor_specs(cfg).values())
    print(f"{config.name}: {params / 1e9:.1f} B parameters")
    for name, b in classes.items():
        print(f"  {name:14s} {b / GIB:8.1f} GiB")
    total = sum(classes.values())
    split = classes["fp4 experts"] + classes.get("engram tables", 0)  # each rank 1/N of these
    per_rank = {n: total - split * (n - 1) / n for n in ranks}
    print(f"| ranks (experts and tables split) | GiB a rank | of one {device_gib} GiB device |\n|---|---|---|")
    for n, b in per_rank.items():
        print(f"| {n} | {b / GIB:.1f} | {b / (device_gib * GIB):.2f}x |")
    return dict(parameters=params, classes=classes, per_rank=per_rank)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "benchmarks/configs/v4-flash.json",
                        help="a V4 config.json, or a V4.1 model directory")
    parser.add_argument("--ranks", default="1,2,4,8", help="data-parallel ranks the routed experts (and Engram tables) are split over")
    parser.add_argument("--device-gib", type=float, default=139.8, help="usable memory of one device (H200: 139.8)")
    args = parser.parse_args(argv)
    with torch.device("meta"):
        return report(args.config, [int(n) for n in args.ranks.split(",")], args.device_gib)


if __name__ == "__main__":
    main()
