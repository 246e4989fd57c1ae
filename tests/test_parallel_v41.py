"""DeepSeek-V4.1 on several ranks (gloo on the CPU, deepinfer's own launcher): data-parallel 2 with the routed
experts split (each rank reads and holds 3 of fixture `a`'s 6; the ranks' forwards meet in every MoE layer),
with EPLB moving them, kept FP4, and not split (each rank the whole model), and data-parallel 4 with one expert
a rank (fixture `b`) give the one-process greedy tokens; tensor parallelism is refused by name."""

from __future__ import annotations

import pytest

from deepinfer.api import LLM
from deepinfer.errors import ConfigError
from deepinfer.runtime.sampling import SamplingParams
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


def test_a_quantized_checkpoint_split_over_ranks_keeps_its_fp4_experts(tmp_path_factory):
    """Fixture `a` in the released layout (FP8 dense, FP4 experts), kept quantized: each rank stacks only its 3 FP4
    experts per layer from the checkpoint's per-expert tensors; the one-process tokens."""
    path = quantized_model_dir(tmp_path_factory.mktemp("v41q-ranks"))
    assert on_ranks(path, data_parallel_size=2, enable_expert_parallel=True)[0] == one_process(path)


def test_four_data_parallel_ranks_one_expert_each(tmp_path_factory):
    """Fixture `b` (4 routed experts) over 4 data-parallel ranks with the experts split: one expert a rank, every
    rank's forward meeting the others' in each MoE layer, ranks with fewer requests running idle forwards."""
    path = model_dir(tmp_path_factory.mktemp("v41b-ranks"), "b")
    assert on_ranks(path, data_parallel_size=4, enable_expert_parallel=True)[0] == one_process(path)


def test_tensor_parallel_is_refused_by_name(path):
    with pytest.raises(ConfigError, match="tensor_parallel_size=2: DeepSeek-V4.1 runs data-parallel"):
        LLM(path, tensor_parallel_size=2)
