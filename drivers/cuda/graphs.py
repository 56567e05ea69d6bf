"""Step graphs on CUDA: ``torch.cuda.CUDAGraph``, captured on a side stream after a warm-up.

All graphs share one memory pool (``torch.cuda.graph_pool_handle()``): the engine replays one
at a time, so their intermediates may overlap. Never run on a GPU where this was written; the
tests behind ``pytest --run-cuda`` (tests/test_cuda_hardware.py) check it on one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hal.graphs import StepGraph, StepGraphs


class CudaStepGraph(StepGraph):
    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        self.graph = graph

    def _replay(self) -> None:
        self.graph.replay()


class CudaStepGraphs(StepGraphs):
    name = "cuda_graph"

    def __init__(self, index: int) -> None:
        self.index = index
        self._pool: Any = None
        self._stream: torch.cuda.Stream | None = None

    def capture(self, fn: Callable[[], Any]) -> tuple[StepGraph, Any]:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.index)
            self._pool = torch.cuda.graph_pool_handle()
        stream = self._stream
        # Warm up on the capture stream (lazy initialisation, cuBLAS workspaces, the
        # allocator's first blocks), as torch.cuda.graph's documentation asks.
        stream.wait_stream(torch.cuda.current_stream(self.index))
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream(self.index).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=stream):
            outputs = fn()
        return CudaStepGraph(graph), outputs
