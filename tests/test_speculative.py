"""Speculative decoding (`--speculative-tokens`, runtime/speculative.py): the output is token for token plain
decoding's, greedy and seeded, with the MTP layer's drafts (random weights: almost all rejected) and with drafts
that are mostly right (`OracleDrafts`: the plain run's own tokens, each kept with a set probability), for fixed
and varying draft lengths, mixed prompt lengths, preemption and structured output; seeded outputs do not depend
on the batch or the draft lengths; the output distribution is the target's (chi-square against the exact
marginal); options and stats."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

import deepinfer
from deepinfer.config import ModelConfig
from deepinfer.errors import ConfigError
from deepinfer.runtime.drafters import OracleDrafts
from deepinfer.runtime.sampling import SamplingParams
from deepinfer.runtime.speculative import Speculator
from deepinfer.tiny import TINY_CONFIG, random_tensors
from tests.helpers import TINY_A, TINY_MTP, save_model_dir

GREEDY = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
SEEDED = [SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_new_tokens=30, ignore_eos=True, logprobs=2),
          SamplingParams(temperature=1.2, top_k=20, seed=12, presence_penalty=0.5, repetition_penalty=1.2,
                         max_new_tokens=30, ignore_eos=True),
          SamplingParams(temperature=0.7, seed=13, logit_bias={5: 2.0, 9: -3.0}, max_new_tokens=30, ignore_eos=True),
          SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)]


def _model_dir(path: Path, raw: dict) -> Path:
    return save_model_dir(path, raw, random_tensors(ModelConfig.from_dict(raw), seed=1))


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory) -> Path:
    return _model_dir(tmp_path_factory.mktemp("spec") / "tiny-mtp", TINY_MTP)


@pytest.fixture(scope="module")
def plain(mtp_dir):
    return deepinfer.LLM(mtp_dir, max_num_seqs=4, speculative_tokens=0, prefix_cache="off")  # hits change tokens


@pytest.fixture(scope="module")
def spec(mtp_dir):
    llm = deepinfer.LLM(mtp_dir, max_num_seqs=4, prefix_cache="off")  # the default: 5 MTP drafts
    assert llm.speculative_tokens == 5 and llm.engine.speculator is not None
    return llm


def prompts(lengths, seed=0, vocab=TINY_A["vocab_size"]):
    g = torch.Generator().manual_seed(seed)
    return [{"token_ids": torch.randint(2, vocab, (n,), generator=g).tolist()} for n in lengths]


class Varied:
    """Another drafts source, its drafts cut to a random length (0 to all) each time: varying verify lengths."""

    def __init__(self, inner, seed: int = 0):
        self.inner, self.rng = inner, random.Random(seed)

    def after_prefill(self, chunks, streams, sampled, k):
        self.inner.after_prefill(chunks, streams, sampled, k)
        self._cut([r for r, *_ in chunks])

    def after_verify(self, live, streams, k):
        self.inner.after_verify(live, streams, k)
        self._cut([r for r, *_ in live])

    def _cut(self, reqs):
        for r in reqs:
            r.drafts = r.drafts[: self.rng.randint(0, len(r.drafts))]


def oracle(llm, reference, accept: float, k: int, varied: bool = False) -> None:
    """Swap `llm`'s drafts for the reference outputs' own tokens (by position in the batch), each kept with
    probability `accept`."""
    drafts = OracleDrafts({i: o.token_ids for i, o in enumerate(reference)}, accept, llm.config.vocab_size)
    llm.engine.speculator = Speculator(llm.engine.steps, k, Varied(drafts) if varied else drafts)


def test_greedy_equals_plain_decoding_with_mtp_and_mostly_right_drafts(plain, spec):
    reqs = prompts([3, 50, 130, 260, 17])
    want = plain.generate(reqs, GREEDY, use_tqdm=False)
    got = spec.generate(reqs, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    st = spec.last_stats.spec
    assert st.steps > 0 and st.drafts > st.steps and st.verify_tokens == st.drafts + st.request_steps
    graphs = spec.engine.steps.graphs  # verify rows ran as decode rows (the graphs' path), streams kept for the MTP
    assert graphs.buckets[-1] == 4 * 6 and graphs.last_streams is not None
    for accept, k, varied in ((0.8, 4, False), (0.6, 5, True), (1.0, 3, False)):
        oracle(spec, want, accept, k, varied)
        got = spec.generate(reqs, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in want], (accept, k, varied)
        st = spec.last_stats.spec
        assert st.steps < spec.last_stats.generated_tokens - len(reqs)  # several tokens per step
        if accept == 1.0:  # every draft stands: k + 1 tokens a step until the length limit
            assert st.accepted == st.reached and st.mean_accepted > 3
        else:
            assert 0 < st.acceptance[0] < 1
    assert spec.cache.used_blocks == 0 and spec.cache.free_slots == spec.cache.spec.max_seqs


def test_seeded_outputs_equal_plain_alone_in_a_batch_and_at_any_draft_length(plain, spec):
    reqs = prompts([9, 70, 140, 33])
    want = plain.generate(reqs, SEEDED, use_tqdm=False)
    for accept, k, varied in ((0.7, 2, False), (0.8, 5, True)):
        oracle(spec, want, accept, k, varied)
        got = spec.generate(reqs, SEEDED, use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in want], (accept, k)
        for a, b in zip(got[0].logprobs, want[0].logprobs):  # the rows' logprobs come back with their tokens
            assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert len(got[0].logprobs) == len(got[0].token_ids)
        alone = spec.generate(reqs[1], SEEDED[1], use_tqdm=False)[0]
        assert alone.token_ids == want[1].token_ids


def test_preemption_under_a_tiny_cache_loses_nothing(mtp_dir, plain):
    reqs = prompts([150, 230, 90, 250, 40], seed=3)
    want = [plain.generate(r, GREEDY, use_tqdm=False)[0] for r in reqs]
    tight = deepinfer.LLM(mtp_dir, max_num_seqs=4, num_blocks=6, max_prefill_tokens=64, speculative_tokens=4,
                          prefix_cache="off")
    got = tight.generate(reqs, GREEDY, use_tqdm=False)
    assert tight.last_stats.preemptions > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    oracle(tight, want, 0.9, 4)
    got = tight.generate(reqs, GREEDY, use_tqdm=False)
    assert tight.last_stats.preemptions > 0 and tight.last_stats.spec.accepted[0] > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_structured_output_equals_plain_decoding(tmp_path):
    raw = dict(TINY_CONFIG, num_nextn_predict_layers=1, compress_ratios=[0, 4, 128, 4, 0])  # the V4 vocabulary
    path = _model_dir(tmp_path / "tiny-v4-mtp", raw)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yy"]}},
              "required": ["a", "b"], "additionalProperties": False}
    items = [{"messages": [{"role": "user", "content": f"r{i}"}], "so_args": so} for i, so in
             enumerate([{"json_schema": schema}, {"regex": "(cat|dog)s? [0-9]{3}"}, None])]
    params = [SamplingParams(temperature=0.8, seed=i, max_new_tokens=40) for i in range(3)]
    want = deepinfer.LLM(path, max_num_seqs=4, speculative_tokens=0).generate(items, params, use_tqdm=False)
    spec = deepinfer.LLM(path, max_num_seqs=4, speculative_tokens=4)
    got = spec.generate(items, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    oracle(spec, want, 0.8, 4)
    got = spec.generate(items, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want] and spec.last_stats.spec.accepted[0] > 0


def _chi_square(counts: dict[int, int], probs: dict[int, float], n: int) -> float:
    """Pearson's statistic over the support of `probs` (every token the target can draw)."""
    return sum((counts.get(t, 0) - n * p) ** 2 / (n * p) for t, p in probs.items())


def test_output_distribution_is_the_targets(mtp_dir, plain):
    """The second generated token (drawn in a verify step, after MTP drafts) of 1,200 seeded runs against its exact
    marginal: sum over the first token t1 of p(t1) p(t2 | t1), top-k 4 at temperature 1.3 (16 outcomes at most).
    The same counts against the marginal at temperature 0.3 are rejected (the test can fail). The seeds are fixed:
    the outcome is the same on every run."""
    prompt = prompts([12], seed=9)[0]["token_ids"]
    n = 1200

    def params(seed, t=1.3):
        return SamplingParams(temperature=t, top_k=4, seed=seed, max_new_tokens=2, ignore_eos=True)

    def marginal(t):
        from deepinfer.runtime.sampler import filter_logits

        first = plain.generate({"token_ids": prompt}, SamplingParams(temperature=0, max_new_tokens=1, logprobs=20),
                               use_tqdm=False)[0]
        raw1 = torch.full((1, plain.config.vocab_size), -math.inf)
        for token, lp in first.logprobs[0].top:
            raw1[0, token] = lp
        p1 = torch.softmax(filter_logits(raw1, [params(0, t)]), -1)[0]
        out: dict[int, float] = {}
        for t1 in p1.nonzero()[:, 0].tolist():
            nxt = plain.generate({"token_ids": prompt + [t1]}, SamplingParams(temperature=0, max_new_tokens=1,
                                                                              logprobs=20), use_tqdm=False)[0]
            raw2 = torch.full((1, plain.config.vocab_size), -math.inf)
            for token, lp in nxt.logprobs[0].top:
                raw2[0, token] = lp
            p2 = torch.softmax(filter_logits(raw2, [params(0, t)]), -1)[0]
            for t2 in p2.nonzero()[:, 0].tolist():
                out[t2] = out.get(t2, 0.0) + float(p1[t1] * p2[t2])
        return out

    spec = deepinfer.LLM(mtp_dir, max_num_seqs=64, speculative_tokens=3)  # MTP drafts
    outs = spec.generate([{"token_ids": prompt}] * n, [params(1000 + i) for i in range(n)], use_tqdm=False)
    assert spec.last_stats.spec.steps > 0
    counts: dict[int, int] = {}
    for o in outs:
        counts[o.token_ids[1]] = counts.get(o.token_ids[1], 0) + 1
    exact = marginal(1.3)
    assert set(counts) <= set(exact)
    dof = len(exact) - 1
    # the chi-square distribution's 1 - 1e-3 quantile (Wilson-Hilferty): a right marginal passes but 1 run in 1,000
    bound = dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3
    assert _chi_square(counts, exact, n) < bound
    assert _chi_square(counts, marginal(0.3), n) > bound  # a wrong distribution (another temperature) is told apart


def test_options(mtp_dir, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="speculative_tokens.*17"):
        deepinfer.LLM(mtp_dir, speculative_tokens=17)
    with pytest.raises(ConfigError, match="no MTP layer"):
        deepinfer.LLM(speculative_tokens=2)  # the embedded tiny model has none
    with pytest.raises(ConfigError, match="prefix_cache='exact'"):
        deepinfer.LLM(mtp_dir, speculative_tokens=2, prefix_cache="exact")
    assert deepinfer.LLM(mtp_dir, prefix_cache="exact").speculative_tokens == 0  # the default steps aside
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "2")
    assert deepinfer.LLM(mtp_dir).speculative_tokens == 2
    assert deepinfer.LLM().speculative_tokens == 0  # the variable asks; a model without MTP decodes plainly
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "x")
    with pytest.raises(ConfigError, match="DEEPINFER_USE_NEXTN_DECODE='x'"):
        deepinfer.LLM(mtp_dir)


def test_prefix_hits_and_the_length_limit(mtp_dir):
    """With the prefix cache (approximate hits prefill the window again) both runs hit the same blocks and give the
    same tokens; near max_model_len the drafts are cut to the positions left."""
    shared = prompts([300], seed=5)[0]["token_ids"]
    reqs = [{"token_ids": shared + p["token_ids"]} for p in prompts([5, 40], seed=6)]
    kw = dict(max_num_seqs=4, max_model_len=380)
    runs = {k: deepinfer.LLM(mtp_dir, speculative_tokens=k, **kw) for k in (0, 5)}
    params = SamplingParams(temperature=0, max_new_tokens=60, ignore_eos=True)
    outs = {k: [llm.generate(reqs, params, use_tqdm=False) for _ in range(2)] for k, llm in runs.items()}
    for turn in range(2):
        assert [o.token_ids for o in outs[5][turn]] == [o.token_ids for o in outs[0][turn]]
        assert [o.num_cached_tokens for o in outs[5][turn]] == [o.num_cached_tokens for o in outs[0][turn]]
    assert outs[5][1][0].num_cached_tokens >= 256
    assert [o.finish_reason for o in outs[5][0]] == ["length", "length"]
    assert len(outs[5][0][1].token_ids) == 380 - 340  # the length limit, not max_new_tokens


def test_cli_runs_speculatively_and_reports_acceptance(mtp_dir):
    from click.testing import CliRunner

    from deepinfer.cli import main

    args = ["run", "offline", "--model", str(mtp_dir), "--token-ids", "5,6,7,8", "--token-ids", "9,10",
            "--max-new-tokens", "12", "--temperature", "0", "--format", "jsonl"]
    runs = {k: CliRunner().invoke(main, [*args, "--speculative-tokens", k], env={"DEEPINFER_HF_MODEL_DIR": ""})
            for k in ("0", "3")}
    assert all(r.exit_code == 0 for r in runs.values()), runs["3"].output
    assert "speculative decoding 3 MTP drafts" in runs["3"].stderr and "speculative:" in runs["3"].stderr
    assert "acceptance by draft position" in runs["3"].stderr and "speculative:" not in runs["0"].stderr
    tokens = {k: sorted((json.loads(line)["index"], json.loads(line)["token_ids"])
                        for line in r.stdout.splitlines() if line.startswith("{")) for k, r in runs.items()}
    assert tokens["3"] == tokens["0"] and len(tokens["0"]) == 2
    bad = CliRunner().invoke(main, [*args, "--speculative-tokens", "17"], env={"DEEPINFER_HF_MODEL_DIR": ""})
    assert bad.exit_code == 2 and "--speculative-tokens" in bad.output
