"""The kernel plan of one rank of several (`compile.plan_ranks`): its own model traced (its heads, its expert
slots over every data-parallel rank's rows), so that a rank's first request builds and loads nothing; kept in
the kernel cache under its layout."""

from __future__ import annotations

from deepinfer.compile.plan import kernel_plan
from deepinfer.compile.ready import model_plan
from deepinfer.config import ModelConfig
from deepinfer.parallel.config import ParallelConfig
from tests.helpers import TINY_A

CFG = ModelConfig.from_dict(TINY_A)  # 4 heads, 2 output groups, 8 routed experts


def experts_of(plan) -> set[int]:
    return {v.experts for op, kernel, v in plan if op == "moe_experts" and hasattr(v, "experts")}


def query_heads(plan) -> set[int]:
    """Heads of the query's norm-and-RoPE kernel (one per attention head of the rank)."""
    return {v.heads for op, kernel, v in plan if op == "rope" and v.norm}


def test_a_tensor_and_expert_parallel_rank_plans_its_heads_and_slots():
    whole = kernel_plan(CFG, "bfloat16")
    rank = kernel_plan(CFG, "bfloat16", None, False, (ParallelConfig(1, 2, True), 0))
    assert experts_of(whole) == {8} and experts_of(rank) == {4}  # 4 slots a rank: the whole 8 never run there
    assert query_heads(whole) == {4} and query_heads(rank) == {2}  # half the heads
    assert not [item for item in whole if item[0] in ("rms_norm", "hc_pre") and item not in rank]  # the rest as is


def test_data_parallel_ranks_plan_their_slots_with_redundant_ones():
    """(8 experts + 2 redundant) over 2 ranks: 5 slots a rank; without split experts, the whole model's plan."""
    assert experts_of(kernel_plan(CFG, "bfloat16", None, False, (ParallelConfig(2, 1, True), 2))) == {5}
    assert kernel_plan(CFG, "bfloat16", None, False, (ParallelConfig(2, 1, False), 0)) == kernel_plan(CFG, "bfloat16")


def test_a_ranks_plan_is_kept_under_its_layout(tmp_path):
    one = model_plan(CFG, "bfloat16", False, tmp_path)
    ranks = model_plan(CFG, "bfloat16", False, tmp_path, False, (ParallelConfig(1, 2, True), 0))
    assert experts_of(one) == {8} and experts_of(ranks) == {4} and len(list((tmp_path / "plans").iterdir())) == 2
    assert model_plan(CFG, "bfloat16", False, tmp_path, False, (ParallelConfig(1, 2, True), 0)) == ranks


def test_a_v41_rank_plans_its_heads_and_slots():
    """DeepSeek-V4.1 (fixture `a`: 4 heads, 6 experts) at tensor-parallel 2 with the experts split: 3 slots a rank,
    its query's RoPE at 2 heads."""
    import json

    from deepinfer.config_v41 import V41Config
    from tests.v41_fixture import FIXTURES

    cfg = V41Config.from_dict(json.loads((FIXTURES / "a" / "config.json").read_text()))
    whole = kernel_plan(cfg, "bfloat16")
    rank = kernel_plan(cfg, "bfloat16", None, False, (ParallelConfig(1, 2, True), 0))
    assert experts_of(whole) == {6} and experts_of(rank) == {3}
    heads = lambda plan: {v.heads for op, _, v in plan if op == "rope" and v.dim == cfg.head_dim}  # noqa: E731
    assert max(heads(whole)) == 4 and max(heads(rank)) == 2  # the query's (the shared K=V head's is 1)


def test_compile_builds_one_ranks_plan_with_the_layout_flags(tmp_path, monkeypatch):
    """`deepinfer compile --tensor-parallel-size 2 --enable-expert-parallel`: what one rank builds at start (the
    builder stubbed: the items it is handed)."""
    from click.testing import CliRunner

    import deepinfer.compile.prebuild as prebuild
    from deepinfer.cli import main

    handed = []
    monkeypatch.setattr(prebuild, "build_kernels", lambda target, items, out, jobs: handed.extend(items) or [])
    result = CliRunner().invoke(main, ["compile", "--target", "c", "--out", str(tmp_path), "--tensor-parallel-size",
                                       "2", "--enable-expert-parallel"])
    assert result.exit_code == 0, result.output
    assert "one rank of 2" in result.output and experts_of(handed) == {4}  # the tiny default model's 8 over 2 ranks
