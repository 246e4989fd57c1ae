"""Weight bytes prefetched into L2 before a kernel's dependency wait (CUDA sm_90a / sm_100a).

With programmatic dependent launch (`backends.tl.dependent_launch`) a kernel's CTAs start while the kernel before
it still runs and wait at `griddepcontrol.wait` before touching memory. A decode GEMM's weights are written by no
kernel of the step (they are loaded once, before any graph is captured), so its CTAs can ask for their first
weight tiles meanwhile: `cp.async.bulk.prefetch.L2` reads nothing into the kernel (no register, no shared memory,
no value it computes with): it only warms L2, which on one GPU is the point of coherence, so no later read can see
an older value than without it. `dependent_launch` keeps a kernel body's leading statements that do nothing but
call NAME (under conditions) ahead of the wait, and only them; every other access stays after it. In a body:

    T.import_source(l2_prefetch.SOURCE)
    if tx < rows and n0 + tx < N:
        T.call_extern("handle", l2_prefetch.NAME, T.address_of(W[n0 + tx, k0]), nbytes)
"""

from backends.tl import PREFETCH_L2 as NAME
from backends.tl import PREFETCH_L2_SOURCE as SOURCE

__all__ = ["NAME", "SOURCE", "row_bytes"]


def row_bytes(steps: int, block_k: int, k_slice: int, itemsize: int) -> int:
    """Bytes of one weight row a CTA prefetches: its first `steps` K steps of `block_k` columns, at most its K slice
    (a multiple of 16 bytes, as the bulk prefetch takes)."""
    return min(steps * block_k, k_slice) * itemsize // 16 * 16
