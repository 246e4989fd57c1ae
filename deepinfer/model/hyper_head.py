"""The mHC HyperHead through the pre-block's kernels.

The HyperHead (`hc_head`: the final collapse of the N residual streams before the norm and the LM head) is the
pre-block's pre mix and collapse alone: the same RMS statistic over the N*H values, the same `sigmoid(mix * scale +
base) + hc_eps` weights, the same fp32 weighted sum. So its weights are laid out once, at load, as a pre-block's
(its N mixing rows, then zero post and comb rows whose mixes are dropped; scales [s, 1, 1]) and `hc_pre` runs it: the
two kernels every layer already uses (same variant: no build of its own) instead of the reference's fifteen PyTorch
kernels (~28 us a decode step at one token on the H200)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.model.weights import HyperConnection
from tilekernels import OpTable


@dataclass(frozen=True)
class HeadAsPre:
    fn: torch.Tensor  # [(2+N)N, N*H] fp32: the head's N rows, then zeros
    base: torch.Tensor  # [(2+N)N] fp32
    scale: torch.Tensor  # [3] fp32: the head's scale, then ones

    @classmethod
    def of(cls, hc: HyperConnection) -> HeadAsPre:
        n = hc.fn.shape[0]
        rest = (2 + n) * n - n
        fn, base, scale = hc.fn.float(), hc.base.float(), hc.scale.float()
        return cls(torch.cat([fn, fn.new_zeros(rest, fn.shape[1])]).contiguous(),
                   torch.cat([base, base.new_zeros(rest)]).contiguous(),
                   torch.cat([scale.view(1), scale.new_ones(2)]).contiguous())


def collapse(ops: OpTable, streams: torch.Tensor, head: HeadAsPre, iters: int, hc_eps: float,
             norm_eps: float, norm: torch.Tensor | None = None) -> torch.Tensor:
    """streams [T, N, H] -> the HyperHead's collapse [T, H] in streams' dtype (`iters`: the layers' Sinkhorn
    iterations, so that the kernels are theirs; the comb they produce is dropped); `norm`: RMS-normalized with
    that weight (the final norm) in the same kernel."""
    return ops.hc_pre(streams, head.fn, head.base, head.scale, iters, hc_eps, norm_eps, norm)[2]
