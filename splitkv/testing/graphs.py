"""Capturing one call into a CUDA graph, the way tests and benchmarks do it."""

from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = ["capture_graph"]


def capture_graph(fn: Callable[[], object], stream: Optional[torch.cuda.Stream] = None) -> torch.cuda.CUDAGraph:
    """Warm ``fn`` up on ``stream`` (a new side stream by default), then capture one call of it there.

    The warm-up compiles the kernels, plans, and creates that stream's tile
    counters eagerly, as serving engines' graph runners do; capturing on the
    same stream then records only the launches.
    """
    stream = stream or torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    torch.cuda.synchronize()
    return graph
