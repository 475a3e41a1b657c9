"""The grouped FP8 expert kernels compiled on a GPU: bfloat16 against the naive twin, and a CUDA graph captured
once and replayed with other routings equals eager. Skipped without CUDA."""

import pytest
import torch
from helpers.kernels import fp8_expert_case, quantized, rel_err

from deltaserve.kernels.quant.triton_grouped import fp8_grouped_experts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEV = "cuda"
E, K, D, I, BLOCK = 32, 8, 512, 256, (128, 128)


def routing(T, experts, gen):
    ids = torch.stack([experts[torch.randperm(len(experts), generator=gen)[:K]] for _ in range(T)])
    return torch.rand(T, K, generator=gen), ids


@pytest.mark.parametrize("T", [1, 64, 300])
def test_gpu_fp8_grouped_experts_match_naive(T):
    x, w13, s13, w2, s2, weights, ids, expected = fp8_expert_case(T, E, K, D, I, BLOCK, seeds=(T, T, E))
    out = fp8_grouped_experts(x.to(DEV).bfloat16(), w13.to(DEV), s13.to(DEV), w2.to(DEV), s2.to(DEV),
                              weights.to(DEV), ids.to(DEV), BLOCK)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, expected) < 2e-2


@pytest.mark.parametrize("T", [1024, 1100])  # 8192 and 8800 (token, expert) pairs: the dequantizing path
def test_gpu_fp8_prefill_sized_experts_dequantize_and_match_naive(T, monkeypatch):
    from deltaserve.kernels.quant import experts as fp8_experts

    assert T * K >= fp8_experts._MIN_PAIRS_TO_DEQUANTIZE
    x, w13, s13, w2, s2, weights, ids, expected = fp8_expert_case(T, E, K, D, I, BLOCK, seeds=(T, 1, 2))
    args = (x.to(DEV).bfloat16(), w13.to(DEV), s13.to(DEV), w2.to(DEV), s2.to(DEV), weights.to(DEV), ids.to(DEV),
            BLOCK)
    in_graphs = fp8_experts.fp8_fused_experts(*args, in_graph=True)  # the grouped FP8 kernel whatever the size
    monkeypatch.setattr("deltaserve.kernels.quant.triton_grouped.fp8_grouped_experts",
                        lambda *a: pytest.fail("a prefill-sized bf16 step ran the grouped FP8 kernel"))
    out = fp8_experts.fp8_fused_experts(*args)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, expected) < 2e-2 and rel_err(in_graphs, expected) < 2e-2


def test_gpu_fp8_grouped_experts_capture_in_a_cuda_graph_and_replay_with_new_routing():
    """Captured with uniform routing, replayed with all pairs on the first 8 experts (more blocks of some experts,
    none of the others), then uniform again: each replay equals eager on the same inputs."""
    T, gen = 64, torch.Generator().manual_seed(0)
    w13, s13 = (t.to(DEV) for t in quantized((E, 2 * I, D), BLOCK, 1))
    w2, s2 = (t.to(DEV) for t in quantized((E, D, I), BLOCK, 2))
    x = (torch.randn(T, D, generator=gen) * 0.1).to(DEV).bfloat16()
    weights, ids = (t.to(DEV) for t in routing(T, torch.arange(E), gen))

    def run():
        return fp8_grouped_experts(x, w13, s13, w2, s2, weights, ids, BLOCK)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for experts in (torch.arange(8), torch.arange(E)):
        new_weights, new_ids = routing(T, experts, gen)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        x.copy_(torch.randn(T, D, generator=gen) * 0.1)
        graph.replay()
        assert torch.equal(out, run())
