"""NVIDIA (sm90, sm100) override of `act_quant`: a tile of `Config.rows` rows x one group per CTA, staged in shared
memory by 16-byte vector loads (rows past M read as zeros and are not stored), the groups' max magnitudes in one
row reduction of a register tile, and the codes staged in shared memory for one bulk (TMA) store. The portable
body runs one program per (row, group) with a block-wide reduction each: at prefill sizes (4,096 rows of 8,192
columns: 262,144 programs) it ran ~7x under the copy bandwidth (`benchmarks/kernels.py`, BENCHMARKS.md). Same
arithmetic as the portable body (`fp8.encode`, `fp8.pow2_ceil`): the bytes and scales are equal, which the op's
exact tolerance checks. It takes prefill rows only (`Variant.wide`: at 1-128 rows the portable body was as fast
or faster but at 128 rows of 8,192) and groups that tile K exactly (V4's and V4.1's projections do); a ragged last
group keeps the portable body."""


def fits(v) -> bool:
    """Wide (prefill) variants whose groups tile K exactly."""
    return v.wide and v.k % v.group == 0


def body(P, v, cfg):
    from tilekernels import fp8
    from tilekernels.ops.act_quant import AMAX_FLOOR, FP8_MAX

    T = P.T
    K, G, dtype, R = v.k, v.group, v.dtype, cfg.rows
    KB = K // G
    M = T.dynamic("M")

    @T.prim_func
    def kernel(X: T.Tensor((M, K), dtype), Q: T.Tensor((M, K), "uint8"), S: T.Tensor((M, KB), "float32")):
        with T.Kernel(KB, T.ceildiv(M, R), threads=cfg.threads) as (bx, by):
            x_s = T.alloc_shared((R, G), dtype)
            q_s = T.alloc_shared((R, G), "uint8")
            x_f = T.alloc_fragment((R, G), "float32")
            top = T.alloc_fragment((R,), "float32")
            s_f = T.alloc_fragment((R,), "float32")
            T.copy(X[by * R, bx * G], x_s)
            T.copy(x_s, x_f)
            T.reduce_absmax(x_f, top, dim=1)
            for i in T.Parallel(R):
                s = T.max(top[i], AMAX_FLOOR) / FP8_MAX
                s_f[i] = fp8.pow2_ceil(T, s) if v.pow2 else s
            for i, j in T.Parallel(R, G):
                q_s[i, j] = fp8.encode(T, x_f[i, j] / s_f[i])
            T.copy(q_s, Q[by * R, bx * G])
            for i in T.Parallel(R):
                if by * R + i < M:
                    S[by * R + i, bx] = s_f[i]

    return kernel
