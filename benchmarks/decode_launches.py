"""The TileLang kernel launches of one decode step, by op and kernel, counted on the CPU: the model runs on meta
tensors (no memory, no compute, as the compile plan traces it) through a launcher that counts what each op's `run`
launches. `--glue` also lists PyTorch's own ops between the kernels (the glue `benchmarks/profile_ops.py` times on
the GPU) by the source line that calls them; ops that launch no kernel (views, allocations, same-type casts) are
left out, so the count is close to, not exactly, the GPU's. A check of a fusion without a device, and the kernel
count behind a step's latency at small batch. The step's inputs are the engine's (the host-made rows included).

    python benchmarks/decode_launches.py [--batch 1] [--config benchmarks/configs/v4-flash-slice] [--invariant] [--glue]
                                         [--quantized]
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


NO_KERNEL = {"empty", "empty_strided", "view", "_unsafe_view", "as_strided", "expand", "slice", "select",
             "unsqueeze", "squeeze", "t", "transpose", "permute", "reshape", "alias", "detach", "split",
             "split_with_sizes", "unbind", "narrow", "lift_fresh", "new_empty", "empty_like", "unfold", "diagonal",
             "view_as", "to", "contiguous"}


class Glue(TorchDispatchMode):
    """Counts the PyTorch ops that launch kernels, by (op, the deepinfer / tilekernels source line calling it)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_KERNEL:
            frames = [f for f in traceback.extract_stack()
                      if "/deepinfer/" in f.filename or "/tilekernels/" in f.filename]
            at = Path(frames[-1].filename) if frames else None
            self.counts[(name, f"{at.parent.name}/{at.name}:{frames[-1].lineno}" if frames else "?")] += 1
        return func(*args, **(kwargs or {}))


def count(config_dir: Path, batch: int, invariant: bool, glue: Glue | None = None, quantized: bool = False) -> Counter:
    from deepinfer.compile.plan import META, meta_weights
    from deepinfer.model.host_rows import HostRows
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
    if quantized:  # V4's FP8 / FP4 formats, kept quantized (as benchmarks/decode.py --quantized runs them)
        from deepinfer.weights.synthetic import with_quantization

        cfg = with_quantization(cfg)
    launcher = Counting(invariant)
    model = DeepseekV4(cfg, meta_weights(cfg, torch.bfloat16, quantized), table(launcher))
    per_seq = 9  # 1,152 positions a sequence: every compressor's window closes within
    cache = PagedCache(cfg, CacheSpec(num_blocks=batch * per_seq, max_seqs=batch, max_blocks_per_seq=per_seq),
                       torch.bfloat16, META)
    zeros = torch.zeros(batch, dtype=torch.long, device=META)
    host_rows = HostRows(cache.layout.layers, batch)
    given = host_rows.device(torch.empty(host_rows.nbytes, dtype=torch.uint8, device=META))
    kept = host_rows.buffers(batch, per_seq, META)
    inputs = DecodeInputs(zeros, zeros, zeros, torch.zeros(batch, per_seq, dtype=torch.long, device=META), given, kept)
    with glue if glue is not None else torch.no_grad():
        model.decode(cache, inputs)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--config", default=str(ROOT / "benchmarks" / "configs" / "v4-flash-slice"))
    parser.add_argument("--invariant", action="store_true", help="the batch-invariant variants")
    parser.add_argument("--glue", action="store_true", help="also the PyTorch ops between the kernels, by source line")
    parser.add_argument("--quantized", action="store_true", help="V4's FP8 / FP4 weights kept quantized")
    args = parser.parse_args()
    glue = Glue() if args.glue else None
    counts = count(Path(args.config), args.batch, args.invariant, glue, args.quantized)
    print(f"| op | kernel | launches a decode step (batch {args.batch}) |\n|---|---|---|")
    for (op, kernel), n in sorted(counts.items()):
        print(f"| {op} | {kernel} | {n} |")
    print(f"| all | | {sum(counts.values())} |")
    if glue is not None:
        print(f"\n| PyTorch op | called from | a decode step (batch {args.batch}) |\n|---|---|---|")
        for (name, where), n in sorted(glue.counts.items(), key=lambda item: item[0][1]):
            print(f"| {name} | {where} | {n} |")
        print(f"| all | | {sum(glue.counts.values())} |")


if __name__ == "__main__":
    main()
