"""V4.1's Engram tables split by rows over ranks (`deepinfer/parallel/engram.py`): which ranks split them, each
part's rows, the loader reading only a part, and the parts' lookups adding up to the whole table's. The ranks
themselves (gloo, against one process's logits): tests/test_parallel_v41.py."""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer.config_v41 import V41Config
from deepinfer.errors import WeightsError
from deepinfer.parallel.config import ParallelConfig, Rank
from deepinfer.parallel.engram import EngramShard, TableSplit, table_split
from deepinfer.weights.v41_loader import load_v41
from tests.v41_dirs import quantized_model_dir
from tests.v41_fixture import FIXTURES
from tilekernels.ops.engram_lookup import reference as lookup
from tilekernels.quant import BlockQuantized, quantize


@pytest.mark.parametrize("rows, parts", [(10, 4), (3, 4), (8, 8), (384016682, 8)])
def test_parts_cover_every_row_once(rows, parts):
    spans = [TableSplit(parts, p, False).rows(rows) for p in range(parts)]
    assert spans[0][0] == 0 and sum(c for _, c in spans) == rows
    assert all(f + c == g or c == 0 for (f, c), (g, _) in zip(spans, spans[1:]))
    assert max(c for _, c in spans) == -(-rows // parts)


def test_which_ranks_split_the_tables():
    cfg = V41Config.from_dict(json.loads((FIXTURES / "a" / "config.json").read_text()))
    split = table_split(cfg, Rank(3, 1, ParallelConfig(2, 2, True)))  # lockstep: every rank's forward meets
    assert split == TableSplit(4, 3, True)
    assert table_split(cfg, Rank(3, 1, ParallelConfig(2, 2, False))) == TableSplit(2, 1, False)  # the group
    assert table_split(cfg, Rank(1, 1, ParallelConfig(2, 1, False))) is None  # data-parallel ranks apart: whole
    assert table_split(cfg, Rank(0, 0, ParallelConfig(1, 1, True))) is None


class _Alone:
    """A group of one process: the test adds the parts' outputs itself."""
    dp, device = 1, torch.device("cpu")

    def tp_sum(self, x):
        return x


@pytest.mark.parametrize("rows, parts", [(64, 2), (3, 4)], ids=["halves", "a part without rows"])
def test_the_parts_lookups_add_up_to_the_whole_tables(rows, parts):
    gen = torch.Generator().manual_seed(0)
    table = quantize(torch.randn(rows, 64, generator=gen) * 4, "fp8", (1, 32))
    ids = torch.randint(0, rows, (7, 2, 3), generator=gen)  # 7 tokens, 2 Engram layers, 3 rows each
    total = 0
    for p in range(parts):
        split = TableSplit(parts, p, False)
        first, count = split.rows(rows)
        part = BlockQuantized(table.values[first:first + count], table.scales[first:first + count], table.block,
                              table.format)
        total = total + EngramShard(_Alone(), split, [first] * 2, [count] * 2)(lookup, ids, [part] * 2,
                                                                              torch.float32)
    want = torch.stack([lookup(ids[:, k], table, torch.float32) for k in range(2)], dim=1)
    assert torch.equal(total, want)


def test_the_loader_reads_only_a_parts_rows(tmp_path):
    path = quantized_model_dir(tmp_path)
    cfg = V41Config.from_dict(json.loads((path / "config.json").read_text()))
    whole = load_v41(path, cfg, keep_quantized=True).tensors
    for split in (TableSplit(5, p, False) for p in range(5)):  # five parts: the last one shorter
        part = load_v41(path, cfg, keep_quantized=True, table_rows=split.rows).tensors
        for i, rows in zip(cfg.engram.layer_ids, cfg.engram.num_embeddings):
            name = f"layers.{i}.engram.embed.weight"
            first, count = split.rows(rows)
            assert count < rows and part[name].shape == (count, whole[name].shape[1])
            assert torch.equal(part[name].values, whole[name].values[first:first + count])
            assert torch.equal(part[name].scales, whole[name].scales[first:first + count])
    assert split.rows(cfg.engram.num_embeddings[0])[1] < -(-cfg.engram.num_embeddings[0] // 5)
    with pytest.raises(WeightsError, match=r"engram\.embed\.weight has shape \[\d+, \d+\], but"):
        load_v41(path, V41Config.from_dict({**cfg.raw, "engram_num_embeddings": [r + 1 for r in
                                                                                  cfg.engram.num_embeddings]}),
                 table_rows=split.rows)


def test_a_short_scale_is_refused_on_every_part(tmp_path):
    """A table's scale with a row too few is refused by each part's reader (the first part's rows are all there: a
    slice alone would not see it)."""
    from safetensors.torch import load_file, save_file

    path = quantized_model_dir(tmp_path)
    cfg = V41Config.from_dict(json.loads((path / "config.json").read_text()))
    tensors = load_file(str(path / "model.safetensors"))
    key = f"layers.{cfg.engram.layer_ids[0]}.engram.embed.scale"
    tensors[key] = tensors[key][:-1].contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(WeightsError, match=rf"its scale {key} has \d+ rows, the table \d+"):
        load_v41(path, cfg, keep_quantized=True, table_rows=TableSplit(2, 0, False).rows)
