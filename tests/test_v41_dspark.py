"""DeepSeek-V4.1's DSpark drafter (`model/v41_dspark.py`) against DeepSeek's reference (`forward_spec` of the V4.1
inference code) on the fixture tests/fixtures/v41/dspark (tools/v41_reference/run_tiny.py --dspark: config b with
two draft blocks, taps of layers 4, 6 and 7, block 4, two prompts of 40 tokens past the 6-token window, 8 decode
steps each followed by a draft pass): the tapped streams, the Markov-corrected draft logits, the confidences and
the greedy drafts, with and without the FP8/FP4 cache rounding."""

from __future__ import annotations

import pytest
import torch

from deepinfer.model.v41_cache import V41Cache
from deepinfer.model.v41_compress import Chunk
from deepinfer.model.v41_dspark import V41DSparkDrafter
from deepinfer.runtime.blocks import SeqCache
from tests.v41_fixture import FLIP_TOL, FP32_TOL, assert_logits_close, fixture, without_grids

GAP = 0.1  # greedy drafts are compared where the reference's top-2 gap exceeds this (tests/test_v41_parity.py)


@pytest.mark.parametrize("grid", [True, False], ids=["fp8-fp4-cache", "no-rounding"])
def test_dspark_taps_logits_confidences_and_drafts_equal_the_references(grid):
    fx = fixture("dspark")
    ref = torch.load(fx.path / "dspark.pt")
    suffix = "" if grid else "_nogrid"
    model = fx.model(None if grid else without_grids())
    drafter = V41DSparkDrafter(model)
    cache = V41Cache.empty(fx.cfg, 2, 64, model.dtype, draft_layers=len(model.weights.dspark.blocks),
                           packed=grid)  # unpacked: the latents and index keys kept unrounded
    shares = [SeqCache(slot=b, num_tokens=0, window_start=0) for b in range(2)]
    p = int(ref["prompt_len"])
    for b in range(2):  # each prompt alone; the drafter reads every row (its window keeps the last ones)
        _, taps = model.forward(cache, ref["prompt"][b], [Chunk(b, 0, p, 0)], torch.arange(p), hidden=True)
        if grid:
            assert_logits_close(taps, ref["prefill_main_hidden"][b])
        drafter.read(cache, taps, torch.arange(p), [(shares[b], 0, p)])
    conf_errors = []
    for s, i in enumerate(ref["positions"].tolist()):
        chunks = [Chunk(b, b, 1, i) for b in range(2)]
        logits, taps = model.forward(cache, ref["input_ids"][:, s], chunks, hidden=True)
        if grid:  # the unrounded pass is fed the rounded pass's tokens (its own argmax may differ)
            assert logits.argmax(-1).tolist() == ref["target_next"][:, s].tolist()
            assert_logits_close(taps, ref["main_hidden"][:, s])
        drafter.read(cache, taps, torch.full((2,), i), [(shares[b], b, 1) for b in range(2)])
        anchors = ref["target_next"][:, s]
        base, collapsed = drafter.block(cache, anchors, torch.full((2,), i + 1), torch.arange(2), torch.zeros(2))
        forced, corrected = ref["draft_ids" + suffix][:, s, 1:], []

        def choose(row: torch.Tensor, j: int) -> torch.Tensor:  # the reference's own drafts, so nothing cascades
            corrected.append(row)
            return forced[:, j]

        _, confidence = drafter.markov(base, collapsed, anchors, choose)
        want_logits = ref["draft_logits" + suffix][:, s]
        got_logits = torch.stack(corrected, dim=1)
        assert_logits_close(got_logits, want_logits)
        conf_errors.append((confidence - torch.sigmoid(ref["confidence" + suffix][:, s])).abs())
        top2 = want_logits.topk(2, -1).values
        clear = top2[..., 0] - top2[..., 1] > GAP
        assert clear.sum() > 0
        assert torch.equal(got_logits.argmax(-1)[clear], forced[clear])
        drafts, _ = drafter.markov(base, collapsed, anchors, lambda row, j: row.argmax(-1))
        if clear.all():
            assert torch.equal(drafts, forced)
    conf_errors = torch.stack(conf_errors)
    assert conf_errors.max() <= FLIP_TOL and conf_errors.median() <= FP32_TOL
