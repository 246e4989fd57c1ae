"""NPU graph capture through torch_npu (imported only here). Never run: no NPU in this project's machines."""

from __future__ import annotations

from typing import Any, Callable


class NpuGraphs:
    def __init__(self):
        import torch_npu  # noqa: F401  (raises ImportError off an Ascend host)

        self.pool = None

    def __call__(self, fn: Callable[[], Any]) -> tuple[Any, Callable[[], Any]]:
        import torch

        fn()
        torch.npu.synchronize()
        graph = torch.npu.NPUGraph()
        with torch.npu.graph(graph):
            out = fn()
        return out, graph.replay
