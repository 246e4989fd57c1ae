"""Launch chosen `benchmarks/tune_linear.py` candidates (and cuBLAS beside each) a few times, for Nsight Compute:

    ncu --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis \\
        -k kernel_kernel -c 1 python benchmarks/profile_linear.py current:q_b:4096
    ncu ... -k regex:'gemm|nvjet' -c 1 python benchmarks/profile_linear.py current:q_b:4096   # cuBLAS's kernel

Each argument is LABEL:SHAPE:ROWS (a tune_linear candidate label, one of its SHAPES, a prefill row count). The
candidates must be built in DEEPINFER_CACHE_DIR first (`tune_linear.py --only LABEL --build-only`). BENCHMARKS.md
nineteenth round: the profiles it gave on the H100."""

import sys


def main(specs: list[str]) -> None:
    import torch

    import backends
    from benchmarks.tune_linear import SHAPES, candidate_request, kernel_name, variant_of
    from codegen import Compiler
    from deepinfer.env import Env
    from tilekernels.ops import linear

    compiler = Compiler(backends.get("sm90"), Env.read().cache_dir)
    for spec in specs:
        label, shape, rows = spec.split(":")
        (n, k), m = SHAPES[shape], int(rows)
        v = variant_of(m, n, k)
        if v is None:
            raise SystemExit(f"{spec}: {m} rows is not a prefill row count (more than linear.ROW_BUCKETS[1])")
        kernel = compiler.load(candidate_request("linear", kernel_name(label), v))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        for _ in range(3):
            linear.gemm(lambda *_: kernel, x, w, v)
        torch.nn.functional.linear(x, w)
        torch.cuda.synchronize()
        print("ran", spec, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
