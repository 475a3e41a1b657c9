"""FP8 kernels compiled on a GPU against the CPU fallback and the naive twins; the engine in FP8 on a GPU.
Skipped without CUDA."""

import pytest
import torch
from helpers.kernels import fp8_expert_case, norm_gemv_inputs, quantized, rel_err, within_ulps

from deltaserve.kernels.gemv import FP8_GEMV_TILES, fp8_gemv
from deltaserve.kernels.norm_gemv import add_norm_gemv, gated_norm_gemv, naive_add_norm_linear, naive_gated_norm_linear
from deltaserve.kernels.quant import dequantize_fp8, fp8_fused_experts, fp8_linear
from deltaserve.kernels.quant.naive import naive_fp8_linear
from deltaserve.kernels.quant.triton_linear import fp8_dequantize_triton, fp8_matmul

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEV = "cuda"


@pytest.mark.parametrize("shape,block", [((33, 130), (128, 128)), ((2, 300, 450), (128, 128)), ((129, 257), (16, 24))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_dequantize_equals_the_cpu_fallback_bit_for_bit(shape, block, dtype):
    q, scale = quantized(shape, block, sum(shape))
    gpu = fp8_dequantize_triton(q.to(DEV), scale.to(DEV), block, dtype)
    assert torch.equal(gpu.cpu(), dequantize_fp8(q, scale, block, dtype))


@pytest.mark.parametrize("M", [1, 4, 16, 64, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_fp8_linear_matches_twin(M, dtype):
    block = (128, 128)
    q, scale = quantized((1000, 2304), block, M)
    x = torch.randn(M, 2304, generator=torch.Generator().manual_seed(M)).to(dtype)
    expected = naive_fp8_linear(x, q, scale, block)
    assert rel_err(fp8_linear(x.to(DEV), q.to(DEV), scale.to(DEV), block), expected) < (1e-5 if dtype == torch.float32
                                                                                           else 1e-2)
    if M <= 64:
        assert rel_err(fp8_matmul(x.to(DEV), q.to(DEV), scale.to(DEV), block), expected) < (
            1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("tile", FP8_GEMV_TILES)
@pytest.mark.parametrize("N,K,block", [(4096, 2304, (128, 128)), (130, 700, (32, 64))])
def test_gpu_fp8_gemv_matches_twin_at_every_tile(N, K, block, tile):
    """One bfloat16 token: each candidate tile run directly (the autotuner may pick any), the scales folded into x
    where a tile's rows share them, else applied per weight."""
    q, scale = quantized((N, K), block, N)
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(K)).to(torch.bfloat16)
    got = fp8_gemv(x.to(DEV), q.to(DEV), scale.to(DEV), block, tile)
    assert rel_err(got, naive_fp8_linear(x, q, scale, block)) < 1e-2


@pytest.mark.parametrize("T", [1, 4, 40])
def test_gpu_fp8_experts_match_naive(T):
    E, k, D, I, block = 32, 8, 512, 256, (128, 128)
    x, w13, s13, w2, s2, weights, ids, expected = fp8_expert_case(T, E, k, D, I, block, seeds=(T, T, E))
    out = fp8_fused_experts(x.to(DEV).bfloat16(), w13.to(DEV), s13.to(DEV), w2.to(DEV), s2.to(DEV), weights.to(DEV),
                            ids.to(DEV), block)
    assert rel_err(out, expected) < 2e-2


@pytest.mark.parametrize("T", [1, 4])
def test_gpu_fp8_decode_experts_with_the_shared_expert_match_naive(T):
    """The FP8 shared expert as a ninth slot (expert 0's weights and scales, which no token routes to)."""
    from deltaserve.kernels.moe.naive import naive_experts
    from deltaserve.kernels.moe.triton_decode import decode_experts
    from deltaserve.kernels.quant import dequantize_fp8

    E, k, D, I, block = 32, 8, 512, 256, (128, 128)
    x, w13, s13, w2, s2, weights, ids, expected = fp8_expert_case(T, E, k, D, I, block, seeds=(T, 7, 8),
                                                                  experts=list(range(1, E)))
    expected = expected + naive_experts(x, dequantize_fp8(w13, s13, block), dequantize_fp8(w2, s2, block),
                                        torch.ones(T, 1), torch.zeros(T, 1, dtype=torch.int64))
    on = [t.to(DEV) for t in (w13, s13, w2, s2)]
    out = decode_experts(x.to(DEV).bfloat16(), on[0], on[2], weights.to(DEV), ids.to(DEV), on[1], on[3], block,
                         shared=(on[0][0], on[2][0], on[1][0], on[3][0]))
    assert rel_err(out, expected) < 2e-2


def test_gpu_engine_runs_fp8_and_agrees_with_the_cpu_fallback(tiny_model):
    """float32 activations: the GPU's kernels and the CPU's dequantize-then-matmul compute the same model."""
    from deltaserve import LLM, SamplingParams

    prompts = [{"prompt_token_ids": [5 + i, 17, 33 + 2 * i, 9]} for i in range(4)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    gpu = LLM(str(tiny_model), device="cuda", dtype="float32", quantization="fp8", max_model_len=64)
    cpu = LLM(str(tiny_model), device="cpu", quantization="fp8", max_model_len=64, threads=1)
    assert [o.outputs[0].token_ids for o in gpu.generate(prompts, params, use_tqdm=False)] == [
        o.outputs[0].token_ids for o in cpu.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("tile", [None, (4, 1024), (64, 128)])  # autotuned; 64 rows span 16-row scale blocks
@pytest.mark.parametrize("D,N,block", [(2304, 12576, (128, 128)), (2304, 6720, (128, 128)),  # KDA, MLA in_proj
                                       (2304, 1000, (16, 24)), (64, 70, (128, 128)), (64, 512, (128, 128))])
def test_gpu_add_norm_fp8_gemv_matches_norm_then_dequantized_linear(D, N, block, tile):
    """One bf16 token of the 48B's width (2304), or of the tiny test model's (64, narrower than a scale block),
    through FP8 in_proj weights: the residual stream bit for bit, the normalised input within one unit in the last
    place, the product as the dequantizing twin's."""
    case = norm_gemv_inputs(1, D, N, torch.bfloat16, seed=N, device=DEV)
    q, scale = quantized((N, D), block, N)
    args = case["x"], case["residual"], case["norm_weight"], case["eps"]
    y, s, h = add_norm_gemv(*args, q.to(DEV), store_normed=True, tile=tile, scale_inv=scale.to(DEV), block=block)
    y_twin, s_twin, h_twin = naive_add_norm_linear(*args, q.to(DEV), scale_inv=scale.to(DEV), block=block)
    assert torch.equal(s, s_twin) and within_ulps(h, h_twin)
    assert y.dtype == torch.bfloat16 and rel_err(y, y_twin) < 5e-3


@pytest.mark.parametrize("tile", [None, (8, 256), (32, 512)])
@pytest.mark.parametrize("H,K,N,block", [(32, 128, 2304, (128, 128)), (7, 64, 1000, (16, 24)),  # the 48B's o_proj
                                         (4, 16, 64, (128, 128))])  # the tiny test model's
def test_gpu_gated_norm_fp8_gemv_matches_gated_norm_then_dequantized_linear(H, K, N, block, tile):
    case = norm_gemv_inputs(1, K, N, torch.bfloat16, seed=H * N, device=DEV, gated_heads=H)
    q, scale = quantized((N, H * K), block, H + N)
    args = case["o"], case["gate"], case["norm_weight"], case["eps"], q.to(DEV)
    y = gated_norm_gemv(*args, tile=tile, scale_inv=scale.to(DEV), block=block)
    assert rel_err(y, naive_gated_norm_linear(*args, scale_inv=scale.to(DEV), block=block)) < 5e-3
