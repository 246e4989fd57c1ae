"""A decode step's shared rows (`deepinfer.model.step_rows.StepRows`, made in few kernels) equal the cache layout's
row methods they stand for, on every layer geometry, with padding rows, positions before and at window boundaries,
and a verify step's consecutive positions of one sequence."""

from __future__ import annotations

import pytest
import torch

from deepinfer.config import ModelConfig
from deepinfer.model.step_rows import StepRows
from deepinfer.runtime.cache import CacheLayout, CacheSpec
from tests.helpers import ODD_A, TINY_A, TINY_B

CONFIGS = {"tiny_a": TINY_A, "tiny_b": TINY_B, "odd_a": ODD_A}


def step(layout: CacheLayout, seed: int):
    """A step of 9 rows: 7 sequences at positions around window boundaries (0, rate - 1, rate, ...), two rows of one
    sequence at consecutive positions, and a padding row (scratch slot and blocks)."""
    spec, gen = layout.spec, torch.Generator().manual_seed(seed)
    positions = torch.tensor([0, 3, 4, 127, 128, 131, 255, 300, 301, 0])
    positions = torch.minimum(positions, torch.tensor(spec.max_tokens - 1))
    slots = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 1, layout.scratch_slot])
    blocks = torch.randint(0, spec.num_blocks, (positions.numel(), spec.max_blocks_per_seq), generator=gen)
    blocks[-1] = layout.scratch_block
    return positions, slots, blocks


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("seed", [0, 1])
def test_step_rows_equal_the_layout_rows(name, seed):
    cfg = ModelConfig.from_dict(CONFIGS[name])
    layout = CacheLayout.build(cfg, CacheSpec(num_blocks=11, max_seqs=3, max_blocks_per_seq=4, lookahead=2),
                               torch.float32)
    positions, slots, blocks = step(layout, seed)
    rows = StepRows(positions, slots, blocks)
    checked = 0
    for lay in layout.layers:
        assert torch.equal(rows.attend(lay), lay.attend_rows(slots, positions))
        assert torch.equal(rows.window(lay), lay.window_rows(slots, positions))
        for comp in (lay.compressor, lay.indexer):
            if comp is None:
                continue
            checked += 1
            rate = comp.rate
            assert torch.equal(rows.closed(rate), comp.closed(positions))
            assert torch.equal(rows.closing(rate), comp.closing(positions))
            assert torch.equal(rows.closing_entry(rate), comp.closing_entry(positions))
            assert torch.equal(rows.close_rows(comp), comp.close_rows(blocks, positions))
            entries = comp.table_entries(blocks)
            assert torch.equal(rows.keys(comp), comp.entry_rows(blocks, entries))
            want = comp.picked_rows(blocks, torch.where(entries < comp.closed(positions).view(-1, 1), entries, -1))
            assert torch.equal(rows.visible(comp), want)
            picks = torch.randint(0, entries.shape[1], (positions.numel(), 5), generator=torch.Generator().manual_seed(7))
            picks[::2, -2:] = -1  # the top-k's empty picks
            assert torch.equal(rows.picked(comp, picks), comp.picked_rows(blocks, picks))
            assert (picks == -1).any() and (rows.closing(rate)).any()  # both branches of -1 and closing exercised
    assert checked >= 2


def test_each_row_is_made_once_per_step():
    cfg = ModelConfig.from_dict(TINY_A)
    layout = CacheLayout.build(cfg, CacheSpec(num_blocks=11, max_seqs=3, max_blocks_per_seq=4), torch.float32)
    rows = StepRows(*step(layout, 0))
    comp = next(lay.compressor for lay in layout.layers if lay.compressor is not None)
    assert rows.close_rows(comp) is rows.close_rows(comp)
    assert rows.entry_table(comp) is rows.entry_table(comp)
    assert rows.attend(layout.layers[0]) is rows.attend(layout.layers[1])  # same window geometry: shared
