"""The mHC pre-block at prefill sizes in chunks of rows (`hc_pre.CHUNK_ROWS`): each chunk's partials kernel reads
its streams from HBM and the finishing kernel re-reads them for the collapse while they are still in L2; `hc_mid`'s
unfused form (prefill) also writes each chunk's new streams just before. One process, same inputs, every chunk
size side by side with the one-pass run and each kernel of the one-pass run alone.

    python -m benchmarks.hc_chunks [--rows 4096,16384] [--chunks 512,1024,2048] [--out results.json]

Bytes as `benchmarks/kernels.py` counts them (each input read once, each output written once); times are the
median of CUDA-graph replays.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
from pathlib import Path

import torch

from benchmarks.kernels import ROOT, copy_bandwidth, time_fn

H, N, MIX = 4096, 4, 24


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="4096,16384")
    parser.add_argument("--chunks", default="512,1024,2048")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from deepinfer.env import Env
    from tilekernels.kernels import kernel_launcher
    from tilekernels.ops import hc_mid, hc_mixes, hc_post, hc_pre

    launcher = kernel_launcher("sm90", Env.read().cache_dir)
    pre_launch, mid_launch = launcher.for_op("hc_pre"), launcher.for_op("hc_mid")
    copy_gbs = copy_bandwidth()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    print(f"# {torch.cuda.get_device_name()} | {datetime.date.today()} | commit {commit} | copy {copy_gbs:.0f} GB/s | "
          f"default chunk {hc_pre.CHUNK_ROWS} rows")
    print("| op | rows | chunk rows | ms | GB/s | of copy BW |")
    print("|---|---|---|---|---|---|")
    rows_out = []

    def record(label: str, t: int, chunk: int | str, ms: float, nbytes: int) -> None:
        gbs = nbytes / (ms * 1e-3) / 1e9
        rows_out.append(dict(op=label, rows=t, chunk_rows=chunk, ms=ms, gbs=gbs, copy_fraction=gbs / copy_gbs))
        print(f"| {label} | {t} | {chunk} | {ms:.4f} | {gbs:.0f} | {gbs / copy_gbs:.0%} |", flush=True)

    fn_bytes = 4 * MIX * N * H
    for t in [int(x) for x in args.rows.split(",")]:
        chunks = [t] + [int(c) for c in args.chunks.split(",") if int(c) < t]
        for norm in (False, True):
            torch.manual_seed(0)
            pre_args = hc_pre.example(hc_pre.Variant(N, H, 20, "bfloat16", norm=norm), t, "cuda")
            label = "hc_pre" + (" (normed)" if norm else "")
            pre_bytes = 2 * t * N * H + 2 * t * H + fn_bytes
            want = hc_pre.run(pre_launch, *pre_args, chunk_rows=t)
            for chunk in chunks:
                got = hc_pre.run(pre_launch, *pre_args, chunk_rows=chunk)
                assert all(torch.equal(g, w) for g, w in zip(got, want)), f"chunk {chunk}: outputs differ"
                record(label, t, chunk, time_fn(lambda: hc_pre.run(pre_launch, *pre_args, chunk_rows=chunk))[0],
                       pre_bytes)
            if not norm:  # each kernel of the one-pass run alone
                streams, fn, base, scale, iters, hc_eps, norm_eps = pre_args
                v = hc_pre.variant(streams, iters)
                s = streams.reshape(t, N * H)
                dots, sq = hc_mixes.partials(pre_launch, "hc_pre", v, s, fn)
                record("hc_pre_split alone", t, t, time_fn(lambda: hc_mixes.partials(pre_launch, "hc_pre", v, s, fn))[0],
                       2 * t * N * H + fn_bytes)
                record("hc_pre_finish alone", t, t, time_fn(
                    lambda: hc_pre.finish(pre_launch, v, s, dots, sq, base, scale, hc_eps, norm_eps))[0],
                    2 * t * N * H + 2 * t * H)
        torch.manual_seed(0)
        mid_args = hc_mid.example(hc_mid.Variant(N, H, "bfloat16", hc_mid.PART), t, "cuda")
        mid_bytes = 2 * t * 9 * H + 2 * t * H + fn_bytes
        want = hc_mid.run(mid_launch, *mid_args, chunk_rows=t)
        for chunk in chunks:
            got = hc_mid.run(mid_launch, *mid_args, chunk_rows=chunk)
            assert all(torch.equal(g, w) for g, w in zip(got, want)), f"hc_mid chunk {chunk}: outputs differ"
            record("hc_mid (post + pre)", t, chunk, time_fn(lambda: hc_mid.run(mid_launch, *mid_args,
                                                                                 chunk_rows=chunk))[0], mid_bytes)
        streams, out, post, comb = mid_args[:4]
        record("hc_post alone", t, t, time_fn(lambda: hc_post.run(launcher.for_op("hc_post"), streams, out, post,
                                                                  comb))[0], 2 * t * 9 * H)
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "date": str(datetime.date.today()),
                                              "commit": commit, "copy_gbs": copy_gbs,
                                              "default_chunk_rows": hc_pre.CHUNK_ROWS, "rows": rows_out}, indent=1))


if __name__ == "__main__":
    main()
