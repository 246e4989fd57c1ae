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


def test_v41_flash_is_763b_and_a_rank_of_eight_holds_an_eighth_of_its_experts_and_engram_tables():
    """V4.1-Flash: 762.7 B parameters, 474.7 GiB as loaded, 188.8 GiB of it the two Engram tables. At EP 8 a rank
    holds an eighth of the routed experts and of the tables' rows: 74.1 GiB, what the ranks' own fit check counts
    (`rank_share_v41`); with the tables whole it would be more than one H200."""
    import torch

    from deepinfer.assemble import v41_weight_bytes
    from deepinfer.config_v41 import read_config
    from deepinfer.parallel.config import ParallelConfig, Rank
    from deepinfer.parallel.experts import initial_placement
    from deepinfer.parallel.shard import rank_share_v41

    out = main(["--config", str(CONFIGS / "v41-flash"), "--ranks", "8"])
    assert round(out["parameters"] / 1e9, 1) == 762.7
    assert round(sum(out["classes"].values()) / GIB, 1) == 474.7
    assert round(out["classes"]["engram tables"] / GIB, 1) == 188.8
    assert round(out["per_rank"][8] / GIB, 1) == 74.1
    assert out["per_rank"][8] + out["classes"]["engram tables"] * 7 / 8 > 139.8 * GIB
    cfg = read_config(CONFIGS / "v41-flash")
    for r in (0, 7):
        rank = Rank(r, r, ParallelConfig(8, 1, True))
        share = rank_share_v41(cfg, rank, initial_placement(cfg.num_hidden_layers, cfg.n_routed_experts, 8, None))
        with torch.device("meta"):
            assert abs(v41_weight_bytes(cfg, torch.bfloat16, True, share) - out["per_rank"][8]) < 2**20
