"""FP4 routed-expert GEMMs of one V4-Flash layer (256 experts, hidden 4096, intermediate 2048, top 6) at decode
and prefill sizes on the H200: a small sweep of the sm_90a FP4 kernel (tilekernels/ops/moe_fp4.py, on the plain
or the K-permuted layout of moe_fp4_sm90) against the PyTorch reference and the bf16 grouped GEMM, in GB/s of the
weight bytes the batch touches and as a fraction of the copy bandwidth measured here.

    python benchmarks/fp4_experts.py [--tokens 1,8,64] [--only default,half] [--jobs 8] [--iters 40]
    python benchmarks/fp4_experts.py --tokens 256,4096 --only default,p_kperm1_s2_mb2,p_kperm1_s3_mb1,...

Each token count runs the op's variant for it (`moe_experts.variant`: 16-row tiles up to DECODE_TOKENS tokens,
64-row tiles above, as the engine); a candidate's tile is its change to the engine's tile of that height
(moe_fp4.TUNE / PREFILL_TUNE), so "default" is today's kernel at either size.

Kernels are compiled on this host (nvcc, `--jobs` worker processes) into DEEPINFER_CACHE_DIR, as the engine
does. Per token count and GEMM (gate_up: N=4096, K=4096; down: N=4096, K=2048), with random top-6 routing:
- correctness: the kernel's rows against a float32 reference of the same rows (activations @ dequantized
  weights of each row's expert; up to 64 experts per check): max |err| / max |ref|, which must stay within `TOL` (bf16 output rounding
  is 2^-9 relative; accumulation order adds a little);
- time: CUDA events around the kernel alone, L2 flushed before every call (a 256 MiB write), median of
  `--iters`;
- bytes: the FP4 values + ue8m0 exponents of the experts the batch routes to (each read once, ideally).
The whole op (`ops.moe_experts`, layout + both GEMMs + SwiGLU + combine) is timed too, FP4 and bf16.
Results: a table on stdout and JSON in $OUT/fp4.json (or --out).
"""

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

E, H, I, TOP = 256, 4096, 2048, 6
GEMMS = {"gate_up": (2 * I, H), "down": (H, I)}  # name -> (N, K)
TOL = 1e-2  # max |err| / max |ref| for bf16 outputs of fp32 accumulations
OP = "moe_experts"

# The sweep: the default tile first, then one change at a time (each is two builds: gate_up and down).
CANDIDATES = {
    "default": {},
    "half": {"decode": "half"},
    "bn128": {"block_n": 128, "threads": 256, "stages": 3, "min_blocks": 2},
    "bk128": {"block_k": 128, "stages": 6},
    "ws": {"warp_specialized": True, "min_blocks": 2},
    # moe_fp4_sm90: weights/exponents K-permuted once (moe_fp4.repack_for), 16-byte loads, word-wide decode
    "kperm": {"decode": "kperm"},  # two bf16x2 multiplies per pair: any exponent byte 1..254
    "kperm1": {"decode": "kperm1"},  # one multiply: exponent bytes <= 128 (repack checks)
    "kperm1_mb4": {"decode": "kperm1", "stages": 3, "min_blocks": 4},
    "kperm1_bk512": {"decode": "kperm1", "block_k": 512, "stages": 2},
    # two warpgroups (128 weight rows) share each activation tile: half the activation reads per weight byte
    "kperm1_bn128": {"decode": "kperm1", "block_n": 128, "threads": 256, "stages": 3, "min_blocks": 2},
    "kperm1_bn128_s4": {"decode": "kperm1", "block_n": 128, "threads": 256, "stages": 4, "min_blocks": 2},
    # 64-row tiles (prefill token counts) on the repacked layout (block_k 256, as the decode tile's): 32 KB of
    # activations + 8 KB of weights a stage; against "default" there (moe_fp4.PREFILL_TUNE, plain layout)
    "p_kperm1_s2_mb2": {"decode": "kperm1", "block_k": 256, "stages": 2, "min_blocks": 2},
    "p_kperm1_s3_mb1": {"decode": "kperm1", "block_k": 256, "stages": 3, "min_blocks": 1},
    "p_kperm_s2_mb2": {"decode": "kperm", "block_k": 256, "stages": 2, "min_blocks": 2},
    "p_kperm_s3_mb1": {"decode": "kperm", "block_k": 256, "stages": 3, "min_blocks": 1},
    "p_kperm1_bn128_s2": {"decode": "kperm1", "block_n": 128, "threads": 256, "block_k": 256, "stages": 2,
                          "min_blocks": 1},
    # 8-row tiles at decode sizes (wgmma n8; TILE_ROWS): half the activation tile, so deeper weight pipelines fit
    "kperm1_bm8": {"decode": "kperm1", "stages": 3, "min_blocks": 4},
    "kperm1_bm8_s4": {"decode": "kperm1", "stages": 4, "min_blocks": 3},
    "kperm1_bm8_s5": {"decode": "kperm1", "stages": 5, "min_blocks": 3},
    # what the engine runs with moe_fp4.REPACKED (moe_fp4.kperm_tune: KPERM_TUNE / KPERM_PREFILL_TUNE, "kperm1")
    "engine_kperm1": "kperm_tune",
}
TILE_ROWS = {"kperm1_bm8": 8, "kperm1_bm8_s4": 8, "kperm1_bm8_s5": 8}  # candidates' own decode tile height
# candidates whose tile cannot take 64 rows (skipped at prefill sizes): those with their own decode height too
DECODE_ONLY = ("kperm1_mb4", *TILE_ROWS)


def tune_of(candidate: str, block_m: int):
    """The tile of `candidate` for `block_m`-row tiles: its changes to the engine's tile for that size
    (moe_fp4.TUNE at decode, moe_fp4.PREFILL_TUNE at prefill sizes)."""
    from tilekernels.ops import moe_fp4

    if CANDIDATES[candidate] == "kperm_tune":
        return moe_fp4.kperm_tune(block_m, "kperm1")
    return moe_fp4.Tune(**{**moe_fp4.tune_for(block_m).__dict__, **CANDIDATES[candidate]})


def make_request(op: str, kernel: str, variant):
    """Build request of one item; kernel "grouped_gemm_fp4@<candidate>" is the decode kernel with that tile,
    anything else the op's own kernel (what the engine builds). Module level: the build workers import it."""
    from codegen import Request
    from tilekernels.kernels import request
    from tilekernels.lang import Facade
    from tilekernels.ops import moe_fp4

    if "@" not in kernel:
        return request(op, kernel, variant)
    tune = tune_of(kernel.split("@")[1], variant.block_m)
    return Request(op, kernel, variant, lambda t: moe_fp4.body_decode(Facade(t.traits), variant, None, tune),
                   lambda t: tune.pass_configs)


def timed(fn, flush: torch.Tensor, iters: int) -> float:
    """Median ms of fn() over iters calls, each after an L2 flush (outside the timed interval)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        flush.add_(1)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth() -> float:
    """GB/s of a 2 GiB device-to-device copy (bytes read + written / time), median of 10."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), torch.zeros(1, device="cuda"), 10)
    return 2 * (2 << 30) / ms / 1e6


class Gemm:
    """One expert GEMM's operands at one token count, in the expert-major layout of tile `bm`."""

    def __init__(self, idx, x, weights, bm: int, fp4: bool, kernel_weights=None):
        from tilekernels.ops import moe_experts

        n = weights[0].shape[1]
        self.dest, self.tiles = moe_experts.layout(idx, E, bm)
        rows = self.tiles.numel() * bm
        token_of = torch.arange(idx.shape[0], device=x.device).repeat_interleave(idx.shape[1])
        self.a = torch.zeros(rows, x.shape[1], dtype=x.dtype, device=x.device)
        self.a[self.dest] = x[token_of]
        self.c = torch.empty(rows, n, dtype=torch.bfloat16, device=x.device)
        self.weights, self.fp4, self.bm = weights, fp4, bm  # the reference's operands
        self.kernel_weights = kernel_weights or weights  # the kernel's (a repacked layout for some candidates)
        self.experts = idx.reshape(-1)

    def args(self):
        return (self.a, *self.kernel_weights, self.tiles, self.c)

    def error(self, max_experts: int = 64) -> float:
        """max |kernel - reference| / max |reference| over the rows of (at most max_experts, drawn at random)
        routed experts."""
        from tilekernels.quant import unpack_fp4

        err = ref_max = 0.0
        experts = self.experts.unique()
        for e in experts[torch.randperm(experts.numel(), device=experts.device)[:max_experts]].tolist():
            rows = self.dest[self.experts == e]
            if self.fp4:
                vals, exps = self.weights[0][e], self.weights[1][e]
                w = unpack_fp4(vals) * (exps.float() - 127).exp2().repeat_interleave(32, dim=-1)
            else:
                w = self.weights[0][e].float()
            ref = self.a[rows].float() @ w.T
            err = max(err, (self.c[rows].float() - ref).abs().max().item())
            ref_max = max(ref_max, ref.abs().max().item())
        return err / max(ref_max, 1e-30)

    def touched_bytes(self) -> int:
        per = sum(t[0].numel() * t.element_size() for t in self.weights if t.dim() == 3)
        return int(self.experts.unique().numel()) * per


def main() -> None:
    import backends
    from codegen import Compiler
    from codegen.driver import build_all
    from deepinfer.env import Env
    from tilekernels.kernels import kernel_table
    from tilekernels.ops import moe_experts, moe_fp4
    from tilekernels.quant import FP4_BLOCK, BlockQuantized

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,8,64")
    parser.add_argument("--only", default="", help="comma-separated candidates (default: all)")
    parser.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--no-op", action="store_true", help="skip the whole-op timings")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "fp4.json")
    args = parser.parse_args()
    names = [n for n in (args.only.split(",") if args.only else CANDIDATES) if n]
    tokens = [int(t) for t in args.tokens.split(",")]
    cache = Env.read().cache_dir
    t0 = time.perf_counter()

    # Build everything first, in parallel worker processes. The variants are the op's at each token count
    # (moe_experts.variant: 16-row tiles up to DECODE_TOKENS tokens, 64-row ones above), as the engine runs them.
    sizes = sorted({moe_experts.variant(1, 32, E, "bfloat16", fp4=True, tokens=t).block_m for t in tokens})
    fp4_v = {(g, bm): moe_experts.Variant(n, k, E, "bfloat16", bm, True) for g, (n, k) in GEMMS.items() for bm in sizes}
    bf16_v = {g: moe_experts.variant(n, k, E, "bfloat16") for g, (n, k) in GEMMS.items()}  # 64-row tiles, as before

    def runs(c, bm) -> bool:
        return not (bm > moe_experts.DECODE_BLOCK_M and c in DECODE_ONLY)

    def cand_v(c, g, bm):  # a candidate's variant: the engine's, or its own tile height at decode sizes
        n, k = GEMMS[g]
        return moe_experts.Variant(n, k, E, "bfloat16", TILE_ROWS[c], True) if c in TILE_ROWS else fp4_v[g, bm]

    items = [(OP, f"grouped_gemm_fp4@{c}", cand_v(c, g, bm)) for c in names for g in GEMMS for bm in sizes
             if runs(c, bm)]
    items += [(OP, "grouped_gemm", bf16_v[g]) for g in GEMMS]
    items += [] if args.no_op else [(OP, "grouped_gemm_fp4", fp4_v[key]) for key in fp4_v]  # what the op launches
    built = build_all("sm90", items, "benchmarks.fp4_experts:make_request", cache, jobs=args.jobs)
    failed = {(r.kernel, r.variant["n"], r.variant["k"], r.variant["block_m"]): r.notes.get("error", r.path)
              for r in built if r.status == "failed"}
    for key, why in failed.items():
        print(f"BUILD FAILED {key}: {why}", flush=True)
    print(f"built {len(items)} kernels in {time.perf_counter() - t0:.0f} s", flush=True)
    compiler = Compiler(backends.get("sm90"), cache)

    def load(kernel, v):
        return None if (kernel, v.n, v.k, v.block_m) in failed else compiler.load(make_request(OP, kernel, v))

    dev = torch.device("cuda")
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth()
    print(f"copy bandwidth {copy_gbs:.0f} GB/s ({torch.cuda.get_device_name()})", flush=True)
    flush = torch.empty(64 << 20, dtype=torch.float32, device=dev)  # 256 MiB > the 50 MiB L2
    # Random codes (every e2m1 value) and exponents near real checkpoints' (2^-8 .. 2^-5).
    fp4_w = {g: (torch.randint(0, 256, (E, n, k // 2), dtype=torch.uint8, device=dev),
                 torch.randint(119, 123, (E, n, k // FP4_BLOCK[1]), dtype=torch.uint8, device=dev))
             for g, (n, k) in GEMMS.items()}
    bf16_w = {g: (torch.randn(E, n, k, dtype=torch.bfloat16, device=dev) / k**0.5,) for g, (n, k) in GEMMS.items()}

    repacked = {}  # (gemm, candidate's layout) -> the kernel's weight operands

    def kernel_weights(g, kernel, bm):
        if "@" not in kernel or not tune_of(kernel.split("@")[1], bm).repacked:
            return None
        tune = tune_of(kernel.split("@")[1], bm)
        key = (g, tune.block_k, tune.decode)
        if key not in repacked:
            repacked[key] = moe_fp4.repack_for(tune, *fp4_w[g])
        return repacked[key]

    rows = []
    for t in tokens:
        x = torch.randn(t, H, device=dev).to(torch.bfloat16)
        idx = torch.rand(t, E, device=dev).topk(TOP, dim=-1).indices
        for g, (n, k) in GEMMS.items():
            xg = x if k == H else torch.randn(t, k, device=dev).to(torch.bfloat16)
            bm = moe_experts.variant(n, k, E, "bfloat16", fp4=True, tokens=t).block_m
            for kind, kernel, v, w in ([("fp4", f"grouped_gemm_fp4@{c}", cand_v(c, g, bm), fp4_w[g])
                                        for c in names if runs(c, bm)] +
                                       [("bf16", "grouped_gemm", bf16_v[g], bf16_w[g])]):
                row = {"tokens": t, "gemm": g, "n": n, "k": k, "kernel": kernel, "block_m": v.block_m}
                try:
                    fn = load(kernel, v)
                    if fn is None:
                        raise RuntimeError(f"build failed: {failed[(kernel, v.n, v.k, v.block_m)]}")
                    kw = kernel_weights(g, kernel, bm) if kind == "fp4" else None
                    gm = Gemm(idx, xg, w, v.block_m, kind == "fp4", kw)
                    fn(*gm.args())
                    torch.cuda.synchronize()
                    rel = gm.error()
                    ms = timed(lambda fn=fn, gm=gm: fn(*gm.args()), flush, args.iters)
                    gbs = gm.touched_bytes() / ms / 1e6
                    row.update(experts=int(gm.experts.unique().numel()), tiles=int(gm.tiles.numel()),
                               rel_err=float(f"{rel:.3g}"), ok=rel <= TOL, us=round(ms * 1e3, 2),
                               GBps=round(gbs, 1), of_copy=round(gbs / copy_gbs, 3))
                except Exception as exc:  # noqa: BLE001 (keep going: one bad candidate must not cost the rest)
                    row.update(error=f"{type(exc).__name__}: {str(exc)[:300]}")
                rows.append(row)
                print(json.dumps(row), flush=True)

    op_rows = []
    if not args.no_op:  # the whole op as the engine runs it (default decode tile, layout, SwiGLU, combine)
        ops = kernel_table("sm90", cache)
        q = {g: BlockQuantized(fp4_w[g][0], fp4_w[g][1], FP4_BLOCK, "fp4") for g in GEMMS}
        saved, moe_fp4.REPACKED = moe_fp4.REPACKED, True  # the op on the layout the switch gives (kperm1 here)
        qr = {g: moe_experts.kernel_layout(w, backends.get("sm90")) for g, w in q.items()}
        moe_fp4.REPACKED = saved
        for t in tokens:
            x = torch.randn(t, H, device=dev).to(torch.bfloat16)
            idx = torch.rand(t, E, device=dev).topk(TOP, dim=-1).indices
            wts = torch.softmax(torch.randn(t, TOP, device=dev), -1)
            row = {"tokens": t}
            for kind, (up, down) in (("fp4", (q["gate_up"], q["down"])), ("fp4_repacked", (qr["gate_up"], qr["down"])),
                                     ("bf16", (bf16_w["gate_up"][0], bf16_w["down"][0]))):
                try:
                    ms = timed(lambda x=x, wts=wts, idx=idx, up=up, down=down: ops.moe_experts(x, wts, idx, up, down, 10.0),
                               flush, args.iters)
                    row[f"{kind}_op_us"] = round(ms * 1e3, 1)
                except Exception as exc:  # noqa: BLE001
                    row[f"{kind}_op_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            op_rows.append(row)
            print(json.dumps(row), flush=True)

    print(f"\n{'tokens':>6} {'gemm':>8} {'kernel':>26} {'err':>8} {'us':>9} {'GB/s':>8} {'of copy':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['tokens']:>6} {r['gemm']:>8} {r['kernel']:>26}  ERROR {r['error'][:80]}")
        else:
            print(f"{r['tokens']:>6} {r['gemm']:>8} {r['kernel']:>26} {r['rel_err']:>8.2g}{'' if r['ok'] else '!'}"
                  f" {r['us']:>9.1f} {r['GBps']:>8.0f} {r['of_copy']:>8.1%}")
    def height(r):  # the engine's tile height at the row's token count (TILE_ROWS' 8-row tiles compete at decode)
        return max(r["block_m"], moe_experts.DECODE_BLOCK_M)

    best = {}  # per tile height: the candidates correct at every token count of that height, summed us
    for bm in sizes:
        for c in names:
            mine = [r for r in rows if r["kernel"] == f"grouped_gemm_fp4@{c}" and height(r) == bm]
            if mine and all(r.get("ok") for r in mine):
                best.setdefault(str(bm), {})[c] = round(sum(r["us"] for r in mine), 1)
    for bm, totals in best.items():
        pick = min(totals, key=totals.get)
        tune = tune_of(pick, int(bm))
        print(f"\n{bm}-row tiles: total us over their rows (correct candidates): {totals}\nfastest correct: {pick} = "
              f"{tune}" + (" (repacked weights: moe_fp4.KPERM_TUNE / KPERM_PREFILL_TUNE with moe_fp4.REPACKED)"
                           if tune.repacked else ""))
    result = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
              "copy_GBps": round(copy_gbs, 1), "tolerance": TOL, "default_tune": moe_fp4.TUNE.__dict__,
              "prefill_tune": moe_fp4.PREFILL_TUNE.__dict__,
              "candidates": CANDIDATES, "rows": rows, "op_rows": op_rows, "total_us_by_block_m_and_candidate": best,
              "seconds": round(time.perf_counter() - t0, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out} ({result['seconds']} s)")


if __name__ == "__main__":
    main()
