import pytest
import torch

from openk3.serve.static import StaticDecoder


def graph_tensors(x) -> list[torch.Tensor]:
    """The tensors in what a static run returned, in a fixed order: tensors, tuples, lists, dicts and state objects
    (KDAState, SlotKDAState; not the pools a SlotKDAState points into, which live outside the graphs)."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in graph_tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in graph_tensors(v)]
    if hasattr(x, "__dict__"):
        return [t for k, v in vars(x).items() if not k.endswith("_pool") for t in graph_tensors(v)]
    return []


class PooledGraph:
    """A `StaticDecoder` graph on any device (`pooled_graphs`): a replay runs the step again eagerly and writes its
    results into the outputs kept at capture, then poisons the outputs of the graphs the decoder captured after
    this one."""

    def __init__(self, decoder: StaticDecoder, run, buf, greedy_only: bool, out):
        self.decoder, self.run, self.buf, self.greedy_only, self.out = decoder, run, buf, greedy_only, out

    def replay(self) -> None:
        for dst, src in zip(graph_tensors(self.out), graph_tensors(self.run(self.buf, self.greedy_only)), strict=True):
            dst.copy_(src)
        order = self.decoder.pooled
        for later in order[order.index(self) + 1:]:
            for t in graph_tensors(later.out):
                t.fill_(float("nan") if t.is_floating_point() else -1)


@pytest.fixture
def pooled_graphs(monkeypatch):
    """CUDA graphs' memory contract, on the CPU: every `StaticDecoder` runs with graphs (a "capture" runs the step
    once and keeps what it returned; a replay runs it again into those outputs, `PooledGraph`), and a replay
    overwrites the outputs of the graphs captured after it, as it may on CUDA: a decoder's graphs share one memory
    pool (`StaticDecoder.mempool`), where a graph captured later may hold its outputs in memory that one captured
    before uses for its temporaries (PyTorch's CUDA semantics notes, "Graph memory management": graphs that share a
    pool must be replayed in the order they were captured). A graph's output read after another graph's replay
    then gives NaN or token -1 here (an index error), as on a GPU it gave other tokens or a device-side assert.
    Python's choices are made again at every replay here (a real graph froze them at capture)."""
    init = StaticDecoder.__init__

    def with_graphs(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.graphs, self.pooled = True, []

    def capture(self, run, buf, greedy_only):
        graph = PooledGraph(self, run, buf, greedy_only, run(buf, greedy_only))
        self.pooled.append(graph)
        self.counters["graph_captures"] += 1
        return graph, graph.out

    monkeypatch.setattr(StaticDecoder, "__init__", with_graphs)
    monkeypatch.setattr(StaticDecoder, "_capture", capture)
