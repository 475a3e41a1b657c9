"""EngineConfig.compile_decode: CPU decode steps of up to COMPILED_DECODE_MAX_SEQS requests run the model's forward as
one torch.compile graph (runner.model_runner). The CPU kernels take graph-safe forms while traced (the conv update
and the KDA step batched, the experts gathered), and inductor sums in its own order, so the logits are close to
eager's, not equal: these prompts' greedy tokens, and the compiled graph actually serving the decode steps."""

import pytest

from deltaserve import SamplingParams
from deltaserve.runner.model_runner import COMPILED_DECODE_MAX_SEQS

pytestmark = pytest.mark.slow  # compiling: ~30 s


def greedy(llm, prompts, n=20):
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_compiled_decode_steps_give_the_eager_tokens(make_llm):
    """One request at a time (batch 1; a one-token prompt's block table one page wide, then wider), then three
    together (a batch of 3), in bursts and single steps; a batch of 6 stays eager."""
    prompts = [[5], list(range(10, 50)), [7, 8, 9]]
    eager = make_llm(max_num_seqs=8, enable_prefix_caching=False)
    compiled = make_llm(max_num_seqs=8, enable_prefix_caching=False, compile_decode=True)
    calls = []
    graph = compiled.engine.runner.compiled_decode
    compiled.engine.runner.compiled_decode = lambda ids, batch, caches: calls.append(ids.shape[0]) or graph(
        ids, batch, caches)
    for prompt in prompts:
        assert greedy(compiled, [prompt]) == greedy(eager, [prompt])
    assert greedy(compiled, prompts) == greedy(eager, prompts)
    assert {1, 3} <= set(calls) and max(calls) <= COMPILED_DECODE_MAX_SEQS
    six = prompts + [[p + 1 for p in prompt] for prompt in prompts]
    calls.clear()
    assert greedy(compiled, six, n=6) == greedy(eager, six, n=6)
    assert all(n <= COMPILED_DECODE_MAX_SEQS for n in calls)
