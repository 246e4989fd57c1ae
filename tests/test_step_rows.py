"""A decode step's shared rows (`deepinfer.model.step_rows.StepRows`, made in few kernels) equal the rows written out
plainly here (the cache layout's old per-use formulas), on every layer geometry: a step at positions around window
boundaries with padding rows and a verify step's consecutive rows of one sequence, and a random step."""

from __future__ import annotations

import pytest
import torch

from deepinfer.config import ModelConfig
from deepinfer.model.step_rows import StepRows
from deepinfer.runtime.cache import CacheLayout, CacheSpec
from tests.helpers import ODD_A, TINY_A, TINY_B

CONFIGS = {"tiny_a": TINY_A, "tiny_b": TINY_B, "odd_a": ODD_A}
SPEC = CacheSpec(num_blocks=11, max_seqs=3, max_blocks_per_seq=4, lookahead=2)


def boundary_step(layout: CacheLayout, seed: int):
    """9 rows: 7 sequences at positions around window boundaries (0, rate - 1, rate, ...), two rows of one sequence
    at consecutive positions, and a padding row (scratch slot and blocks)."""
    spec, gen = layout.spec, torch.Generator().manual_seed(seed)
    positions = torch.tensor([0, 3, 4, 127, 128, 131, 255, 300, 301, 0])
    positions = torch.minimum(positions, torch.tensor(spec.max_tokens - 1))
    slots = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 1, layout.scratch_slot])
    blocks = torch.randint(0, spec.num_blocks, (positions.numel(), spec.max_blocks_per_seq), generator=gen)
    blocks[-1] = layout.scratch_block
    return positions, slots, blocks


def random_step(layout: CacheLayout, seed: int):
    spec, gen, b = layout.spec, torch.Generator().manual_seed(seed), 5
    slots = torch.randint(0, spec.max_seqs + 1, (b,), generator=gen)
    positions = torch.randint(0, spec.max_tokens, (b,), generator=gen)
    positions[0] = 0
    return positions, slots, torch.randint(0, spec.num_blocks + 1, (b, spec.max_blocks_per_seq), generator=gen)


def entry_rows(cl, blocks, entries):
    return cl.base + blocks.gather(-1, entries // cl.per_block) * cl.per_block + entries % cl.per_block


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("make, seed", [(boundary_step, 0), (boundary_step, 1), (random_step, 0)])
def test_step_rows_equal_the_plain_rows(name, make, seed):
    layout = CacheLayout.build(ModelConfig.from_dict(CONFIGS[name]), SPEC, torch.float32)
    pos, slots, blocks = make(layout, seed)
    rows = StepRows(pos, slots, blocks)
    checked = 0
    for lay in layout.layers:
        win = pos.view(-1, 1) + torch.arange(-lay.window + 1, 1).view(1, -1)
        want = torch.where(win >= 0, slots.view(-1, 1) * lay.ring + win % lay.ring, -1)
        assert torch.equal(rows.attend(lay), want)
        assert torch.equal(rows.window(lay), slots * lay.ring + pos % lay.ring)
        assert torch.equal(rows.window(lay), lay.window_rows(slots, pos))
        for cl in (lay.compressor, lay.indexer):
            if cl is None:
                continue
            checked += 1
            closed, closing = (pos + 1) // cl.rate, (pos + 1) % cl.rate == 0
            assert torch.equal(rows.closed(cl.rate), closed) and torch.equal(rows.closing(cl.rate), closing)
            closes = torch.clamp(closed - 1, min=0)
            assert torch.equal(rows.closing_entry(cl.rate), closes)
            scratch = cl.base + layout.scratch_block * cl.per_block
            want = torch.where(closing, entry_rows(cl, blocks, closes.view(-1, 1)).view(-1), scratch)
            assert torch.equal(rows.close_rows(cl), want)
            entry = torch.arange(blocks.shape[1] * cl.per_block).view(1, -1).expand(pos.numel(), -1)
            assert torch.equal(rows.keys(cl), entry_rows(cl, blocks, entry))
            want = torch.where(entry < closed.view(-1, 1), entry_rows(cl, blocks, entry), -1)
            assert torch.equal(rows.visible(cl), want)
            picks = torch.randint(0, entry.shape[1], (pos.numel(), 5), generator=torch.Generator().manual_seed(7))
            picks[::2, -2:] = -1  # the top-k's empty picks
            want = torch.where(picks >= 0, entry_rows(cl, blocks, picks.clamp(min=0)), -1)
            assert torch.equal(rows.picked(cl, picks), want)
            assert make is random_step or closing.any()  # the boundary step closes windows of every rate
    assert checked >= 2


def test_each_row_is_made_once_per_step():
    layout = CacheLayout.build(ModelConfig.from_dict(TINY_A), SPEC, torch.float32)
    rows = StepRows(*boundary_step(layout, 0))
    comp = next(lay.compressor for lay in layout.layers if lay.compressor is not None)
    assert rows.close_rows(comp) is rows.close_rows(comp)
    assert rows.entry_table(comp) is rows.entry_table(comp)
    assert rows.attend(layout.layers[0]) is rows.attend(layout.layers[1])  # same window geometry: shared
