"""The host time of confidence-sized verification's admission (`runtime/spec_budget.py` `verify_budget` with a
`StepCosts` of graph buckets), per verify step, by batch: the work a sized step does on the host between two device
steps, which a fixed draft length does not do. CPU only (no model); run it on the machine whose host drives the GPU
to know its share of a step.

    python benchmarks/spec_budget.py [--batches 1,8,32,64] [--drafts 5] [--calls 2000] [--commit SHA] [--out J]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--drafts", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from deepinfer.runtime.graph import batch_buckets
    from deepinfer.runtime.spec_budget import StepCosts, verify_budget

    rng = random.Random(0)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        costs = StepCosts(batch_buckets(batch * (1 + args.drafts)))
        # a step's replay grows with its rows, its host share is flat (as profiled and measured on the H200)
        costs.device = {b: 2.5e-3 + 2e-5 * b for b in costs.buckets}
        costs.host = {b: 3e-4 for b in costs.buckets}
        cases = [[[rng.betavariate(1.6, 0.4) for _ in range(args.drafts)] for _ in range(batch)] for _ in range(50)]
        for case in cases[:5]:
            verify_budget(case, costs, costs.steps)
        begin = time.perf_counter()
        for i in range(args.calls):
            verify_budget(cases[i % len(cases)], costs, costs.steps)
        us = 1e6 * (time.perf_counter() - begin) / args.calls
        rows.append({"batch": batch, "drafts": args.drafts, "us_per_step": us})
        print(f"batch {batch} x {args.drafts} drafts: {us:.1f} us per admission", flush=True)
    result = {"host": f"{platform.processor() or platform.machine()}, Python {platform.python_version()}",
              "date": str(datetime.date.today()), "commit": args.commit, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
