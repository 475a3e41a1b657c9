"""The engine's CPU decode steps and kernels.cpu_gemv: the products of a step of a few tokens (projections, KDA's gate
up-projections, the router, a token's experts in one call, lm_head) reach the kernel, whose weights stay output-major;
with cpu_gemv=False (EngineConfig, --no-cpu-gemv) or compile_decode the weights are stored input-major for MKL and
the kernel is not called.
Both ways give the same greedy tokens."""

import pytest
import torch

from deltaserve import SamplingParams
from deltaserve.kernels import cpu_gemv
from deltaserve.layers.linear import Linear
from deltaserve.layers.moe import MoE

pytestmark = pytest.mark.skipif(not cpu_gemv.available(), reason="no C compiler or no AVX2/AVX-512 here")

PROMPTS = [[5, 6, 7], list(range(20, 61))]


def greedy(llm, prompts, n=8):
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def record_calls(monkeypatch) -> list[tuple[int, int, tuple[int, int]]]:
    """(rows, weights in the call, a weight's shape) of every cpu_gemv call from here on."""
    calls = []
    launch = cpu_gemv._launch

    def recording(x, x_stride, weights, threads):
        calls.append((x.shape[-2], len(weights), tuple(weights[0].shape)))
        return launch(x, x_stride, weights, threads)

    monkeypatch.setattr(cpu_gemv, "_launch", recording)
    return calls


def projections(model) -> dict[str, torch.Tensor]:
    """The weights a decode step multiplies by: every Linear's but kv_b_proj's (MLA decode views it per head)."""
    return {name: m.weight for name, m in model.named_modules()
            if isinstance(m, Linear) and not name.endswith("kv_b_proj")}


def served_shape(name: str, weight: torch.Tensor) -> tuple[int, int]:
    """The weight shape a cpu_gemv call sees for a projection: KDA's fg_b_proj runs as its two halves (f and g)."""
    rows, cols = weight.shape
    return (rows // 2, cols) if name.endswith("fg_b_proj") else (rows, cols)


def test_decode_steps_run_every_product_through_the_kernel(make_llm, monkeypatch):
    monkeypatch.setattr(cpu_gemv, "MIN_WEIGHT", 0)  # the tiny model's products are below the size it takes
    llm = make_llm(max_num_seqs=4)
    model, cfg = llm.engine.runner.model, llm.engine.runner.cfg
    weights = projections(model)
    assert all(w.is_contiguous() for w in weights.values())  # output-major: the layout the kernel reads
    calls = record_calls(monkeypatch)
    greedy(llm, PROMPTS)
    greedy(llm, PROMPTS[:1])  # a step of one decode
    served = {shape for _, _, shape in calls}
    missing = {name for name, w in weights.items() if served_shape(name, w) not in served}
    assert not missing, f"decode products not through cpu_gemv: {sorted(missing)}"
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    assert (1, cfg.num_experts_per_token, tuple(moe.w13.shape[1:])) in calls  # a token's experts in one call
    assert (1, cfg.num_experts_per_token, tuple(moe.w2.shape[1:])) in calls
    assert (1, 1, tuple(moe.gate_weight.shape)) in calls  # the router
    rows = {rows for rows, _, _ in calls}
    assert 2 in rows and max(rows) <= cpu_gemv.MAX_ROWS  # both requests' decodes in a step; MKL past 4 rows


@pytest.mark.parametrize("off", ["option", "compile_decode"])
def test_without_the_kernel_weights_are_input_major_and_tokens_the_same(make_llm, monkeypatch, off):
    monkeypatch.setattr(cpu_gemv, "MIN_WEIGHT", 0)
    expected = greedy(make_llm(max_num_seqs=4), PROMPTS)
    if off == "option":
        llm = make_llm(max_num_seqs=4, cpu_gemv=False)
    else:
        llm = make_llm(max_num_seqs=4, compile_decode=True)
    weights = projections(llm.engine.runner.model)
    assert not any(w.is_contiguous() for w in weights.values())  # stored transposed, for MKL
    if off == "option":  # (compiled decode's logits are close to eager's, not equal: test_compile_decode.py)
        calls = record_calls(monkeypatch)
        assert greedy(llm, PROMPTS) == expected
        assert not calls


@pytest.mark.parametrize("ranks_with_it", [1, 2])
def test_tensor_parallel_ranks_use_the_kernel_all_or_none(monkeypatch, ranks_with_it):
    """A rank whose peer could not build the kernel turns it off too (the sum of the ranks' flags, as gloo's
    all-reduce gives it, stood in here)."""
    from deltaserve.config import EngineConfig
    from deltaserve.distributed import ParallelConfig
    from deltaserve.runner import model_runner


    monkeypatch.setattr(model_runner, "all_reduce", lambda flag, parallel: flag.fill_(ranks_with_it))
    options = model_runner.kernel_options(EngineConfig(), ParallelConfig(rank=0, world_size=2))
    assert options.cpu_gemv == (ranks_with_it == 2)
