"""A decode step's row arithmetic made on the host (`deepinfer.model.host_rows`): every value the host sends equals
what the model's own device formula (`StepRows` and the compressors' lambdas) makes for the same key, at every
step of real generations (windows closing, padding rows, a verify step's consecutive rows of one sequence, a
sequence past its first blocks), and the device makes no row arithmetic but the block-table ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import deepinfer
from deepinfer.model import model as model_module
from deepinfer.model.host_rows import HostRows
from deepinfer.model.step_rows import StepRows
from deepinfer.runtime.graph import DecodeGraphs
from deepinfer.runtime.sampling import SamplingParams
from tests.helpers import TINY_A, TINY_B, hf_model

DEVICE_ONLY = {"entry table", "visible", "hca"}  # spans of the whole block table: made on the device


class Checking(StepRows):
    """StepRows that makes every key on first use as the model would on the device, and checks a host-given value
    against it; records the keys it had to make with no host value."""

    made_here: set = set()
    checked: set = set()

    def __init__(self, positions, slots, blocks, given=None, kept=None):
        super().__init__(positions, slots, blocks, None, kept)  # the kept buffers as the model's
        self.given, self.depth = dict(given or {}), 0  # depth: inside the check of a given key

    def get(self, key, make):
        if key not in self._made:
            self.depth += key in self.given
            value = make()
            self.depth -= key in self.given
            if key in self.given:
                want, got = (value, self.given[key]) if isinstance(value, tuple) else ((value,), (self.given[key],))
                for w, g in zip(want, got):
                    assert w.dtype == g.dtype and torch.equal(w, g.view(w.shape)), key
                Checking.checked.add(key[0])
            elif not self.depth:
                Checking.made_here.add(key[0])
            if key[0] == "entry table":  # made in the given buffer: as the plain table
                assert value.data_ptr() == self._kept[("entry table buffer", key[1])].data_ptr()
                assert torch.equal(value, StepRows(self.positions, self.slots, self.blocks).entry_table(key[1]))
                Checking.checked.add("entry table buffer")
            self._made[key] = value
        return self._made[key]


@pytest.fixture(params=["tiny_a", "tiny_b"])
def llm(request, tmp_path, monkeypatch):
    cfg = {"tiny_a": TINY_A, "tiny_b": TINY_B}[request.param]
    hf_model(cfg).save_pretrained(tmp_path / "m")
    monkeypatch.setattr(model_module, "StepRows", Checking)
    Checking.made_here, Checking.checked = set(), set()
    return deepinfer.LLM(tmp_path / "m", max_num_seqs=4), cfg


def test_host_rows_equal_the_device_rows_through_generation(llm):
    llm, cfg = llm
    g = torch.Generator().manual_seed(1)
    reqs = [{"token_ids": torch.randint(2, cfg["vocab_size"], (n,), generator=g).tolist()} for n in (125, 12, 30)]
    params = [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True) for n in (40, 9, 21)]
    llm.generate(reqs, params)  # 3 rows in the 4-row bucket, past position 128 (an HCA window of 128 closes)
    assert Checking.made_here <= DEVICE_ONLY, Checking.made_here - DEVICE_ONLY
    want = {"rotated", "owner", "closed", "closing", "closing entry", "closing at", "attend", "window", "ring",
            "close rows", "overlap rows", "entry table buffer"} | ({"window rows"} if cfg is TINY_B else set())
    assert Checking.checked == want


def test_host_rows_of_a_verify_step_and_a_second_block(llm):
    """Two consecutive rows of one sequence (a verify step's) at positions that close windows, in its second block."""
    llm, _ = llm
    graphs = DecodeGraphs(llm.model, llm.cache, 8, None)
    seq = llm.cache.admit()
    block = llm.cache.spec.block_tokens
    assert llm.cache.grow(seq, block + 8)
    llm.model.prefill(llm.cache, torch.arange(2, block + 5), torch.arange(block + 3), [(seq, 0, block + 3)])
    graphs.run([5, 6], [block + 3, block + 4], [seq, seq])  # position block + 3 closes windows of 4 (and 16)
    assert Checking.made_here <= DEVICE_ONLY
    assert {"close rows", "ring", "attend"} <= Checking.checked


def test_the_packed_rows_are_views_of_one_buffer():
    from deepinfer.config import ModelConfig
    from deepinfer.runtime.cache import CacheLayout, CacheSpec
    layout = CacheLayout.build(ModelConfig.from_dict(TINY_A), CacheSpec(num_blocks=5, max_seqs=2, max_blocks_per_seq=3),
                               torch.float32)
    plan = HostRows(layout.layers, 3)
    packed = np.zeros(plan.nbytes, np.uint8)
    plan.fill(packed, [131], [1], [[4, 2]], scratch_slot=2)
    device = plan.device(torch.from_numpy(packed))
    for value in device.values():
        for t in value if isinstance(value, tuple) else (value,):
            assert t.untyped_storage().data_ptr() == device[("rotated",)].untyped_storage().data_ptr()
    assert device[("rotated",)].tolist() == [131, 0, 0] and device[("owner",)].tolist() == [1, 2, 2]
    # position 131 closes an entry of rate 4 (entry 32 = block 1's entry 0 with 32 entries a block)
    csa = next(c for lay in layout.layers for c in (lay.compressor,) if c is not None and c.rate == 4)
    assert device[("close rows", csa)][0].item() == csa.base + 2 * csa.per_block + 32 % csa.per_block
    assert device[("close rows", csa)][1:].tolist() == [csa.scratch_row] * 2


def test_a_filled_buffer_is_the_one_written():
    """`fill` keeps the views of the buffer it filled last: another buffer gets its own."""
    from deepinfer.config import ModelConfig
    from deepinfer.runtime.cache import CacheLayout, CacheSpec
    layout = CacheLayout.build(ModelConfig.from_dict(TINY_B), CacheSpec(num_blocks=5, max_seqs=2, max_blocks_per_seq=3),
                               torch.float32)
    plan = HostRows(layout.layers, 2)
    a, b = np.zeros(plan.nbytes, np.uint8), np.zeros(plan.nbytes, np.uint8)
    plan.fill(a, [7], [0], [[1]], scratch_slot=2)
    plan.fill(b, [9, 3], [1, 0], [[2], [3]], scratch_slot=2)
    plan.fill(a, [8], [1], [[1]], scratch_slot=2)
    assert plan.device(torch.from_numpy(a))[("rotated",)].tolist() == [8, 0]
    assert plan.device(torch.from_numpy(b))[("rotated",)].tolist() == [9, 3]
    assert plan.device(torch.from_numpy(b))[("owner",)].tolist() == [1, 0]


def test_a_slice_decode_step_makes_only_block_table_rows_on_the_device():
    """Counted on meta tensors (`benchmarks/decode_launches.py --glue`): with the host's rows the V4-Flash slice's
    step runs no row arithmetic of `StepRows` but the entry tables' fill, the indexer's picks and HCA's visible
    list."""
    from benchmarks.decode import SLICE
    from benchmarks.decode_launches import Glue, count

    glue = Glue()
    count(SLICE, 1, False, glue)
    rows = {name for (name, where), n in glue.counts.items() if where.startswith("model/step_rows.py")}
    assert rows <= {"add", "gather", "lt", "where"}, rows  # table fill (add), picks (add, gather), visible (lt, where)
    made = sum(n for (name, where), n in glue.counts.items() if where.startswith("model/step_rows.py"))
    assert made <= 3 + 2 + 2  # a fill per compressor geometry (3 in the slice), the picks, HCA's visible list
