"""EngineConfig.compile_decode: CPU decode steps of up to COMPILED_DECODE_MAX_SEQS requests run the model's forward as
one torch.compile graph (runner.model_runner). The CPU kernels take graph-safe forms while traced (the conv update
and the KDA step batched, the experts gathered), and inductor sums in its own order, so the logits are close to
eager's, not equal: these prompts' greedy tokens, and the compiled graph actually serving the decode steps."""

import json
import shutil

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


def test_a_second_model_in_the_process_gets_its_own_graph(make_llm, tmp_path):
    """Dynamo caches compiled graphs per code object (the model's forward), and compile_decode drops most guards on
    the model's modules: an engine on another model whose caches have the same shapes (the tiny model with another
    routed_scaling_factor, a constant the graph bakes in) must compile its own graph, not replay the first's."""
    other = tmp_path / "other"
    shutil.copytree(make_llm.model_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["routed_scaling_factor"] = 3 * config.get("routed_scaling_factor", 1.0)
    (other / "config.json").write_text(json.dumps(config))
    prompt = [list(range(3, 30))]
    first = make_llm(compile_decode=True, enable_prefix_caching=False)
    first_tokens = greedy(first, prompt)
    second = make_llm(other, compile_decode=True, enable_prefix_caching=False)
    second_eager = greedy(make_llm(other, enable_prefix_caching=False), prompt)
    assert second_eager != first_tokens  # the constant matters to these tokens
    assert greedy(second, prompt) == second_eager
    assert greedy(first, prompt) == first_tokens == greedy(make_llm(enable_prefix_caching=False), prompt)


def test_a_failed_compile_leaves_the_engine_running_eagerly(make_llm, monkeypatch, caplog):
    """No working C++ compiler (inductor fails before the graph runs): a warning, then eager steps, the same
    tokens as an eager engine's."""
    import torch

    monkeypatch.setattr(torch._inductor.config.cpp, "cxx", ("no-such-compiler",))
    torch._dynamo.reset()  # no graph compiled earlier in this process may serve this test
    prompt = [list(range(3, 30))]
    compiled = make_llm(compile_decode=True, enable_prefix_caching=False)
    with caplog.at_level("WARNING", logger="deltaserve"):
        tokens = greedy(compiled, prompt)
    assert "compiling the decode step failed, running eagerly" in caplog.text
    assert compiled.engine.runner.compiled_decode is None
    assert tokens == greedy(make_llm(enable_prefix_caching=False), prompt)
