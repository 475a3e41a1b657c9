"""The decoder layers' paths through kernels.norm_gemv (norms inside the GEMVs that read them), on the CPU: the
kernels' twins stand in for them (layers.linear.norm_gemv_kernels is the one place the layers ask for them), so the
layers' plumbing of the residual stream, the normalised input the experts read and the projected inputs runs in
CI. In float32 the twins are the very ops of the path without them: the same greedy tokens, bit for bit. The kernels
themselves are tested against the same twins in tests/kernels (interpreter) and tests/gpu."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from deltaserve import SamplingParams
from deltaserve.kernel_options import KernelOptions
from deltaserve.kernels.norm import add_rms_norm, gated_rms_norm
from deltaserve.kernels.quant import dequantize_fp8
from deltaserve.layers import linear


class TwinKernels:
    """kernels.norm_gemv's interface, computed by the twins, counting its calls by kind."""

    NORM_GEMV_MAX_TOKENS, ROUTER_NORM_MAX_TOKENS, MAX_HEAD = 1, 16, 128

    def __init__(self):
        self.calls = Counter()

    def fits(self, x, norm_weight, weight, max_tokens, other) -> bool:
        return x.shape[0] <= max_tokens

    def add_norm_gemv(self, x, residual, norm_weight, eps, weight, store_normed=False, scale_inv=None, block=None,
                      pdl=True):
        self.calls["router" if store_normed else "in_proj"] += 1
        h, s = add_rms_norm.eager(x, residual, norm_weight, eps)
        return self.linear(h, weight, scale_inv, block), s, h if store_normed else None

    def gated_norm_gemv(self, o, gate, norm_weight, eps, weight, scale_inv=None, block=None, pdl=True):
        self.calls["o_proj"] += 1
        h = gated_rms_norm.eager(o, gate.view(o.shape), norm_weight, eps).view(o.shape[0], -1)
        return self.linear(h, weight, scale_inv, block)

    def linear(self, h, weight, scale_inv, block):
        """F.linear, or for FP8 weights the CPU fallback's dequantize-then-F.linear (kernels.quant.fp8_linear)."""
        if scale_inv is not None:
            self.calls["fp8"] += 1
            weight = dequantize_fp8(weight, scale_inv, block, h.dtype)
        return F.linear(h.to(weight.dtype), weight)


def greedy(llm, prompts, n=12):
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_layers_through_the_norm_gemv_interface_give_the_same_tokens(make_llm, monkeypatch, quantization):
    """One request at a time (every decode step one token: the fused in_proj and o_proj serve it), a one-token
    prompt (its prefill too), and steps of several tokens, which keep the norms apart. FP8: the projections hand
    their float8 weights and block scales to the kernels (layers.linear.gemv_weight)."""
    prompts = [[5], list(range(10, 50)), [7, 8, 9]]
    llm = make_llm(max_num_seqs=1, enable_prefix_caching=False, quantization=quantization)
    apart = greedy(llm, prompts)
    twins = TwinKernels()
    monkeypatch.setattr(linear, "norm_gemv_kernels", lambda x, kernels: twins)
    assert greedy(llm, prompts) == apart
    layers = llm.engine.model_config.num_hidden_layers
    assert twins.calls["in_proj"] >= 3 * 11 * (layers - 1)  # every decode step's layers past the first
    assert twins.calls["router"] > twins.calls["in_proj"]  # also in steps of up to 16 tokens (prompts' chunks)
    assert twins.calls["o_proj"] > 0
    assert (twins.calls["fp8"] == twins.calls["in_proj"] + twins.calls["o_proj"]) if quantization \
        else not twins.calls["fp8"]


def test_the_kernels_are_asked_for_only_on_a_gpu():
    assert linear.norm_gemv_kernels(torch.zeros(1, 4), KernelOptions()) is None
