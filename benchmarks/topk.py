"""The indexer's top-k: the op's kernel (`tilekernels/ops/indexer_topk.py`: radix select, then a bitonic sort of
the picks) against its reference (PyTorch's stable sort, what ran before), each in a CUDA graph of 20 calls, us per
call, with the picks compared bit for bit. Shapes: V4-Flash's k 512 over the entries of a 4K, 64K and 80K context
(1,024, 16,384 and 20,480 at rate 4: the last takes two of the kernel's shared-memory tiles), rows seeing every entry
or a 4K context's 1,024 of them (a decode step's table is as wide as the longest sequence), 1-128 rows, and a
prefill's 4,096 rows over 1,024 entries.

    python -m benchmarks.topk [--out results.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
from pathlib import Path

import torch

from benchmarks.cache_writes import timed
from benchmarks.kernels import ROOT

K = 512


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from deepinfer.env import Env
    from tilekernels.kernels import kernel_table
    from tilekernels.ops import indexer_topk

    ops = kernel_table("sm90", Env.read().cache_dir)
    dev = torch.device("cuda")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    print(f"# {torch.cuda.get_device_name()} | {datetime.date.today()} | commit {commit} | k {K}")
    print("| entries | visible | rows | stable sort us | kernel us | speed-up | same picks |")
    print("|---|---|---|---|---|---|---|")
    rows_out = []
    cases = [(e, v, r) for e in (1024, 16384, 20480) for v in ("all", 1024) for r in (1, 8, 32, 128)
             if not (v == 1024 and e == 1024)] + [(1024, "all", 4096)]
    for entries, seen, rows in cases:
        torch.manual_seed(rows)
        scores = torch.randn(rows, entries, device=dev)
        visible = torch.full((rows,), entries if seen == "all" else seen, dtype=torch.long, device=dev)
        same = torch.equal(ops.indexer_topk(scores, visible, K), indexer_topk.reference(scores, visible, K))
        sort = timed(lambda: indexer_topk.reference(scores, visible, K), 20)
        kern = timed(lambda: ops.indexer_topk(scores, visible, K), 20)
        rows_out.append(dict(entries=entries, visible=seen, rows=rows, sort_us=sort, kernel_us=kern, same=same))
        print(f"| {entries} | {seen} | {rows} | {sort:.1f} | {kern:.1f} | {sort / kern:.2f}x | {same} |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "date": str(datetime.date.today()),
                                              "commit": commit, "k": K, "rows": rows_out}, indent=1))


if __name__ == "__main__":
    main()
