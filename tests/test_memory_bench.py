"""`benchmarks/memory.py`: the whole models' weight memory from their configs, on one device and a rank of N with
the routed experts split (what issue 17's "V4.1-Flash at EP 8 if it fits" asks first)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.memory import main

CONFIGS = Path(__file__).resolve().parents[1] / "benchmarks" / "configs"
GIB = 2**30


def test_v4_flash_needs_two_devices_and_a_rank_of_two_holds_half_its_experts():
    out = main(["--config", str(CONFIGS / "v4-flash.json"), "--ranks", "1,2"])
    total, experts = sum(out["classes"].values()), out["classes"]["fp4 experts"]
    assert 1.0 < total / (139.8 * GIB) < 1.1 and experts > 0.9 * total  # 145.5 GiB, experts the bulk
    assert out["per_rank"][2] == total - experts / 2


def test_v41_flash_is_763b_and_its_engram_tables_keep_a_rank_of_eight_over_one_device():
    """V4.1-Flash: 762.7 B parameters, 474.7 GiB as loaded; at EP 8 a rank still holds both Engram tables whole
    (188.8 GiB), more than one H200."""
    out = main(["--config", str(CONFIGS / "v41-flash"), "--ranks", "8"])
    assert round(out["parameters"] / 1e9, 1) == 762.7
    assert round(sum(out["classes"].values()) / GIB, 1) == 474.7
    assert out["per_rank"][8] > 139.8 * GIB > out["per_rank"][8] - out["classes"]["engram tables"]
