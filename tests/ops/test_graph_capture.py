"""`graph_capture`: a CUDA graph capture that Python's garbage collector cannot break (openk3/ops/__init__.py)."""

from __future__ import annotations

import gc

import pytest
import torch

from openk3.ops import graph_capture


def captured_graph() -> torch.cuda.CUDAGraph:
    x = torch.randn(8, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        x.mul_(2)
    return graph


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_capture_survives_a_collection_that_would_free_another_graph():
    """A captured graph becomes garbage in a reference cycle inside another capture, with the collector set to run on
    nearly every allocation: the cycle waits until the capture is over (its destruction inside the capture is a CUDA
    call a global-mode capture may forbid), the capture replays to the eager result, and the collector is back on
    after it and frees the cycle."""
    thresholds = gc.get_threshold()
    y = torch.randn(64, device="cuda")
    expected = y.clone()
    holder = [captured_graph()]
    graph = torch.cuda.CUDAGraph()
    try:
        with graph_capture(graph):
            cycle = {"graph": holder.pop()}
            cycle["self"] = cycle
            del cycle
            gc.set_threshold(1, 1, 1)
            for i in range(200):
                junk = [[i]]  # container allocations: each one could start a collection
                y.add_(float(len(junk)))
            gc.set_threshold(*thresholds)
        assert gc.isenabled()
    finally:
        gc.set_threshold(*thresholds)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, expected + 200.0)
    assert gc.collect() > 0  # the cycle, left for after the capture
