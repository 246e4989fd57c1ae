"""DeepSeek-V4.1 on several ranks (gloo on the CPU, deepinfer's own launcher): data-parallel 2 with the routed
experts split (each rank reads and holds 3 of fixture `a`'s 6; the ranks' forwards meet in every MoE layer),
with EPLB moving them, kept FP4, and not split (each rank the whole model), and data-parallel 4 with one expert
a rank (fixture `b`) give the one-process greedy tokens; tensor-parallel 2 (each rank half the heads and output
groups, with and without the experts split) the one-process fp32 logits within 1e-5, and 2 x 2 (fixture `b`) and
4 x 2 (6 experts + 2 redundant slots) its tokens."""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer.api import LLM
from deepinfer.config_v41 import V41Config
from deepinfer.errors import ConfigError
from deepinfer.parallel.config import ParallelConfig
from deepinfer.parallel.pool import RankPool
from deepinfer.runtime.sampling import SamplingParams
from tests.parallel_probe import Probe41
from tests.v41_dirs import model_dir, quantized_model_dir

PROMPTS = [{"token_ids": [5, 17, 30, 42]}, {"token_ids": [9, 8, 7]}, {"token_ids": [100, 200]}]  # vocabulary 256
PARAMS = [SamplingParams(temperature=0, max_new_tokens=3 + 2 * i) for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return model_dir(tmp_path_factory.mktemp("v41-ranks"))


@pytest.fixture(scope="module")
def alone(path) -> list[list[int]]:
    return one_process(path)


def one_process(path) -> list[list[int]]:
    return [o.token_ids for o in LLM(path, max_num_seqs=4).generate(PROMPTS, PARAMS, use_tqdm=False)]


def on_ranks(path, **layout):
    """The greedy tokens and the run's stats on the ranks of `layout`."""
    llm = LLM(path, max_num_seqs=4, **layout)
    try:
        return [o.token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)], llm.last_stats
    finally:
        llm.close()


@pytest.mark.parametrize("split", [True, False], ids=["dp2+ep", "dp2"])
def test_data_parallel_ranks_give_the_one_process_tokens(path, alone, split):
    assert on_ranks(path, data_parallel_size=2, enable_expert_parallel=split)[0] == alone


def test_eplb_moves_v41_experts_between_ranks_without_changing_the_tokens(path, alone):
    """Split experts with EPLB: 2 redundant slots (8 slots of 6 experts, 4 a rank) and a new placement every 3
    forward passes (each rank's new slots fetched from the others): the one-process tokens, and the rebalances and
    the balance in the stats (the shard ran)."""
    tokens, stats = on_ranks(path, data_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
                             eplb_redundant_experts=2, eplb_step_interval=3)
    assert tokens == alone
    assert stats.expert_rebalances >= 2 and 1.0 <= stats.expert_balance < 2.0


@pytest.mark.parametrize("layout", [dict(data_parallel_size=2), dict(tensor_parallel_size=2)], ids=["dp2", "tp2"])
def test_a_quantized_checkpoint_split_over_ranks_keeps_its_fp4_experts(tmp_path_factory, layout):
    """Fixture `a` in the released layout (FP8 dense, FP4 experts), kept quantized: each rank stacks only its 3 FP4
    experts per layer from the checkpoint's per-expert tensors, and with tensor parallelism cuts its FP8 `wq_b`,
    `wo_a` and `wo_b` on their 32x32 scale grid; the one-process tokens."""
    path = quantized_model_dir(tmp_path_factory.mktemp("v41q-ranks"))
    assert on_ranks(path, enable_expert_parallel=True, **layout)[0] == one_process(path)


def test_four_data_parallel_ranks_one_expert_each(tmp_path_factory):
    """Fixture `b` (4 routed experts) over 4 data-parallel ranks with the experts split: one expert a rank, every
    rank's forward meeting the others' in each MoE layer, ranks with fewer requests running idle forwards."""
    path = model_dir(tmp_path_factory.mktemp("v41b-ranks"), "b")
    assert on_ranks(path, data_parallel_size=4, enable_expert_parallel=True)[0] == one_process(path)


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(tensor_parallel_size=2, enable_expert_parallel=True),
                                    dict(data_parallel_size=2, enable_expert_parallel=True)],
                         ids=["tp2", "tp2+ep", "dp2+ep"])
def test_ranks_give_the_one_process_logits_with_the_engram_tables_split(path, layout):
    """Tensor-parallel: each rank holds half the heads (the query projection's rows, the sinks) and one of the two
    output groups; the attention outputs are added over the ranks. Every layout here splits the Engram tables by
    rows, half a rank (tensor-parallel: over the group; data-parallel with the experts split: over every rank, the
    ranks' row ids gathered): every prefill and decode row's fp32 logits within 1e-5 of one process."""
    ids, steps = [p["token_ids"] for p in PROMPTS] + [[3, 1, 4, 1, 5, 9, 2]], 3  # data-parallel: two a rank
    want = Probe41(model=path, dtype="float32").logits(ids, steps)
    pool = RankPool(ParallelConfig(**layout), Probe41, dict(model=path, dtype="float32", **layout))
    try:
        whole = list(V41Config.from_dict(json.loads((path / "config.json").read_text())).engram.num_embeddings)
        parts = pool.call("engram_tables")
        assert [sum(k) for k in zip(*parts)] == whole and all(2 * r <= n + 1 for p in parts for r, n in zip(p, whole))
        for got, w in zip(pool.call("logits", ids, steps), want, strict=True):
            assert got.dtype == torch.float32 and got.shape == w.shape
            assert (got - w).abs().max().item() <= 1e-5
    finally:
        pool.close()


def test_four_ranks_data_and_tensor_parallel_with_experts_split(tmp_path_factory):
    """Fixture `b` (2 heads, 2 output groups, 4 experts) over data-parallel 2 x tensor-parallel 2 with the experts
    split: one head and one expert a rank; the one-process greedy tokens."""
    path = model_dir(tmp_path_factory.mktemp("v41b-tp"), "b")
    layout = dict(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True)
    assert on_ranks(path, **layout)[0] == one_process(path)


def test_a_tensor_parallel_size_that_does_not_divide_the_heads_is_refused_by_name(path):
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=4 must divide the model's attention heads \(4\) "
                                          r"and output groups \(2\)"):
        LLM(path, tensor_parallel_size=4)


@pytest.mark.full  # slow (CI time): `pytest -m full` (README.md, Run the tests)
def test_eight_ranks_with_two_redundant_slots_one_slot_a_rank(path, alone):
    """Data-parallel 4 x tensor-parallel 2 over fixture `a`'s 6 experts + 2 redundant EPLB slots: one slot a rank
    (8 does not divide 6; the slots divide), rebalanced every 3 forwards; the one-process greedy tokens."""
    tokens, stats = on_ranks(path, data_parallel_size=4, tensor_parallel_size=2, enable_expert_parallel=True,
                             enable_eplb=True, eplb_redundant_experts=2, eplb_step_interval=3)
    assert tokens == alone
    assert stats.expert_rebalances >= 1
