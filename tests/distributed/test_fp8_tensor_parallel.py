"""FP8 weights over 2 gloo processes on the CPU: tensor and expert parallel give the single process's FP8 tokens
(each rank assembles the whole FP8 weight, then keeps its part with the scales of its blocks)."""

from __future__ import annotations

from helpers.checkpoints import write_fp8_checkpoint

from deltaserve.config import QuantConfig
from deltaserve.entrypoints.llm import LLM
from deltaserve.kernels.quant import FP8
from deltaserve.sampling_params import SamplingParams


def _tokens(model_dir, **options) -> list[list[int]]:
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j + 1) % 512 for j in range(n)]} for i, n in enumerate([1, 9, 30])]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm = LLM(model_dir, threads=1, max_model_len=64, max_num_batched_tokens=32, **options)
    try:
        if options.get("tensor_parallel_size", 1) == 1:
            assert llm.engine.runner.model.layers[1].mlp.w13.dtype == FP8
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    finally:
        llm.shutdown()


def test_fp8_tensor_and_expert_parallel_match_one_process(tiny_model, tmp_path):
    """An FP8 checkpoint of the tiny model in 4 x 4 blocks, which every shard of 2 ranks splits on boundaries (at
    128 x 128 the tiny model's shards cut blocks, which tests/loader/test_fp8_loading.py shows is refused)."""
    fp8 = write_fp8_checkpoint(tiny_model, tmp_path / "fp8", QuantConfig(block_size=(4, 4)))
    single = _tokens(fp8)
    assert _tokens(fp8, tensor_parallel_size=2) == single
    assert _tokens(fp8, tensor_parallel_size=2, enable_expert_parallel=True) == single
