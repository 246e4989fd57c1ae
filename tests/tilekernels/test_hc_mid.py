"""`hc_mid`'s choice of form (traced on meta tensors, as the compile plan does), and what a decode step launches
with it: the post-block's kernel writes the next pre-block's partials at decode rows, every collapse comes out
normalized, so a decode step runs one partials kernel (the first layer's) and no separate norm of a collapse."""

from __future__ import annotations

import pytest
import torch

from tilekernels.kernels import Recorder, table
from tilekernels.ops import hc_mid


def launched(rows: int, hidden: int = 4096, hc: int = 4, invariant: bool = False) -> list[tuple[str, str]]:
    recorder = Recorder(invariant)
    mix = (2 + hc) * hc

    def meta(*shape, dtype=torch.float32):
        return torch.empty(*shape, dtype=dtype, device="meta")

    table(recorder).hc_mid(meta(rows, hc, hidden, dtype=torch.bfloat16), meta(rows, hidden, dtype=torch.bfloat16),
                           meta(rows, hc), meta(rows, hc, hc), meta(mix, hc * hidden), meta(mix), meta(3), 20, 1e-6,
                           1e-6, meta(hidden))
    return [(op, kernel) for op, kernel, _ in recorder.seen]


@pytest.mark.parametrize("rows", [1, hc_mid.FUSED_ROWS])
def test_decode_rows_take_the_fused_form(rows):
    assert launched(rows) == [("hc_mid", "hc_mid_post"), ("hc_pre", "hc_pre_finish")]


@pytest.mark.parametrize("rows, hidden, hc, invariant", [
    (hc_mid.FUSED_ROWS + 1, 4096, 4, False),  # prefill rows
    (1, 4096, 4, True),  # the batch-invariant mode: the same kernels at every row count
    (1, 48, 2, False),  # no fused form: 96 values a row, not a multiple of the GPU threads
])
def test_otherwise_the_post_block_then_the_pre_block(rows, hidden, hc, invariant):
    assert launched(rows, hidden, hc, invariant) == [("hc_post", "hc_post"), ("hc_pre", "hc_pre_split"),
                                                      ("hc_pre", "hc_pre_finish")]


def test_a_slice_decode_step_runs_one_partials_kernel_and_no_collapse_norm():
    from benchmarks.decode import SLICE
    from benchmarks.decode_launches import count
    from deepinfer.config import ModelConfig

    layers = ModelConfig.from_model_dir(SLICE).num_hidden_layers
    one, wide = count(SLICE, 1, False), count(SLICE, hc_mid.FUSED_ROWS + 1, False)
    assert one[("hc_mid", "hc_mid_post")] == 2 * layers and ("hc_post", "hc_post") not in one
    assert one[("hc_pre", "hc_pre_split")] == 1 and one[("hc_pre", "hc_pre_finish")] == 2 * layers + 1
    assert wide[("hc_pre", "hc_pre_split")] == 2 * layers + 1 and wide[("hc_post", "hc_post")] == 2 * layers
    # the norms left are the attention's own (query and key latents), the same at both sizes
    assert one[("rms_norm", "rms_norm")] == wide[("rms_norm", "rms_norm")]
