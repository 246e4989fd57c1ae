"""The TileLang kernel launches of one decode step, by op and kernel, counted on the CPU: the model runs on meta
tensors (no memory, no compute, as the compile plan traces it) through a launcher that counts what each op's `run`
launches. PyTorch's own kernels between the ops (the glue) are not counted: `benchmarks/profile_ops.py` sees those
on the GPU. A check of a fusion without a device, and the kernel count behind a step's latency at small batch.

    python benchmarks/decode_launches.py [--batch 1] [--config benchmarks/configs/v4-flash-slice] [--invariant]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def count(config_dir: Path, batch: int, invariant: bool) -> Counter:
    from deepinfer.compile.plan import META, meta_weights
    from deepinfer.config import ModelConfig
    from deepinfer.model.decode import DecodeInputs
    from deepinfer.model.model import DeepseekV4
    from deepinfer.runtime.cache import CacheSpec, PagedCache
    from tilekernels.kernels import Recorder, table

    class Counting(Recorder):
        """The plan's recorder (launches nothing), counting every (op, kernel) launch too."""

        def __call__(self, op: str, kernel: str, variant) -> object:
            counts[(op, kernel)] += 1
            return super().__call__(op, kernel, variant)

    counts: Counter = Counter()
    cfg = ModelConfig.from_model_dir(config_dir)
    launcher = Counting(invariant)
    model = DeepseekV4(cfg, meta_weights(cfg, torch.bfloat16), table(launcher))
    per_seq = 9  # 1,152 positions a sequence: every compressor's window closes within
    cache = PagedCache(cfg, CacheSpec(num_blocks=batch * per_seq, max_seqs=batch, max_blocks_per_seq=per_seq),
                       torch.bfloat16, META)
    zeros = torch.zeros(batch, dtype=torch.long, device=META)
    model.decode(cache, DecodeInputs(zeros, zeros, zeros, torch.zeros(batch, per_seq, dtype=torch.long, device=META)))
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--config", default=str(ROOT / "benchmarks" / "configs" / "v4-flash-slice"))
    parser.add_argument("--invariant", action="store_true", help="the batch-invariant variants")
    args = parser.parse_args()
    counts = count(Path(args.config), args.batch, args.invariant)
    print(f"| op | kernel | launches a decode step (batch {args.batch}) |\n|---|---|---|")
    for (op, kernel), n in sorted(counts.items()):
        print(f"| {op} | {kernel} | {n} |")
    print(f"| all | | {sum(counts.values())} |")


if __name__ == "__main__":
    main()
