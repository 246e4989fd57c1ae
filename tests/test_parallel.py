"""Several ranks on the CPU (gloo, one process per rank, deepinfer's own launcher; 2, 4 and 8 ranks):
data-parallel, tensor-parallel and expert-parallel layouts give the one-process logits (fp32, within 1e-5) and
greedy tokens; a failing rank ends the run with its message in bounded time; bad sizes are refused by name."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from deepinfer.api import LLM
from deepinfer.errors import ConfigError
from deepinfer.parallel.config import ParallelConfig, launched_rank
from deepinfer.parallel.pool import RankError, RankPool
from deepinfer.runtime.sampling import SamplingParams
from tests.parallel_probe import SIZES, Probe

PROMPTS = [[5, 17, 300, 42, 9, 77], [1000, 7, 7, 65000, 3]]
STEPS = 4
LAYOUTS = {
    "dp2+ep": dict(data_parallel_size=2, enable_expert_parallel=True),
    "tp2": dict(tensor_parallel_size=2),
    "tp2+ep": dict(tensor_parallel_size=2, enable_expert_parallel=True),
}


@pytest.fixture(scope="module")
def alone() -> list[torch.Tensor]:
    probe = Probe()
    return probe.logits(PROMPTS, STEPS)


def _check(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == torch.float32 and g.shape == w.shape
        assert (g - w).abs().max().item() <= 1e-5
        assert torch.equal(g.argmax(-1), w.argmax(-1))  # the same greedy tokens at every row


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_gives_the_one_process_logits(layout, alone):
    kwargs = LAYOUTS[layout]
    pool = RankPool(ParallelConfig(**kwargs), Probe, kwargs)
    try:
        assert "experts over 2 ranks" in pool.ready[0] or "ep" not in layout
        _check(pool.call("logits", PROMPTS, STEPS), alone)
    finally:
        pool.close()


def test_four_ranks_data_and_tensor_parallel_with_experts_split(alone):
    kwargs = dict(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True)
    pool = RankPool(ParallelConfig(**kwargs), Probe, kwargs)
    try:
        _check(pool.call("logits", PROMPTS, STEPS), alone)
    finally:
        pool.close()


@pytest.mark.full  # slow (CI time): `pytest -m full` (README.md, Run the tests)
def test_eight_ranks_data_parallel_4_tensor_parallel_2_experts_over_all():
    """Eight workers at once (the launcher's accept queue holds them all: with a backlog of one, a start hung in two
    of three tries here), one expert a rank."""
    prompts = PROMPTS + [[11, 12, 13], [40000, 2, 99, 7, 1, 1, 5]]  # one a data-parallel rank
    kwargs = dict(data_parallel_size=4, tensor_parallel_size=2, enable_expert_parallel=True)
    pool = RankPool(ParallelConfig(**kwargs), Probe, kwargs)
    try:
        assert "8 ranks (data-parallel 4 x tensor-parallel 2, experts over 8 ranks)" in pool.ready[0]
        _check(pool.call("logits", prompts, STEPS), Probe().logits(prompts, STEPS))
    finally:
        pool.close()


def test_llm_spreads_requests_over_data_parallel_ranks_and_keeps_input_order():
    """Five requests of several lengths over two data-parallel ranks with the experts split (the ranks step
    together, the one that finishes first running idle forwards): the one-process tokens, in input order."""
    prompts = [{"token_ids": [5 + i, 17, 300 + 7 * i, 42, 8][: 2 + i % 4]} for i in range(5)]
    params = [SamplingParams(temperature=0, max_new_tokens=3 + 2 * i) for i in range(5)]
    want = [o.token_ids for o in LLM(**SIZES).generate(prompts, params, use_tqdm=False)]
    llm = LLM(**SIZES, data_parallel_size=2, enable_expert_parallel=True)
    try:
        seen = []
        got = llm.generate(prompts, params, use_tqdm=False, on_output=lambda o: seen.append(o.index))
        assert [o.token_ids for o in got] == want
        assert [o.index for o in got] == list(range(5)) and sorted(seen) == list(range(5))
        assert llm.last_stats.generated_tokens == sum(len(t) for t in want)
        assert "2 ranks" in llm.describe()
    finally:
        llm.close()


def test_a_failing_rank_ends_the_run_with_its_message_in_bounded_time():
    kwargs = dict(data_parallel_size=2)
    pool = RankPool(ParallelConfig(**kwargs), Probe, kwargs)
    begin = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 failed: ValueError: shard 3 is missing"):
        pool.call("fail_on", 1, "shard 3 is missing")
    assert time.monotonic() - begin < 30
    assert not pool.procs  # every worker stopped


def test_a_rank_that_fails_while_starting_is_reported():
    with pytest.raises(ConfigError, match=r"rank \d: .*tensor_parallel_size=3"):
        RankPool(ParallelConfig(tensor_parallel_size=3), Probe, dict(tensor_parallel_size=3))


def test_bad_sizes_are_refused_by_name():
    with pytest.raises(ConfigError, match="data_parallel_size=0"):
        ParallelConfig(data_parallel_size=0)
    with pytest.raises(ConfigError, match="must divide .* 8 routed experts"):
        ParallelConfig(data_parallel_size=3, enable_expert_parallel=True).check_model(6, 3, 8)
    with pytest.raises(ConfigError, match="must divide .* 8 routed experts \\+ 2 redundant = 10 slots"):
        ParallelConfig(data_parallel_size=4, enable_expert_parallel=True).check_model(6, 3, 8, redundant=2)
    ParallelConfig(data_parallel_size=4, enable_expert_parallel=True).check_model(6, 3, 6, redundant=2)  # 8 slots
    with pytest.raises(ConfigError, match="WORLD_SIZE"):
        launched_rank(ParallelConfig(tensor_parallel_size=2), {"RANK": "0", "WORLD_SIZE": "4"})
    assert launched_rank(ParallelConfig(tensor_parallel_size=2), {}) is None


def test_decode_graphs_on_ranks_are_refused_with_eplb_rebalancing(monkeypatch):
    """A rebalance replaces the expert weights and tables a captured graph reads: refused by name before any worker
    starts."""
    monkeypatch.setenv("DEEPINFER_PARALLEL_GRAPHS", "1")
    kwargs = dict(data_parallel_size=2, enable_expert_parallel=True, enable_eplb=True, backend="reference")
    with pytest.raises(ConfigError, match="DEEPINFER_PARALLEL_GRAPHS=1 with EPLB rebalancing every 3 forwards"):
        LLM(eplb_step_interval=3, **kwargs)


def test_sizes_the_model_cannot_split_fail_before_any_worker_starts():
    begin = time.monotonic()
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=3 must divide the model's attention heads \(4\)"):
        LLM(**SIZES, tensor_parallel_size=3)
    assert time.monotonic() - begin < 5


def test_cli_runs_data_parallel_with_its_own_workers(tmp_path):
    from click.testing import CliRunner

    from deepinfer.cli import main

    args = ["run", "offline", "--backend", "reference", "--num-blocks", "64", "--max-num-seqs", "4", "--raw",
            "--temperature", "0", "--max-new-tokens", "4", "--format", "jsonl", "--token-ids", "5,17,300",
            "--token-ids", "9,8,7,6", "--token-ids", "1000,3"]
    one = CliRunner().invoke(main, args + ["--output", str(tmp_path / "one.jsonl")])
    two = CliRunner().invoke(main, args + ["--output", str(tmp_path / "two.jsonl"), "--data-parallel-size", "2",
                                           "--enable-expert-parallel"])
    assert one.exit_code == 0 and two.exit_code == 0, (one.output, two.output)
    assert "2 ranks (data-parallel 2 x tensor-parallel 1, experts over 2 ranks)" in two.output
    tokens = [[json.loads(line)["token_ids"] for line in (tmp_path / f"{n}.jsonl").read_text().splitlines()]
              for n in ("one", "two")]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 3


def test_runs_under_torchrun_with_rank_0_writing_the_results(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "deepinfer", "run", "offline",
           "--backend", "reference", "--num-blocks", "64", "--max-num-seqs", "4", "--raw", "--temperature", "0",
           "--max-new-tokens", "4", "--format", "jsonl", "--token-ids", "5,17,300", "--token-ids", "9,8,7,6",
           "--tensor-parallel-size", "2", "--enable-expert-parallel", "--output", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("request(s), ") == 1  # one summary: rank 0's
    want = LLM(**SIZES).generate([{"token_ids": [5, 17, 300]}, {"token_ids": [9, 8, 7, 6]}],
                                 SamplingParams(temperature=0, max_new_tokens=4), use_tqdm=False)
    assert [json.loads(line)["token_ids"] for line in out.read_text().splitlines()] == [o.token_ids for o in want]


def test_eplb_rebalances_during_the_run_without_changing_the_tokens():
    """Expert parallelism over two data-parallel ranks with EPLB: 2 redundant slots (10 slots of 8 experts) and a
    new placement every 3 forward passes (the weights of each rank's new slots fetched from the others): the
    one-process greedy tokens, the rebalances and the balance in the stats."""
    prompts = [{"token_ids": [5 + i, 17, 300 + 7 * i, 42, 8][: 2 + i % 4]} for i in range(4)]
    params = SamplingParams(temperature=0, max_new_tokens=8)
    want = [o.token_ids for o in LLM(**SIZES).generate(prompts, params, use_tqdm=False)]
    llm = LLM(**SIZES, data_parallel_size=2, enable_expert_parallel=True, enable_eplb=True, eplb_redundant_experts=2,
              eplb_step_interval=3)
    try:
        got = llm.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in got] == want
        stats = llm.last_stats
        assert stats.expert_rebalances >= 2
        assert 1.0 <= stats.expert_balance < 2.0
    finally:
        llm.close()


def test_eplb_options_are_checked():
    with pytest.raises(ConfigError, match="enable_eplb .* needs enable_expert_parallel"):
        LLM(**SIZES, data_parallel_size=2, enable_eplb=True)
    with pytest.raises(ConfigError, match="redundant_experts=-1"):
        LLM(**SIZES, data_parallel_size=2, enable_expert_parallel=True, enable_eplb=True, eplb_redundant_experts=-1)


def test_a_quantized_checkpoint_split_over_ranks_reads_each_rank_its_experts(tmp_path):
    """FP8 dense / FP4 expert checkpoint (upstream names), kept quantized:
    tensor-parallel 2 with the experts split gives the one-process tokens; each rank holds its 4 of 8 experts."""
    from deepinfer.tiny import random_tensors, tiny_config
    from deepinfer.weights.synthetic import write_checkpoint

    cfg = tiny_config()
    model = write_checkpoint(tmp_path / "q", cfg.raw, random_tensors(cfg, seed=1), "upstream", block=(32, 32))
    prompts = [{"token_ids": [5, 17, 300]}, {"token_ids": [9, 8, 7, 6]}]
    params = SamplingParams(temperature=0, max_new_tokens=5)
    want = [o.token_ids for o in LLM(model, **SIZES).generate(prompts, params, use_tqdm=False)]
    kwargs = dict(model=model, tensor_parallel_size=2, enable_expert_parallel=True)
    pool = RankPool(ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True), Probe, kwargs)
    try:
        shapes = pool.call("expert_shapes")
        assert all(rows == 4 for rows in shapes) and len(shapes) == cfg.num_hidden_layers * 2
        got, _ = pool.call("generate", prompts, params)
        assert [o.token_ids for o in got] == want
    finally:
        pool.close()


def test_data_parallel_ranks_decode_through_graphs_with_the_exchange_inside():
    """Two data-parallel ranks, experts split, decode graphs captured at start (emulated on the CPU: recorded once
    and replayed, so the exchange inside runs with the bucket's static shapes): ranks decoding together run the
    bucket of the most rows, a rank with less pads, an idle rank replays padding only, steps where a rank prefills
    run eagerly; the one-process tokens."""
    prompts = [{"token_ids": [5 + i, 17, 300 + 7 * i, 42, 8][: 2 + i % 4]} for i in range(7)]
    params = [SamplingParams(temperature=0, max_new_tokens=2 + 3 * (i % 3)) for i in range(7)]
    want = [o.token_ids for o in LLM(**SIZES).generate(prompts, params, use_tqdm=False)]
    kwargs = dict(data_parallel_size=2, enable_expert_parallel=True)
    pool = RankPool(ParallelConfig(**kwargs), Probe, kwargs)
    try:
        assert pool.call("emulate_graphs") == 6  # buckets 1, 2, 4: each step and its sampler
        got, stats = pool.call("generate", prompts, params)
        assert [o.token_ids for o in got] == want
    finally:
        pool.close()


def test_a_script_without_a_main_guard_starts_ranks(tmp_path):
    """The rank workers are fresh `python -m` processes: the caller's script is not re-run in them."""
    import subprocess
    import sys

    script = tmp_path / "plain.py"
    script.write_text(
        "from deepinfer import LLM\n"
        "from deepinfer.runtime.sampling import SamplingParams\n"
        "llm = LLM(backend='reference', num_blocks=64, max_num_seqs=4, data_parallel_size=2)\n"
        "outs = llm.generate([{'token_ids': [5, 6, 7]}, {'token_ids': [9, 9]}], SamplingParams(temperature=0,"
        " max_new_tokens=3), use_tqdm=False)\n"
        "print('TOKENS', [o.token_ids for o in outs])\n"
        "llm.close()\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = LLM(**SIZES).generate([{"token_ids": [5, 6, 7]}, {"token_ids": [9, 9]}],
                                 SamplingParams(temperature=0, max_new_tokens=3), use_tqdm=False)
    assert proc.stdout.count("TOKENS") == 1 and str([o.token_ids for o in want]) in proc.stdout


@pytest.mark.parametrize("spelling", ["hf", "upstream"])
def test_the_loader_reads_the_chosen_experts_in_their_order(spelling, tmp_path):
    from deepinfer.tiny import random_tensors, tiny_config
    from deepinfer.config_v41 import read_config
    from deepinfer.weights.loader import load_checkpoint
    from deepinfer.weights.synthetic import write_checkpoint

    cfg = tiny_config()
    model = write_checkpoint(tmp_path / spelling, cfg.raw, random_tensors(cfg, seed=1), spelling, block=(32, 32))
    cfg = read_config(model)  # with its quantization_config
    whole = load_checkpoint(model, cfg, torch.float32, keep_quantized=True).tensors
    chosen = [6, 1, 1, 3]  # any order, replicas too
    part = load_checkpoint(model, cfg, torch.float32, keep_quantized=True, experts_of=lambda name: chosen).tensors
    for name in ("layers.0.mlp.experts.gate_up_proj", "layers.3.mlp.experts.down_proj"):
        assert torch.equal(part[name].values, whole[name].values[chosen])
        assert torch.equal(part[name].scales, whole[name].scales[chosen])
