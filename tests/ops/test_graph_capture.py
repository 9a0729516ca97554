"""`graph_capture`: a CUDA graph capture that Python's garbage collector cannot break (openk3/ops/__init__.py)."""

from __future__ import annotations

import gc
import weakref
from contextlib import contextmanager

import pytest
import torch

from openk3.ops import graph_capture


class Sentinel:
    """Something to hold in a reference cycle, weakly referenced to see when the collector frees the cycle."""


def cycle_holding(*objects) -> weakref.ref:
    """Drop `objects` into a reference cycle that only the cyclic collector frees. -> a weak reference into it."""
    sentinel = Sentinel()
    cycle = {"objects": objects, "sentinel": sentinel}
    cycle["self"] = cycle
    return weakref.ref(sentinel)


@contextmanager
def collector_eager():
    """The collector set to run at nearly every container allocation, for the block."""
    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


def test_graph_capture_pauses_the_collector_and_restores_it(monkeypatch):
    """With torch.cuda.graph replaced by a stand-in (no CUDA here): inside the capture the collector is off (nested
    captures too), a reference cycle made there survives any number of allocations and is freed by the first
    collection after it; after the capture, an exception out of it, or a capture entered with the collector already
    off, the collector is as it was before."""
    entered = []

    @contextmanager
    def stand_in(graph, pool=None):
        entered.append((graph, pool, gc.isenabled()))
        yield

    monkeypatch.setattr(torch.cuda, "graph", stand_in)
    assert gc.isenabled()
    with collector_eager():
        with graph_capture("outer", pool="p"):
            with graph_capture("inner"):
                ref = cycle_holding(torch.zeros(2))
                keep = [[i] for i in range(2000)]  # kept: each one a new container for the collector to count
            assert not gc.isenabled() and ref() is not None and len(keep) == 2000
        assert gc.isenabled()
    gc.collect()
    assert ref() is None
    assert entered == [("outer", "p", False), ("inner", None, False)]
    with pytest.raises(RuntimeError, match="in the capture"):
        with graph_capture("failing"):
            raise RuntimeError("in the capture")
    assert gc.isenabled()
    gc.disable()
    try:
        with graph_capture("already off"):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def captured_graph() -> torch.cuda.CUDAGraph:
    x = torch.randn(8, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        x.mul_(2)
    return graph


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_capture_survives_a_collection_that_would_free_another_graph():
    """A captured graph becomes garbage in a reference cycle inside another capture while the capture allocates
    thousands of containers with the collector set to run at nearly every one: the cycle (whose graph's destruction
    inside a capture invalidated it on the H200, torch 2.11) waits until the capture is over, the capture replays to
    the eager result, and the first collection after it frees the cycle."""
    y = torch.randn(64, device="cuda")
    expected = y.clone()
    holder = [captured_graph()]
    graph = torch.cuda.CUDAGraph()
    with collector_eager():
        with graph_capture(graph):
            ref = cycle_holding(holder.pop())
            keep = []
            for i in range(2000):
                keep.append([i])
                if i % 10 == 0:
                    y.add_(1.0)
            assert ref() is not None
        assert gc.isenabled()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, expected + 200.0)
    gc.collect()
    assert ref() is None
