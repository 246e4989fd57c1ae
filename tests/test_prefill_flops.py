"""benchmarks/decode.py's count of a prefill's useful FLOPs (the yardstick of the prefill aim), on the tiny config:
attention rows by hand, the routed experts at top-k of E, lm_head once."""

from deepinfer.config import ModelConfig
from deepinfer.model.weights import tensor_specs
from tests.helpers import TINY_A

from benchmarks.decode import prefill_flops


def flops(n: int, **over) -> float:
    cfg = ModelConfig.from_dict({**TINY_A, **over})
    return prefill_flops(cfg, tensor_specs(cfg), n)


def test_attention_rows_by_hand():
    """10 tokens, a window of 4: 1 + 2 + 3 + 7 x 4 = 34 window rows on each of the 5 layers; the CSA layers (ratio 4,
    top-4) add each position's closed entries, 0,0,0,1,1,1,1,2,2,2 (10), and their indexer scores those 10 with 8
    heads of 16; the HCA layers (ratio 128) close nothing yet. The weights' FLOPs are the same for every token."""
    heads, dim, lm_head = 4, 32, 2 * 512 * 64
    weights = flops(1, sliding_window=4) - 4 * 5 * heads * dim - lm_head  # one token: one row per layer
    rows = 5 * 34 + 2 * 10
    index = 2 * 2 * 10 * 8 * 16
    assert flops(10, sliding_window=4) == 10 * weights + 4 * rows * heads * dim + index + lm_head
    assert weights > 0


def test_routed_experts_count_at_top_k():
    """Two more experts per token add 2 x (gate, up, down) x H x I FLOPs per token and layer, nothing else."""
    n, layers, h, i = 7, 5, 64, 32
    assert flops(n, num_experts_per_tok=4) - flops(n, num_experts_per_tok=2) == n * layers * 2 * 2 * 3 * h * i


def test_lm_head_counts_once():
    """The vocabulary's projection is counted for the last token only (a prefill samples one token)."""
    grow = flops(3, vocab_size=1024) - flops(3)
    assert grow == 2 * 512 * 64  # the embedding is not a GEMM: only lm_head's 512 more rows, once
