"""Confidence-sized verification's budget (runtime/spec_budget.py): hand-checked admissions, the stop at the first
drop of expected tokens per second (where a search past it would admit more), prefixes kept on equal survivals,
the step-cost table; and through the engine, sized verification gives plain decoding's tokens."""

from __future__ import annotations

import math

import pytest

import deepinfer
from deepinfer.errors import ConfigError
from deepinfer.runtime.drafters import OracleDrafts
from deepinfer.runtime.sampling import SamplingParams
from deepinfer.runtime.spec_budget import StepCosts, verify_budget
from deepinfer.runtime.speculative import Speculator
from tests.test_speculative import mtp_dir, plain, prompts  # noqa: F401 - fixtures


def test_admissions_by_survival_checked_by_hand():
    conf = [[0.9, 0.5], [0.6]]  # survivals 0.9, 0.45 | 0.6
    # cost 1 + 0.1 rows: 2/1.2 -> +0.9: 2.9/1.3 -> +0.6: 3.5/1.4 -> +0.45: 3.95/1.5, each higher: all admitted
    assert verify_budget(conf, lambda rows: 1 + 0.1 * rows) == [2, 1]
    # cost 1 + 0.5 rows: 2/2 = 1 -> 2.9/2.5 = 1.16 -> 3.5/3 = 1.167 -> 3.95/3.5 = 1.129, a drop: the 0.45 stays out
    assert verify_budget(conf, lambda rows: 1 + 0.5 * rows) == [1, 1]
    assert verify_budget([[0.9, 0.9], []], lambda rows: 1.0) == [2, 0]
    assert verify_budget([], lambda rows: 1.0) == []


def test_admission_stops_at_the_first_drop():
    """One request, four drafts of confidence 0.9; a step costs 1 up to 2 rows and 1.5 up to 5: admitting the second
    draft drops the rate (2.71 / 1.5 < 1.9), though admitting all four would beat it (4.10 / 1.5): the budget
    stops at the drop."""
    cost = lambda rows: 1.0 if rows <= 2 else 1.5  # noqa: E731
    assert verify_budget([[0.9] * 4], cost) == [1]
    assert (1 + 0.9 + 0.81 + 0.729 + 0.6561) / 1.5 > 1.9  # what a search past the drop would have taken


def test_equal_survivals_keep_each_request_a_prefix():
    counts = verify_budget([[1.0, 1.0, 1.0], [1.0, 1.0], [0.0, 1.0]], lambda rows: 1.0)
    assert counts == [3, 2, 0]  # zero confidence: nothing after it is worth a row either


def test_step_costs_interpolate_between_measured_buckets():
    costs = StepCosts((1, 2, 4, 8, 16))
    assert costs(5) == 1.0  # nothing measured: flat
    costs.record(2, 0.002)
    assert costs(16) == 0.002  # one point: flat
    costs.record(8, 0.008)  # linear in rows through the measured buckets, extended past them
    assert costs(3) == pytest.approx(0.003) and costs(16) == pytest.approx(0.016) and costs(7) == pytest.approx(0.007)
    costs.record(8, 0.018)  # an average of measured steps
    assert costs(8) == pytest.approx(0.8 * 0.008 + 0.2 * 0.018)
    profiled = StepCosts((1, 2, 4))
    profiled.device = {1: 0.001, 2: 0.0012, 4: 0.002}  # replays timed at start
    assert profiled(3) == pytest.approx(0.002) and profiled.steps == (1, 2, 4)  # its bucket's replay: padded
    profiled.record(3, 0.004)  # a measured step (bucket 4): 2 ms of host work beyond its replay
    assert profiled(1) == pytest.approx(0.003) and profiled(4) == pytest.approx(0.004)  # bucket 1: the average
    profiled.record(1, 0.0015)
    assert profiled(1) == pytest.approx(0.0015) and profiled(4) == pytest.approx(0.004)  # each bucket its own


def test_moving_by_buckets_lets_the_admission_cross_a_bucket():
    """32 requests with drafts of confidence 0.9 and the replay times measured on the H200 (batch-invariant slice:
    32 rows 5.7 ms, 64 rows 8.5 ms): draft by draft at the bucket's whole cost the first draft past 32 rows is a
    drop (none admitted, what the first measured run did); moving a bucket at a time, the 32 first drafts fill
    the 64-row bucket (60.8 expected tokens in 8.5 ms beat 32 in 5.7 ms), then every later draft is worth its
    row (past the largest bucket the cost stays its replay)."""
    costs = StepCosts((32, 64))
    costs.device = {32: 0.0057, 64: 0.0085}
    assert verify_budget([[0.9, 0.9]] * 32, costs, costs.steps) == [2] * 32
    assert verify_budget([[0.9, 0.9]] * 32, costs) == [0] * 32


def test_bucket_moves_checked_by_hand():
    """One request, four drafts of 0.9; buckets of 1, 2, 4, 6 rows cost 1.0, 1.1, 1.2, 2.0: 1/1 -> 1.9/1.1 = 1.73
    -> (fill 4 rows) 3.44/1.2 = 2.87 -> (the last draft, 6-row bucket) 4.10/2.0 = 2.05, a drop: three drafts."""
    costs = StepCosts((1, 2, 4, 6))
    costs.device = {1: 1.0, 2: 1.1, 4: 1.2, 6: 2.0}
    assert verify_budget([[0.9] * 4], costs, costs.steps) == [3]
    costs.device[6] = 1.3  # now 4.10/1.3 = 3.15 rises: all four
    assert verify_budget([[0.9] * 4], costs, costs.steps) == [4]
    # two requests (survivals 0.9, 0.81 | 0.6, 0.36): the 4-row bucket takes the two highest (both the first
    # request's), 2/1.1 -> 3.71/1.2 = 3.09; the next move the rest, 4.67/1.3 = 3.59
    assert verify_budget([[0.9, 0.9], [0.6, 0.6]], costs, costs.steps) == [2, 2]
    costs.device[6] = 2.0  # 4.67/2.0 = 2.34, a drop
    assert verify_budget([[0.9, 0.9], [0.6, 0.6]], costs, costs.steps) == [2, 0]


def test_sized_verification_gives_plain_decodings_tokens(mtp_dir, plain):  # noqa: F811
    reqs = prompts([9, 70, 140, 33])
    params = [SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=4, max_new_tokens=30, ignore_eos=True)]
    spec = deepinfer.LLM(mtp_dir, max_num_seqs=4, prefix_cache="off", speculative_varlen=True)
    assert spec.engine.speculator.costs is not None
    for p in params:
        want = plain.generate(reqs, p, use_tqdm=False)
        assert [o.token_ids for o in spec.generate(reqs, p, use_tqdm=False)] == [o.token_ids for o in want]
        oracle = Speculator(spec.engine.steps, 5, OracleDrafts({i: o.token_ids for i, o in enumerate(want)}, 0.7,
                                                               spec.config.vocab_size), varlen=True)
        # a fixed cost table (no measured steps): rows cost enough that fewer than all drafts are worth a place
        oracle.costs.device = {b: 1.0 + 0.05 * b for b in oracle.costs.buckets}
        oracle.costs.record = lambda rows, seconds: None
        spec.engine.speculator = oracle
        got = spec.generate(reqs, p, use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        st = spec.last_stats.spec
        assert 0 < st.drafts < 5 * st.request_steps  # some drafts verified, not all


def test_varlen_options(mtp_dir, monkeypatch):  # noqa: F811
    with pytest.raises(ConfigError, match="speculative_varlen"):
        deepinfer.LLM(mtp_dir, speculative_varlen="yes")
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    assert deepinfer.LLM(mtp_dir).engine.speculator.costs is not None
    assert deepinfer.LLM(mtp_dir, speculative_varlen=False).engine.speculator.costs is None
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "maybe")
    with pytest.raises(ConfigError, match="DEEPINFER_ENABLE_MTP_VARLEN='maybe'"):
        deepinfer.LLM(mtp_dir)


def test_drafts_never_preempt_a_request():
    """Three blocks of 4 positions: A's plain step fits its block, its two drafts would need a second one; B's
    plain step needs a second block. B gets the free block; A's drafts are cut to what A holds (none)."""
    from types import SimpleNamespace

    from deepinfer.runtime.blocks import SlotBlocks
    from deepinfer.runtime.cache_layout import CacheSpec
    from deepinfer.runtime.scheduler import Scheduler, SchedulerConfig

    cache = SlotBlocks(CacheSpec(num_blocks=3, max_seqs=2, max_blocks_per_seq=8, block_tokens=4))
    scheduler = Scheduler(cache, SchedulerConfig(max_num_seqs=2), 32)
    params = SamplingParams(max_new_tokens=20)
    a, b = (SimpleNamespace(index=i, num_tokens=n, drafts=d, generated=[1], params=params, in_prefill=False,
                            preemptions=0, cache=cache.admit()) for i, n, d in ((0, 4, [7, 7]), (1, 5, [])))
    for r in (a, b):
        cache.grow(r.cache, 4)
        scheduler.running.append(r)
    step = scheduler.next_step()
    assert step.requests == (a, b) and scheduler.preemptions == 0 and a.drafts == []
    assert len(b.cache.blocks) == 2 and len(a.cache.blocks) == 1
    cache.release(b.cache)  # B leaves: its blocks are free again
    scheduler.running.remove(b)
    a.drafts = [7, 7]
    scheduler.next_step()
    assert a.drafts == [7, 7] and len(a.cache.blocks) == 2  # a free block: the drafts take it


def test_random_admissions_match_a_plain_loop():
    """Random confidences and costs: the vectorized admission equals a pair-by-pair loop written here (no
    buckets), and with buckets every request's admitted drafts are a prefix and each move raised the rate."""
    import random

    rng = random.Random(0)
    for _ in range(200):
        conf = [[rng.random() for _ in range(rng.randint(0, 5))] for _ in range(rng.randint(1, 9))]
        per_row, fixed = rng.uniform(0.01, 0.5), rng.uniform(0.5, 2.0)
        cost = lambda rows: fixed + per_row * rows  # noqa: E731
        pairs = sorted((-s, j, r) for r, cs in enumerate(conf) for j, s in
                       enumerate([math.prod(cs[: j + 1]) for j in range(len(cs))]))
        counts, expected, rate = [0] * len(conf), float(len(conf)), len(conf) / cost(len(conf))
        for minus, _, r in pairs:
            nxt = (expected - minus) / cost(len(conf) + sum(counts) + 1)
            if nxt <= rate:
                break
            counts[r], expected, rate = counts[r] + 1, expected - minus, nxt
        assert verify_budget(conf, cost) == counts
        steps = sorted(rng.sample(range(1, 60), 5))
        got = verify_budget(conf, lambda rows: cost(next((b for b in steps if b >= rows), rows)), steps)
        assert all(0 <= g <= len(cs) for g, cs in zip(got, conf))
