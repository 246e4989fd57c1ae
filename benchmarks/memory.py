"""The whole model's weight memory at native precision (FP8 dense, FP4 experts, as
`deepinfer.weights.synthetic` lays it out), from a config alone, against one device's memory.

    python benchmarks/memory.py [--config benchmarks/configs/v4-flash.json] [--device-gib 139.8]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    from deepinfer.config import ModelConfig
    from deepinfer.weights.synthetic import native_bytes
    from deepinfer.model.weights import tensor_specs
    import math

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "benchmarks/configs/v4-flash.json")
    parser.add_argument("--device-gib", type=float, default=139.8, help="usable memory of one device (H200: 139.8)")
    args = parser.parse_args()
    cfg = ModelConfig.from_dict(json.loads(args.config.read_text()))
    gib = 2**30
    native = native_bytes(cfg)
    params = sum(math.prod(s.shape) for s in tensor_specs(cfg).values())
    print(f"{args.config.name}: {params / 1e9:.1f} B parameters (MTP layers not counted)")
    for name, b in native.items():
        print(f"  {name:14s} {b / gib:8.1f} GiB")
    total = sum(native.values())
    bf16 = params * 2
    print(f"  {'native total':14s} {total / gib:8.1f} GiB  ({total / (args.device_gib * gib):.2f}x one device)")
    print(f"  {'all bf16':14s} {bf16 / gib:8.1f} GiB  ({bf16 / (args.device_gib * gib):.2f}x one device)")


if __name__ == "__main__":
    with torch.device("meta"):
        main()
