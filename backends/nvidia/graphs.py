"""CUDA graph capture for the runtime's decode step."""

from __future__ import annotations

from typing import Any, Callable

import torch


class CudaGraphs:
    """`capture(fn)`: warm fn up, capture it into one graph of a pool shared by every capture."""

    def __init__(self):
        self.pool = None

    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, Callable[[], Any]]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up: loads kernels and settles allocations outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return out, graph.replay
