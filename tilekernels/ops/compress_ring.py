"""The compressors' pooling at decode, read straight from their buffer rings: `compress_pool` of each row's window
without the gathered [B, S, width] copies (V4, `deepinfer/model/compressor.py`'s `compress_decode`).

A compressor keeps each sequence's last projected kv and gate rows in a ring (`buf_kv`, `buf_gate` [slots, ring,
width]); at decode every row pools the window its position is in. Slot s of row b reads ring row `rows[b, s]` of
sequence `owner[b]` (-1: an empty slot, gate -inf: CSA's first window has no predecessor), adds the position bias
row `s % rate` to the gate, and takes the channels of its series: with overlap (width = 2 d, S = 2 rate) the first
`rate` slots are the prior window's first series (channels 0..d-1), the last `rate` the window's own second series
(channels d..2d-1); without (width = d, S = rate) every channel. Then, per channel, the softmax over the S slots
weighs the kv sum (fp32), as `compress_pool`.

This replaces, per compressor and step, the ring gathers, the bias add, the empty-slot fill and the series
concatenation (9 small PyTorch kernels with overlap) and the pooling kernel by one kernel: 4.1-4.4 us a call for
CSA's 8 slots and its indexer's on the H200 at one row (the path it replaces: an estimated ~15, from the per-kernel
profile). At HCA's 128 slots it took 35 us at one row (8 CTAs of 64 threads, each thread gathering 32 rounds of a
ring-row index and the kv / gate it addresses), where gathering with PyTorch and pooling with `compress_pool` (one
2D copy of the window, the same pooling loop in ~2 us) takes an estimated ~9: the gather's loads are not overlapped
enough. The model therefore runs this kernel up to GATHER_SLOTS slots. Reading each series as a 2D copy (a window's
ring rows are consecutive when the ring is a multiple of the rate) and more CTAs per row would lift that bound: not
done (no device time left to measure it).
"""

from dataclasses import dataclass

import torch

from tilekernels import dtypes
from tilekernels.op import Kernel, OpDecl, require
from tilekernels.ops import compress_pool


def reference(buf_kv: torch.Tensor, buf_gate: torch.Tensor, bias: torch.Tensor, owner: torch.Tensor,
              rows: torch.Tensor) -> torch.Tensor:
    """buf_kv, buf_gate [slots, ring, width], bias [rate, width] fp32, owner [B], rows [B, S] (S = rate, or 2 rate
    with overlap; -1 marks an empty slot) -> [B, d] in buf_kv's dtype (d = width, or width / 2 with overlap)."""
    rate, width = bias.shape
    s = rows.shape[1]
    at = (owner.long().view(-1, 1), rows.long().clamp(min=0))
    kv = buf_kv[at]
    gate = buf_gate[at] + bias.repeat(s // rate, 1)
    if s != rate:  # overlap: the prior window's first series, then this window's second
        d = width // 2
        kv = torch.cat([kv[:, :rate, :d], kv[:, rate:, d:]], dim=1)
        gate = torch.cat([gate[:, :rate, :d], gate[:, rate:, d:]], dim=1)
    gate = gate.masked_fill((rows < 0).unsqueeze(-1), float("-inf"))
    return compress_pool.reference(kv, gate)


GATHER_SLOTS = 16  # the longest window (slots) the model pools with this kernel (see above)


@dataclass(frozen=True)
class Variant:
    rate: int
    slots: int  # S: rate, or 2 * rate with overlap
    ring: int  # buffer rows per sequence
    width: int  # channels of a ring row: d, or 2 d with overlap
    dtype: str  # buf_kv's (and the output's)
    gate_dtype: str = "float32"

    @property
    def dim(self) -> int:
        return self.width if self.slots == self.rate else self.width // 2


@dataclass(frozen=True)
class Config:
    block: int = 64  # channels per tile (a multiple of `threads`)
    threads: int = 64


def body(P, v: Variant, cfg: Config):
    T = P.T
    S, R, RING, WID, D, dtype, gdtype = v.slots, v.rate, v.ring, v.width, v.dim, v.dtype, v.gate_dtype
    SECOND = WID - D  # channel offset of the second series (0 without overlap)
    BD = min(cfg.block, D)
    NB = -(-D // BD)
    BP = P.padded(BD, cfg.threads)
    # whole channel blocks are staged through on-chip buffers, a ragged last block or a padded register width is
    # read element-wise with clamped channels (as compress_pool)
    staged = D % BD == 0 and BP == BD
    SS, SB = (S, BD) if staged else (1, 1)
    B = T.dynamic("B")
    NS = T.dynamic("NS")

    def off(s):
        return T.if_then_else(s >= S - R, SECOND, 0)

    def biased(G, Bias, Owner, row, s, c):
        """Slot s's gate at channel c of its series: the ring's, plus the position bias; -inf for an empty slot."""
        g = T.cast(G[Owner, T.max(row, 0), off(s) + c], "float32") + Bias[s % R, off(s) + c]
        return T.if_then_else(row < 0, -T.infinity("float32"), g)

    def gate_at(G, g_io, Bias, Owner, Rows, b, c0, s, j):
        if staged:
            return g_io[s, j]
        return biased(G, Bias, Owner[b], Rows[b, s], s, T.min(c0 + j, D - 1))

    def kv_at(KV, kv_io, Owner, Rows, b, c0, s, j):
        if staged:
            return T.cast(kv_io[s, j], "float32")
        return T.cast(KV[Owner[b], T.max(Rows[b, s], 0), off(s) + T.min(c0 + j, D - 1)], "float32")

    @T.prim_func
    def kernel(KV: T.Tensor((NS, RING, WID), dtype), G: T.Tensor((NS, RING, WID), gdtype),
               Bias: T.Tensor((R, WID), "float32"), Owner: T.Tensor((B,), "int32"), Rows: T.Tensor((B, S), "int32"),
               Out: T.Tensor((B, D), dtype)):
        with P.kernel(B * NB, cfg.threads) as pid:
            kv_io = P.alloc_io((SS, SB), dtype)
            g_io = P.alloc_io((SS, SB), "float32")  # biased gates
            o_io = P.alloc_io((SB,), dtype)
            for t in P.tiles(B * NB, pid):
                b = t // NB
                c0 = (t % NB) * BD
                if staged:  # the window's slots gathered into on-chip tiles by all threads at once; the ring rows
                    # are read from global memory (from a shared copy every load would wait for the stores before it)
                    with P.vector(cfg.threads):
                        for s, j in T.Parallel(S, BD):
                            kv_io[s, j] = KV[Owner[b], T.max(Rows[b, s], 0), off(s) + c0 + j]
                            g_io[s, j] = biased(G, Bias, Owner[b], Rows[b, s], s, c0 + j)
                with P.vector(cfg.threads):
                    mx = P.alloc_reg((BP,), "float32")
                    den = P.alloc_reg((BP,), "float32")
                    acc = P.alloc_reg((BP,), "float32")

                    for j in T.Parallel(BP):
                        mx[j] = gate_at(G, g_io, Bias, Owner, Rows, b, c0, 0, j)
                        den[j] = 0.0
                        acc[j] = 0.0
                    for s in T.serial(1, S):
                        for j in T.Parallel(BP):
                            mx[j] = T.max(mx[j], gate_at(G, g_io, Bias, Owner, Rows, b, c0, s, j))
                    for s in T.serial(S):
                        for j in T.Parallel(BP):
                            e = T.exp(gate_at(G, g_io, Bias, Owner, Rows, b, c0, s, j) - mx[j])  # all empty: nan, as the reference
                            den[j] = den[j] + e
                            acc[j] = acc[j] + e * kv_at(KV, kv_io, Owner, Rows, b, c0, s, j)
                    for j in T.Parallel(BP):
                        if staged:
                            o_io[j] = T.cast(acc[j] / den[j], dtype)
                        else:
                            if c0 + j < D:
                                Out[b, c0 + j] = T.cast(acc[j] / den[j], dtype)
                if staged:
                    T.copy(o_io, Out[b, c0 : c0 + BD])

    return kernel


KERNEL = Kernel("compress_ring", body, configs={"default": Config(), "c": Config(block=64, threads=1)})
ACCEPTED = tuple(dtypes.NAMES)


def variant(buf_kv: torch.Tensor, buf_gate: torch.Tensor, bias: torch.Tensor, rows: torch.Tensor) -> Variant:
    """The kernel variant `run` launches for these inputs (no tensor values are read: meta tensors work)."""
    return Variant(bias.shape[0], rows.shape[1], buf_kv.shape[1], buf_kv.shape[2], dtypes.name(buf_kv.dtype),
                   dtypes.name(buf_gate.dtype))


def run(launch, buf_kv: torch.Tensor, buf_gate: torch.Tensor, bias: torch.Tensor, owner: torch.Tensor,
        rows: torch.Tensor) -> torch.Tensor:
    op = "compress_ring"
    require(buf_kv.dim() == 3, op, f"buf_kv must be [slots, ring, width], got {list(buf_kv.shape)}")
    require(buf_gate.shape == buf_kv.shape, op, f"buf_gate must be buf_kv's shape {list(buf_kv.shape)}, "
                                                f"got {list(buf_gate.shape)}")
    for name, t in (("buf_kv", buf_kv), ("buf_gate", buf_gate)):
        require(t.dtype in ACCEPTED, op, f"{name} dtype {t.dtype} is not one of {[str(a) for a in ACCEPTED]}")
    width = buf_kv.shape[2]
    require(bias.dim() == 2 and bias.shape[1] == width, op,
            f"bias must be [rate, {width}] (the ring's width), got {list(bias.shape)}")
    rate = bias.shape[0]
    require(rows.dim() == 2 and rows.shape[1] in (rate, 2 * rate), op,
            f"rows must be [B, {rate}] or [B, {2 * rate}] (rate {rate}, or twice with overlap), got {list(rows.shape)}")
    require(rows.shape[1] == rate or width % 2 == 0, op, f"overlap needs an even width (two series), got {width}")
    require(owner.shape == rows.shape[:1], op, f"owner must be [{rows.shape[0]}] (one per row), got {list(owner.shape)}")
    require(rows.shape[1] <= compress_pool.MAX_SLOTS, op,
            f"slots per window {rows.shape[1]}; accepted: up to {compress_pool.MAX_SLOTS}")
    v = variant(buf_kv, buf_gate, bias, rows)
    out = torch.empty(rows.shape[0], v.dim, dtype=buf_kv.dtype, device=buf_kv.device)
    if rows.shape[0]:
        launch("compress_ring", v)(buf_kv, buf_gate, bias.float().contiguous(), owner.to(torch.int32).contiguous(),
                                   rows.to(torch.int32).contiguous(), out)
    return out


def example(v: Variant, rows: int, device) -> tuple:
    """Rings of 3 sequences (kv in [-4, 4], gates of spread ~3), `rows` rows at random owners and ring rows, one
    slot in five empty (-1)."""
    gen = torch.Generator().manual_seed(rows)
    kv = torch.randn(3, v.ring, v.width, generator=gen).clamp(-4, 4).to(dtypes.torch_dtype(v.dtype))
    gate = (3 * torch.randn(3, v.ring, v.width, generator=gen)).to(dtypes.torch_dtype(v.gate_dtype))
    bias = torch.randn(v.rate, v.width, generator=gen)
    owner = torch.randint(0, 3, (rows,), generator=gen)
    ring_rows = torch.randint(0, v.ring, (rows, v.slots), generator=gen)
    ring_rows[torch.rand(rows, v.slots, generator=gen) < 0.2] = -1
    ring_rows[:, -1] = ring_rows[:, -1].clamp(min=0)  # no row with every slot empty (no caller builds one)
    return tuple(t.to(device) for t in (kv, gate, bias, owner, ring_rows))


OP = OpDecl(
    "compress_ring", "the compressors' decode pooling read from their buffer rings", reference,
    kernels=(KERNEL,),
    tolerance=compress_pool.OP.tolerance,  # the same sums as compress_pool (the bias add is exact in fp32 in both)
    run=run, example=example,
)
