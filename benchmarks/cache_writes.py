"""A decode step's cache-row writes at one token: `tensor[rows] = src` (index_put_) against `index_copy_`, each in a CUDA
graph of 200 writes (the decode graphs' setting), us per write. Shapes: the V4-Flash pool (512-wide rows of a 600K-row
cache) at 1 and 32 rows, and a CSA compressor ring (1024 wide). Run on the GPU host: `python benchmarks/cache_writes.py`."""
import torch


def timed(fn, n=200):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    g.replay(); torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(10):
        g.replay()
    e1.record(); torch.cuda.synchronize()
    return e0.elapsed_time(e1) / 10 / n * 1e3


if __name__ == "__main__":
    dev = torch.device("cuda")
    for rows, width, b in [(600_000, 512, 1), (600_000, 512, 32), (300, 1024, 1)]:
        pool = torch.zeros(rows, width, dtype=torch.bfloat16, device=dev)
        idx = torch.randint(0, rows, (b,), device=dev)
        src = torch.randn(b, width, device=dev).to(torch.bfloat16)
        a = timed(lambda: pool.__setitem__(idx, src))
        c = timed(lambda: pool.index_copy_(0, idx, src))
        print(f"rows {rows} width {width} batch {b}: index_put_ {a:.2f} us, index_copy_ {c:.2f} us")
