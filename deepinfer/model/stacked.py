"""The projections of an attention block that read the same input (`q_a`, `kv`, and on CSA/HCA layers the
compressor's and the indexer's kv, gate and scorer weights) stacked along N once at load, one weight per storage
format, so that a step runs one GEMM where it ran up to seven: at one token each of those GEMMs is a few us of
launch, pipeline fill and tail for 1-8 MB of weight.

Parts join a stack when they share the storage (the dtype of a plain weight; format and block of a block-quantized
one) and, block-quantized, every part but the last ends on a block boundary (the scale grid stays one grid). The
block's own fields become row views of the stack, so no weight is held twice. A step splits the GEMM's output back
into the parts (column views)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tilekernels.quant import BlockQuantized, cat_rows

Weight = torch.Tensor | BlockQuantized


@dataclass(frozen=True)
class Stacked:
    """One stacked weight [sum(sizes), K] and the parts it holds, in its row order."""

    weight: Weight
    names: tuple[str, ...]
    sizes: tuple[int, ...]


def _storage(w: Weight) -> tuple:
    if isinstance(w, BlockQuantized):
        return ("block", w.format, w.block, w.values.dtype, w.scales.dtype, w.layout)
    return ("plain", w.dtype, w.device.type)


def _rows(w: Weight, start: int, length: int) -> Weight:
    """Rows start .. start + length of a stacked weight, as a view (block-quantized: `start` is on a block boundary)."""
    if not isinstance(w, BlockQuantized):
        return w[start:start + length]
    bn = w.block[0]
    return BlockQuantized(w.values[start:start + length], w.scales[start // bn:-(-(start + length) // bn)], w.block,
                          w.format)


def stack(parts: list[tuple[str, Weight]]) -> tuple[tuple[Stacked, ...], dict[str, Weight]]:
    """(the stacks of two parts or more, every part by name: a row view of its stack, or itself when alone)."""
    groups: list[list[tuple[str, Weight]]] = []
    for name, w in parts:
        if w.dim() != 2:
            groups.append([(name, w)])
            continue
        for g in groups:
            last = g[-1][1]
            fits = _storage(last) == _storage(w) and last.dim() == 2 and last.shape[-1] == w.shape[-1]
            if fits and isinstance(w, BlockQuantized):
                fits = sum(p.shape[-2] for _, p in g) % w.block[0] == 0
            if fits:
                g.append((name, w))
                break
        else:
            groups.append([(name, w)])
    stacks, views = [], {}
    for g in groups:
        if len(g) == 1:
            views[g[0][0]] = g[0][1]
            continue
        ws = [w for _, w in g]
        weight = cat_rows(ws) if isinstance(ws[0], BlockQuantized) else torch.cat(ws, dim=0)
        sizes = tuple(w.shape[-2] for w in ws)
        start = 0
        for (name, _), size in zip(g, sizes):
            views[name] = _rows(weight, start, size)
            start += size
        stacks.append(Stacked(weight, tuple(name for name, _ in g), sizes))
    return tuple(stacks), views


def project_all(ops, x: torch.Tensor, stacks: tuple[Stacked, ...]) -> dict[str, torch.Tensor]:
    """x [N, K] through every stack: each part's output [N, size] by name (column views of the stack's output)."""
    out: dict[str, torch.Tensor] = {}
    for s in stacks:
        out.update(zip(s.names, ops.linear(x, s.weight).split(s.sizes, dim=-1)))
    return out
