"""Launch the engine's block-scaled FP8 GEMM (the `linear` op's sm90 kernel at V4's ue8m0 scales) and cuBLAS's own
block-scaled FP8 (torch `scaled_mm`) beside it a few times each, for Nsight Compute:

    ncu --section SpeedOfLight --section WarpStateStats -k kernel_kernel -c 1 python benchmarks/profile_fp8.py q_b:4096
    python benchmarks/profile_fp8.py --names q_b:4096      # the CUDA kernels' names (cuBLAS's, for ncu -k)

Each argument is SHAPE:ROWS, SHAPE one of `benchmarks/tune_fp8.py`'s (groups of 1). The activations are quantized
once before the launches (PyTorch's `act_quant` reference), so the only TileLang kernel launched is the GEMM."""

import sys


def main(specs: list[str], names: bool) -> None:
    import torch

    from benchmarks.tune_fp8 import SHAPES, torch_blockwise
    from deepinfer.env import Env
    from tilekernels.kernels import kernel_launcher
    from tilekernels.ops import act_quant, linear, linear_fp8
    from tilekernels.quant import scale_to_float

    launcher = kernel_launcher("sm90", Env.read().cache_dir).for_op("linear")
    shapes = {name: (n, k) for name, n, k, groups in SHAPES if groups == 1}
    for spec in specs:
        shape, rows = spec.split(":")
        (n, k), m = shapes[shape], int(rows)
        v = linear_fp8.Variant(n, k, "bfloat16", (128, 128), ue8m0=True)
        x, w = linear.example(v, m, torch.device("cuda"))
        codes, scales, ue8m0 = linear_fp8.weight_operands(w)
        a8, sa = act_quant.reference(x, 128, ue8m0)
        a, sa2 = a8.view(torch.uint8), sa.contiguous()
        kernel = launcher("gemm_fp8", linear_fp8.variant(m, n, k, (128, 128), ue8m0))
        y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        cublas, how = torch_blockwise(a8, sa, w.values, scale_to_float(w.scales))  # cuBLAS wants fp32 scales

        def run_all():
            for _ in range(3):
                kernel(a, sa2, codes, scales, y)
            for _ in range(3 if cublas else 0):
                cublas()
            torch.cuda.synchronize()

        if names:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                run_all()
            print("\n".join(sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})), flush=True)
        else:
            run_all()
        print("ran", spec, "cuBLAS:", how, flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    main([a for a in args if a != "--names"], "--names" in args)
