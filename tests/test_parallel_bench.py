"""`benchmarks/parallel_decode.py` (the whole V4-Flash on several GPUs) on the CPU: two gloo ranks of the tiny
model run each of its measurements through the same code the GPU run takes (its own launcher, each rank's
random weights with only its expert slots, the expert exchange timed alone), FP8 / FP4 and bf16, expert- and
tensor-parallel. Its GPU figures need a machine with several GPUs (BENCHMARKS.md)."""

from __future__ import annotations

import json

import pytest

from benchmarks.parallel_decode import main
from tests.helpers import TINY_A


@pytest.mark.parametrize("layout", [["--tp", "1"], ["--tp", "2", "--bf16"]], ids=["dp2+ep", "tp2+ep, bf16"])
def test_the_multi_gpu_benchmark_runs_on_two_cpu_ranks(tmp_path, layout):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_A))
    out = main(["--ranks", "2", *layout, "--backend", "reference", "--config", str(config), "--batches", "1,4",
                "--contexts", "256", "--prefill", "64", "--exchange-rows", "1,16", "--iters", "2",
                "--copy-gbs", "20", "--out", str(tmp_path / "out.json")])
    tp = int(layout[1])
    assert out["slots_per_rank"] == TINY_A["n_routed_experts"] // 2 and out["native"] == (tp == 1)
    assert [(r["context"], r["batch_per_gpu"]) for r in out["decode"]] == [(256, 1 / tp), (256, 4 / tp)]
    assert all(r["step_ms"] > 0 and 0 < r["floor_ms"] < r["step_ms"] for r in out["decode"])
    assert out["decode"][1]["floor_ms"] > out["decode"][0]["floor_ms"]  # more sequences: more cache rows read
    assert out["prefill"][0]["tokens"] == 64 and out["prefill"][0]["tok_s_per_gpu"] > 0
    for row in out["exchange"]:  # no dispatch without data-parallel ranks: every rank already has the rows
        assert row["combine_us"] > 0 and (row["dispatch_us"] > 0) == (tp == 1)
    assert json.loads((tmp_path / "out.json").read_text())["decode"] == out["decode"]
