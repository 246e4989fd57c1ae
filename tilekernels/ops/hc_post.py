"""mHC post-block: expand the block output into N streams and add the comb-mixed residual streams."""

from dataclasses import dataclass

import torch

from tilekernels import dtypes
from tilekernels.op import Kernel, OpDecl, require


def reference(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """streams [T, N, H], out [T, H], post [T, N], comb [T, N, N] -> post x out + comb^T @ streams, [T, N, H]."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


@dataclass(frozen=True)
class Variant:
    hc: int
    hidden: int
    dtype: str


@dataclass(frozen=True)
class Config:
    chunk: int = 512
    threads: int = 128


def body(P, v: Variant, cfg: Config):
    T = P.T
    N, H, dtype = v.hc, v.hidden, v.dtype
    BH = min(cfg.chunk, H)
    NB = -(-H // BH)  # the last chunk is partial when BH does not divide H
    EP = P.padded(N * BH, cfg.threads)  # the elements of one tile, padded to the threads
    M = T.dynamic("M")

    def mixed(post, comb, o, s, n, j):
        total = post[n] * T.cast(o[j], "float32")
        for m in range(N):
            total = total + comb[m * N + n] * T.cast(s[m * BH + j], "float32")
        return total

    def mixed_global(post, comb, S, O, row, n, h):
        total = post[n] * T.cast(O[row, h], "float32")
        for m in range(N):
            total = total + comb[m * N + n] * T.cast(S[row, m * H + h], "float32")
        return total

    @T.prim_func
    def kernel(S: T.Tensor((M, N * H), dtype), O: T.Tensor((M, H), dtype), Post: T.Tensor((M, N), "float32"),
               Comb: T.Tensor((M, N * N), "float32"), Y: T.Tensor((M, N * H), dtype)):
        with P.kernel(M * NB, cfg.threads) as pid:
            s_io = P.alloc_io((N * BH,), dtype)
            y_io = P.alloc_io((N * BH,), dtype)
            o_io = P.alloc_io((BH,), dtype)
            post_io = P.alloc_io((N,), "float32")
            comb_io = P.alloc_io((N * N,), "float32")
            for t in P.tiles(M * NB, pid):
                row = t // NB
                h0 = (t % NB) * BH
                T.copy(Post[row, 0:N], post_io)
                T.copy(Comb[row, 0 : N * N], comb_io)
                if H % BH == 0:
                    for n in T.serial(N):
                        T.copy(S[row, n * H + h0 : n * H + h0 + BH], s_io[n * BH : (n + 1) * BH])
                    T.copy(O[row, h0 : h0 + BH], o_io)
                    with P.vector(cfg.threads):
                        if EP == N * BH:
                            for n, j in T.Parallel(N, BH):
                                y_io[n * BH + j] = T.cast(mixed(post_io, comb_io, o_io, s_io, n, j), dtype)
                        else:  # padded to the threads: computed at a clamped index, stored predicated
                            for e in T.Parallel(EP):
                                y = mixed(post_io, comb_io, o_io, s_io, T.min(e, N * BH - 1) // BH,
                                          T.min(e, N * BH - 1) % BH)
                                if e < N * BH:
                                    y_io[e] = T.cast(y, dtype)
                    for n in T.serial(N):
                        T.copy(y_io[n * BH : (n + 1) * BH], Y[row, n * H + h0 : n * H + h0 + BH])
                else:  # ragged tail: straight from/to global memory, predicated on the real width
                    with P.vector(cfg.threads):
                        for n, j in T.Parallel(N, BH):
                            if h0 + j < H:
                                Y[row, n * H + h0 + j] = T.cast(mixed_global(post_io, comb_io, S, O, row, n, h0 + j), dtype)

    return kernel


KERNEL = Kernel("hc_post", body, configs={"default": Config(), "c": Config(chunk=64, threads=1)})


def variant(streams: torch.Tensor) -> Variant:
    """The kernel variant `run` launches for these inputs (no tensor values are read: meta tensors work)."""
    _, n, h = streams.shape
    return Variant(hc=n, hidden=h, dtype=dtypes.name(streams.dtype))


def run(launch, streams, out, post, comb):
    m, n, h = streams.shape
    v = variant(streams)
    require(out.shape == (m, h) and post.shape == (m, n) and comb.shape == (m, n, n), "hc_post",
            f"out/post/comb must be [{m}, {h}]/[{m}, {n}]/[{m}, {n}, {n}]")
    y = torch.empty(m, n * h, dtype=streams.dtype, device=streams.device)
    launch("hc_post", v)(streams.reshape(m, n * h).contiguous(), out.contiguous(), post.float().contiguous(),
                         comb.reshape(m, n * n).float().contiguous(), y)
    return y.view(m, n, h)


def example(v: Variant, rows: int, device) -> tuple:
    dtype = dtypes.torch_dtype(v.dtype)
    comb = torch.softmax(torch.randn(rows, v.hc, v.hc, device=device), -1)
    return (torch.randn(rows, v.hc, v.hidden, device=device).to(dtype), torch.randn(rows, v.hidden, device=device).to(dtype),
            2 * torch.rand(rows, v.hc, device=device), comb)


OP = OpDecl(
    "hc_post", "mHC stream expansion and residual mix", reference,
    kernels=(KERNEL,),
    tolerance={"float32": (1e-5, 1e-5), "bfloat16": (3e-2, 2e-2)},
    run=run, example=example,
)
