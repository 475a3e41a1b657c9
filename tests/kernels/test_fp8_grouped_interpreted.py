"""The grouped FP8 expert kernels (kernels.quant.triton_grouped) against the naive twin on dequantized weights,
through Triton's interpreter, in float32 (the interpreter's bfloat16 tl.dot is not to be trusted). On a machine
with CUDA, tests/gpu/test_gpu_fp8_grouped.py runs them compiled, in bfloat16 and under a CUDA graph."""

import pytest
from helpers.kernels import fp8_expert_case, rel_err, require_triton_interpreter

require_triton_interpreter()

from deltaserve.kernels.quant.triton_grouped import fp8_grouped_experts  # noqa: E402


@pytest.mark.parametrize("T,E,k,D,I,block,hit", [
    (1, 8, 2, 96, 40, (16, 32), None),  # one token; D, I multiples of neither the tiles nor the blocks
    (3, 16, 4, 96, 40, (16, 32), None),  # most experts get no tokens
    (37, 4, 2, 200, 72, (16, 32), None),  # ~18 pairs an expert: two blocks each, the second partial
    (37, 4, 2, 130, 40, (16, 32), [0, 2]),  # 37 pairs on each of two experts (3 blocks), the first and last empty
    (5, 8, 2, 256, 256, (128, 128), None),  # aligned: one scale per tile in both kernels
    (9, 6, 3, 300, 192, (64, 128), None),  # aligned, with partial tiles at the edges of D and I
    (20, 6, 3, 300, 130, (128, 128), None),  # gate/up per-element scales (I % 64 != 0), down aligned
])
def test_fp8_grouped_experts_match_naive(T, E, k, D, I, block, hit):
    x, w13, s13, w2, s2, weights, ids, expected = fp8_expert_case(T, E, k, D, I, block, (T * E + D, T + I, E + D),
                                                                   experts=hit)
    assert rel_err(fp8_grouped_experts(x, w13, s13, w2, s2, weights, ids, block), expected) < 1e-5
