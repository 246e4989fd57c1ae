"""Speculative decoding on DeepSeek-V4.1 with its DSpark drafter (`model/v41_dspark.py`): the output is token for
token plain decoding's, greedy and seeded, with the drafter's own drafts (random weights: almost all rejected)
and with mostly-right drafts (`OracleDrafts`), fixed and varying verify lengths, confidence-sized verification,
mixed prompt lengths past the sliding window; the verify rows through the decode graphs (a CPU stand-in for the
capture); a verify step whose drafts are rejected leaves the cache as a run that never saw them (every piece of
state a later step reads, and the next steps' logits)."""

from __future__ import annotations

import pytest
import torch

import deepinfer
from deepinfer.model.v41_cache import V41Cache
from deepinfer.model.v41_decode import DecodeBatch
from deepinfer.runtime.drafters import DSparkDrafts
from deepinfer.runtime.sampling import SamplingParams
from deepinfer.runtime.speculative import Speculator
from tests.test_speculative import SEEDED, oracle
from tests.v41_dirs import dspark_model_dir

GREEDY = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return dspark_model_dir(tmp_path_factory.mktemp("v41-dspark"))


@pytest.fixture(scope="module")
def plain(path):
    return deepinfer.LLM(path, max_num_seqs=4, speculative_tokens=0)


@pytest.fixture(scope="module")
def spec(path):
    llm = deepinfer.LLM(path, max_num_seqs=4)  # the default: the block's 4 drafts
    assert llm.speculative_tokens == 4 and isinstance(llm.engine.speculator.drafts, DSparkDrafts)
    return llm


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"token_ids": torch.randint(3, 256, (n,), generator=g).tolist()} for n in lengths]


def tokens(outs):
    return [o.token_ids for o in outs]


def test_greedy_equals_plain_decoding_with_dspark_and_mostly_right_drafts(plain, spec):
    reqs = prompts([1, 12, 29])  # one token, past the 6-token window, across ratio-2 groups
    want = plain.generate(reqs, GREEDY, use_tqdm=False)
    assert tokens(spec.generate(reqs, GREEDY, use_tqdm=False)) == tokens(want)
    st = spec.last_stats.spec
    assert st.steps > 0 and st.verify_tokens == st.drafts + st.request_steps
    for accept, k, varied in ((0.8, 4, False), (0.6, 3, True), (1.0, 4, False)):
        oracle(spec, want, accept, k, varied)
        assert tokens(spec.generate(reqs, GREEDY, use_tqdm=False)) == tokens(want), (accept, k, varied)
        st = spec.last_stats.spec
        assert st.steps < spec.last_stats.generated_tokens - len(reqs)  # several tokens a step
        if accept == 1.0:
            assert st.accepted == st.reached and st.mean_accepted > 3
    drafts = oracle_source(spec, want, 0.7)
    spec.engine.speculator = Speculator(spec.engine.steps, 4, drafts, varlen=True)  # confidence-sized
    assert tokens(spec.generate(reqs, GREEDY, use_tqdm=False)) == tokens(want)
    assert spec.last_stats.spec.accepted[0] > 0
    assert spec.cache.used_blocks == 0 and spec.cache.free_slots == 4


def oracle_source(llm, reference, accept):
    from deepinfer.runtime.drafters import OracleDrafts

    return OracleDrafts({i: o.token_ids for i, o in enumerate(reference)}, accept, llm.config.vocab_size)


def test_seeded_outputs_equal_plain_decoding_alone_and_in_a_batch(path, plain):
    reqs = prompts([5, 20, 9, 14], seed=1)
    want = plain.generate(reqs, SEEDED, use_tqdm=False)
    llm = deepinfer.LLM(path, max_num_seqs=4)
    assert tokens(llm.generate(reqs, SEEDED, use_tqdm=False)) == tokens(want)  # DSpark's own drafts
    oracle(llm, want, 0.8, 4, True)
    got = llm.generate(reqs, SEEDED, use_tqdm=False)
    assert tokens(got) == tokens(want) and llm.last_stats.spec.accepted[0] > 0
    assert llm.generate(reqs[1], SEEDED[1], use_tqdm=False)[0].token_ids == want[1].token_ids


def test_chunked_prompts_over_the_lookahead_rings_equal_plain_decoding(path, plain):
    """Prompts prefilled 5 tokens a step (chunks starting inside a ratio-2 group, on rings with the lookahead's
    rows) and then verified: plain decoding's tokens."""
    reqs = prompts([29, 12, 17], seed=3)
    want = plain.generate(reqs, GREEDY, use_tqdm=False)
    llm = deepinfer.LLM(path, max_num_seqs=4, max_prefill_tokens=5)
    oracle(llm, want, 0.8, 4)
    assert tokens(llm.generate(reqs, GREEDY, use_tqdm=False)) == tokens(want)
    assert llm.last_stats.spec.accepted[0] > 0 and llm.cache.paged.lookahead == 4


def _capture(fn):
    """A stand-in for a CUDA graph capture: replays eagerly into the captured outputs."""
    out = fn()
    parts = out if isinstance(out, tuple) else (out,)

    def replay():
        new = fn()
        for a, b in zip(parts, new if isinstance(new, tuple) else (new,)):
            a.copy_(b)
    return out, replay


def test_verify_rows_and_draft_passes_through_graphs_give_the_same_tokens(path, plain):
    """Verify steps replay the decode graphs (buckets of rows: requests x (1 + drafts)), the block pass DSpark's
    graphs, both under the stand-in capture: the eager run's tokens and acceptance."""
    from deepinfer.runtime.speculative import speculator
    from deepinfer.runtime.v41_steps import V41Steps

    reqs = prompts([7, 23, 15], seed=2)
    want = plain.generate(reqs, GREEDY, use_tqdm=False)
    llm = deepinfer.LLM(path, max_num_seqs=4)
    eager = llm.generate(reqs, GREEDY, use_tqdm=False)
    eager_stats = llm.last_stats.spec
    steps = V41Steps(llm.engine.steps.model, llm.engine.steps.cache, _capture)
    llm.engine.steps = steps
    llm.engine.speculator = speculator(steps, 4)
    llm.engine.capture_all()
    got = llm.generate(reqs, GREEDY, use_tqdm=False)
    assert tokens(got) == tokens(want) == tokens(eager)
    assert llm.last_stats.spec.accepted == eager_stats.accepted
    assert steps.decode_graphs.buckets[-1] == 4 * 5 and steps.decode_graphs.last_taps is not None
    assert llm.engine.speculator.drafts.graphs is not None


def _state(cache: V41Cache, slot: int, end: int) -> dict[str, torch.Tensor]:
    """Every piece of a slot's state a step at position `end` reads: the window rows of the positions before it,
    each source's latents and index keys of the groups closed before it and the open group's projected rows, the
    Engram classes of the last positions."""
    cfg, out = cache.cfg, {}
    win = cfg.sliding_window
    seen = torch.arange(max(0, end - win + 1), end)
    for i, ring in enumerate(cache.windows):
        out[f"window {i}"] = ring[slot, seen % ring.shape[1]]
    for src, state in cache.compressed.items():
        entries = torch.arange(end // state.ratio)
        rows = state.rows(slot, entries)
        out[f"latents {src}"] = torch.cat([t[rows] for t in state.latents.tensors()], dim=-1)
        if state.keys is not None:
            out[f"keys {src}"] = torch.cat([t[rows] for t in state.keys.tensors()], dim=-1)
        if state.partial_kv is not None:
            open_rows = torch.arange(end - end % state.ratio, end) % state.partial_kv.shape[1]
            out[f"open kv {src}"] = state.partial_kv[slot, open_rows]
            out[f"open score {src}"] = state.partial_score[slot, open_rows]
    back = torch.arange(max(0, end - cfg.engram.max_ngram + 1), end)
    out["classes"] = cache.classes[slot, back % cache.classes.shape[1]]
    return out


@pytest.mark.parametrize("prompt,kept", [(11, 1), (12, 1), (11, 2), (12, 2), (9, 3), (20, 4), (20, 5)])
def test_rejected_verify_rows_leave_the_cache_of_a_run_that_never_drafted_them(spec, prompt, kept):
    """Slot 0: a prompt, then one verify step of its last token and 4 drafts (decode rows of one sequence) of which
    `kept` rows stand (ending inside a ratio-2 group or on its boundary, or all kept). Slot 1: the same prompt, then the kept tokens decoded one at a time. Every piece of state the
    next step reads is equal (to fp32 rounding; FP4 codes up to a rare rounding flip), the kept rows' logits too,
    and so are the next three steps' logits."""
    model = spec.model
    g = torch.Generator().manual_seed(prompt)
    ids = torch.randint(3, 256, (prompt + 4,), generator=g)
    cache = V41Cache.empty(model.cfg, 2, 64, model.dtype, lookahead=4)
    for slot in (0, 1):
        model.prefill(cache, ids[: prompt - 1], slot)
    rows = ids[prompt - 1 :]  # the newest token and 4 drafts at positions prompt - 1 ..
    step = DecodeBatch(torch.zeros(5, dtype=torch.long), torch.arange(prompt - 1, prompt + 4), 63)
    with torch.inference_mode():
        verify = model.decode_step(cache, rows, step)
    end = prompt - 1 + kept
    cache.num_tokens[0] = end
    alone = [model.decode(cache, rows[j : j + 1], [1]) for j in range(kept)]
    torch.testing.assert_close(verify[:kept], torch.cat(alone), rtol=1e-4, atol=1e-4)
    a, b = _state(cache, 0, end), _state(cache, 1, end)
    for name in a:
        assert a[name].shape == b[name].shape, name
        if a[name].dtype in (torch.uint8, torch.int64):
            assert (a[name] != b[name]).float().mean() < 0.02, name  # FP4 codes: a rare rounding flip
        else:
            torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-4, msg=name)
    nxt = (ids[end:].tolist() + [0, 0, 0])[:3]
    for j in range(3):  # not the rejected drafts: the real tokens differ from them
        token = torch.tensor([(nxt[j] + 1 + j) % 256])
        torch.testing.assert_close(model.decode(cache, token, [0]), model.decode(cache, token, [1]), rtol=1e-3,
                                   atol=1e-3)
