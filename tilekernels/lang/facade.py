"""The portable facade `P`: one kernel body, every target (kernels.md section 3).

A kernel body uses plain TileLang through `T = P.T` (the target's dialect) and asks `P` for the constructs
whose spelling differs between targets: the launch, vector regions, where buffers live, and how an
accumulator reaches vector code or global memory. `P` reads the target's `Traits`; it never looks at the
target's name. Rules a portable body follows:

- every `T.Parallel` / `T.reduce_*` sits inside `with P.vector(threads):`;
- state that lives across vector regions is `P.alloc_vec`; temporaries inside one region are `P.alloc_reg`;
- no casting `T.copy` except an accumulator going to global memory (`P.store_acc`); cast in vector code;
- GEMMs go through `P.gemm(a, b, acc, clear_accum)` with B operands (N, K);
- a vector tile of an M-row accumulator has `P.vec_rows(M)` rows (Ascend splits it over its AIV pair);
- ops are emitted from helpers only through `T.macro` (kernels.md trap 1).
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

from backends.base import Traits


class Facade:
    def __init__(self, traits: Traits):
        self.traits = traits
        self.T = importlib.import_module(traits.dialect)
        self._macros = _macros(self.T, traits)
        self._barriers: dict[int, Any] = {}  # TMEM accumulator (by identity, kernels.md trap 6) -> mbarrier

    # ---- launch ---------------------------------------------------------------------------------
    def kernel(self, tiles: Any, threads: int):
        """The launch frame over `tiles` work tiles; `as pid` gives the program id that `tiles()` consumes."""
        if self.traits.launch == "persistent":
            return self.T.Kernel(self.traits.cores)
        return self.T.Kernel(tiles, threads=threads)

    def tiles(self, tiles: Any, pid: Any):
        """Loop over the tiles this program owns: exactly one on a grid launch, a strided set when persistent."""
        if self.traits.launch == "persistent":
            return self.T.Persistent([tiles], self.traits.cores, pid)
        return self.T.serial(pid, pid + 1)

    def vector(self, threads: int):
        """The region vector code (T.Parallel, reductions) runs in."""
        if self.traits.vector_region:
            return self.T.SimtVF(threads=threads)
        return contextlib.nullcontext()

    # ---- buffers --------------------------------------------------------------------------------
    def alloc_io(self, shape, dtype):
        """A staging tile between global memory and vector code."""
        return self.T.alloc_shared(shape, dtype, scope=self.traits.io_scope)

    def alloc_vec(self, shape, dtype):
        """State that lives across vector regions."""
        kind = self.traits.vec
        if kind == "fragment":
            return self.T.alloc_fragment(shape, dtype)
        if kind == "shared":
            return self.T.alloc_shared(shape, dtype, scope=self.traits.io_scope)
        return self.T.alloc_local(shape, dtype)

    def alloc_reg(self, shape, dtype):
        """A temporary inside one vector region."""
        if self.traits.reg == "fragment":
            return self.T.alloc_fragment(shape, dtype)
        return self.T.alloc_local(shape, dtype)

    def alloc_operand(self, shape, dtype):
        """A GEMM operand tile (B operands are (N, K))."""
        if self.traits.operand_scope == "shared.l1":
            return self.T.alloc_l1(shape, dtype)
        return self.T.alloc_shared(shape, dtype, scope=self.traits.operand_scope)

    def alloc_acc(self, shape, dtype, operands: str | None = None):
        """A GEMM accumulator; `operands`: the MMA inputs' dtype (TileLang's tcgen05 path takes 16- and 8-bit
        inputs: fp32 ones accumulate in registers)."""
        kind = self.traits.acc
        if kind == "l0c":
            return self.T.alloc_l0c(shape, dtype)
        if kind == "tmem" and shape[0] in (64, 128) and operands != "float32":
            acc = self.T.alloc_tmem(shape, dtype)
            self._barriers[id(acc)] = self.T.alloc_barrier(1)
            return acc
        if kind == "local":
            return self.T.alloc_local(shape, dtype)
        return self.T.alloc_fragment(shape, dtype)

    def gemm(self, a, b, acc, clear_accum, full_rows: bool = False):
        """acc (+)= a @ b^T; b is (N, K). A TMEM accumulator gets its mbarrier (tcgen05 on sm_100a). `full_rows`:
        the warps split the tile by rows only, each MMA as wide as the tile (on sm90 a warpgroup's wgmma then
        reads less shared memory per flop than the default square split)."""
        barrier = self._barriers.get(id(acc))
        policy = self.T.GemmWarpPolicy.FullRow if full_rows else self.T.GemmWarpPolicy.Square
        if barrier is not None:
            return self.T.gemm(a, b, acc, transpose_B=True, clear_accum=clear_accum, mbar=barrier, policy=policy)
        return self.T.gemm(a, b, acc, transpose_B=True, clear_accum=clear_accum, policy=policy)

    @staticmethod
    def padded(width: int, threads: int) -> int:
        """`width` rounded up to a multiple of `threads`: the width of the register tiles a vector region
        reduces over. Layout inference (sm90/sm100) finds no layout for a reduced or fragment width that the
        threads do not divide, so such bodies run over the padded width with the tail masked (loads fill the
        reduction's identity, stores are predicated). Equal to `width` when the threads divide it: the edge
        handling is then not emitted at all."""
        return -(-width // threads) * threads

    def vec_rows(self, rows: int) -> int:
        """Rows of the vector tile one vector unit gets from an accumulator of `rows` rows."""
        return rows // 2 if self.traits.vector_halves else rows

    # ---- data movement that differs per target (T.macro: emitted through the builder) ----------
    def store_acc(self, acc, dst):
        """Accumulator -> global memory, casting to dst's dtype."""
        return self._macros["store_acc"](acc, dst)

    def split_copy(self, src, dst):
        """A copy between a full tile and its `vec_rows` share: accumulator -> vector tile, vector tile ->
        operand or global memory, global -> vector tile. With vector halves (Ascend) each of the two vector
        units moves its half (`T.dual_copy`); elsewhere it is a plain copy of the whole tile."""
        return self._macros["split_copy"](src, dst)


def _macros(T: Any, traits: Traits) -> dict[str, Any]:
    halves = traits.vector_halves
    via_register = traits.acc == "tmem"

    @T.macro
    def store_acc(acc, dst):
        if via_register:
            tmp = T.alloc_fragment(acc.shape, acc.dtype)
            T.copy(acc, tmp)
            T.copy(tmp, dst)
        else:
            T.copy(acc, dst)

    @T.macro
    def split_copy(src, dst):
        if halves:
            T.dual_copy(src, dst)
        else:
            T.copy(src, dst)

    return {"store_acc": store_acc, "split_copy": split_copy}
