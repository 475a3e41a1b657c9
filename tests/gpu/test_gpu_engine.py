"""The engine on a GPU: float32 equals the CPU's greedy tokens; CUDA graphs equal eager bf16. Skipped without CUDA."""

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.entrypoints.make_tiny import make_tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny") / "model", seed=3)


def greedy_tokens(llm, prompts, n=24):
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


PROMPTS = [[5], list(range(10, 73)), list(range(3, 203)), [7, 8, 9]]


def test_float32_gpu_matches_cpu(tiny):
    torch.backends.cuda.matmul.allow_tf32 = False
    cpu = greedy_tokens(LLM(tiny, device="cpu", max_model_len=512), PROMPTS)
    gpu = greedy_tokens(LLM(tiny, device="cuda", dtype="float32", max_model_len=512), PROMPTS)
    assert gpu == cpu


def test_cuda_graphs_match_eager_bf16(tiny):
    graphs = LLM(tiny, device="cuda", dtype="bfloat16", max_model_len=512)
    assert graphs.engine.runner.graphs is not None
    with_graphs = greedy_tokens(graphs, PROMPTS)
    graphs.engine.runner.graphs = None
    assert greedy_tokens(graphs, PROMPTS) == with_graphs
