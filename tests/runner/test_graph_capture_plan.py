"""DecodeGraphs.capture's Python around the CUDA calls, on the CPU: torch.cuda's graph and synchronize replaced by
recorders, so the capture loop (the warm-ups, the sync on the inputs' device, one graph a size sharing one pool,
in_graph batches) runs where CI runs. The GPU tests capture for real."""

import contextlib

import torch

from deltaserve.runner import cuda_graph
from deltaserve.runner.cuda_graph import DecodeGraphs


class Model:
    def __init__(self):
        self.batches = []

    def __call__(self, ids, batch, caches):
        self.batches.append((ids.shape[0], batch.in_graph))
        return torch.zeros(ids.shape[0], 4)

    def compute_logits(self, hidden):
        return hidden + 1


class FakeGraph:
    def pool(self):
        return "pool"


def test_capture_warms_up_syncs_and_captures_every_size_largest_first(monkeypatch):
    synced, captured = [], []
    monkeypatch.setattr(cuda_graph.torch.cuda, "synchronize", lambda device=None: synced.append(device))
    monkeypatch.setattr(cuda_graph.torch.cuda, "CUDAGraph", FakeGraph)

    @contextlib.contextmanager
    def graph(g, pool=None):
        captured.append(pool)
        yield

    monkeypatch.setattr(cuda_graph.torch.cuda, "graph", graph)
    model = Model()
    graphs = DecodeGraphs(model, None, 3, 4, 16, 2, 3, torch.device("cpu"))
    graphs.capture()
    sizes = list(reversed(graphs.sizes))
    assert set(graphs.graphs) == set(graphs.sizes) and sorted(graphs.logits) == sorted(graphs.sizes)
    assert synced == [torch.device("cpu")] * len(sizes)  # after each size's warm-ups, on the inputs' device
    assert captured == [None] + ["pool"] * (len(sizes) - 1)  # the first graph's pool serves the rest
    assert model.batches == [(n, True) for n in sizes for _ in range(3)]  # two warm-ups and the capture, in graph
