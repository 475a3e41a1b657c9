"""The engine on a GPU: float32 equals the CPU's greedy tokens; CUDA graphs equal eager bf16; steps in flight equal
synchronous ones. Skipped without CUDA."""

import dataclasses
import json

import pytest
import torch
from helpers.engine import assert_same_up_to_near_ties, record_steps

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


def test_a_gpu_engine_watches_the_allocator_and_a_cpu_engine_does_not(tiny):
    """The watch reads torch's real memory_stats; a small model on a card with room never retries."""
    llm = LLM(tiny, device="cuda", dtype="bfloat16", max_model_len=512)
    greedy_tokens(llm, PROMPTS)
    watch = llm.engine._allocator_watch
    assert watch is not None and watch.check() == 0
    assert LLM(tiny, device="cpu", max_model_len=512).engine._allocator_watch is None


def test_a_warmed_up_gpu_engine_tunes_nothing_while_it_serves(tiny):
    """serve's start (EngineConfig.warmup_prefill): the prefill kernels compile and tune at every length bucket of
    a step, and for ragged token counts, before requests come, so ragged prompts within the budget meet no new tuning
    key and no kernel variant the process has not built. In a process of its own: this one's earlier tests built
    kernels already."""
    import subprocess
    import sys

    script = f"""
import json, logging
from deltaserve import LLM, SamplingParams
logging.basicConfig(level=logging.INFO)
llm = LLM({str(tiny)!r}, device="cuda", dtype="bfloat16", max_model_len=512, max_num_batched_tokens=256,
          warmup_prefill=True)
watch = llm.engine._compile_watch
if watch is None:
    print(json.dumps({{"skip": "this Triton has no compilation listener"}}))
    raise SystemExit
params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
llm.generate([{{"prompt_token_ids": p}} for p in {PROMPTS!r}], params, use_tqdm=False)
built = watch.check()
from deltaserve.kernels import compile_watch
before = compile_watch.COUNTS.variants[: len(compile_watch.COUNTS.variants) - len(built.variants)]
print(json.dumps({{"tuned": llm.engine._tuning_watch.check(), "compiled": built.compiled, "loaded": built.loaded,
                  "what": built.describe(), "variants": built.variants, "before": before}}))
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "start-up: prefill warm-up" in run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(result["skip"])
    served = {v.split("(")[0] for v in result["variants"]}  # beside the same kernels' variants the warm-up built
    warmed = [v for v in result["before"] if v.split("(")[0] in served]
    assert result["tuned"] == 0 and result["compiled"] == 0 and result["loaded"] == 0, \
        f"{result['what']}; serving built: {'; '.join(result['variants'])}; the warm-up built: {'; '.join(warmed)}"


def test_cuda_graphs_match_eager_bf16_up_to_near_ties():
    """Graph replay and eager decode run the same kernels at different padded shapes (block-table width, batch),
    so bf16 reductions may round differently: on the trained demo model they must give the same tokens, except
    where eager's own top two are within TIE logprob of each other and the graph took the second."""
    llm = LLM(device="cuda", dtype="bfloat16", max_model_len=512, enable_prefix_caching=False)
    assert llm.engine.runner.graphs is not None
    assert_graphs_match_eager(llm, PROMPTS)


def test_a_float8_latent_cache_decodes_as_the_bf16_one_up_to_near_ties():
    """--kv-cache-dtype fp8 on the GPU (graphs, the Triton decode kernel reading float8 pages, the fused prefill
    taking its chunk's keys as the cache keeps them): the trained demo model's tokens of a bf16 cache up to
    near-ties of 0.3 (its latents rounded to 3 mantissa bits)."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=8)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outputs = {}
    for kv in ("auto", "fp8"):
        llm = LLM(device="cuda", dtype="bfloat16", max_model_len=512, kv_cache_dtype=kv)
        outputs[kv] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    for f, b in zip(outputs["fp8"], outputs["auto"]):
        assert_same_up_to_near_ties(f, b, TIE=0.3)


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_norms_inside_the_projections_match_them_apart_up_to_near_ties(tiny, monkeypatch, quantization):
    """bf16, batch 1, eager: the decoder layers' norms run inside the GEMVs that read them (kernels.norm_gemv) or
    apart (FP8: the kernels read the float8 weights and their block scales). The first decode step (output 1: the
    same prompt, the same prefill-made token 0 and caches) differs only by the GEMVs' order of summation, so its
    log-probabilities agree closely; a wrong kernel moves them by far more. Later steps compound that rounding,
    and the random model's logits are flat (its top token's log-probability is about -4): after 8 steps the FP8
    run took a token 0.5 below the other's top, so the free-running tokens are compared up to ties of 1.0."""
    import deltaserve.kernels.norm_gemv as norm_gemv

    calls = []
    for name in ("add_norm_gemv", "gated_norm_gemv"):
        real = getattr(norm_gemv, name)
        monkeypatch.setattr(norm_gemv, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))
    llm = LLM(tiny, device="cuda", dtype="bfloat16", max_model_len=512, enable_prefix_caching=False,
              max_num_seqs=1, quantization=quantization, gpu_memory_utilization=0.3)
    llm.engine.runner.graphs = None
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=8)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    fused = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert {"add_norm_gemv", "gated_norm_gemv"} <= set(calls)
    model = llm.engine.runner.model
    model.set_kernel_options(dataclasses.replace(model.layers[0].kernels, norm_gemv=False))  # EngineConfig.norm_gemv
    calls.clear()
    apart = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert not calls
    for f, a in zip(fused, apart):
        first_step = [(f.logprobs[1][t].logprob, p.logprob) for t, p in a.logprobs[1].items() if t in f.logprobs[1]]
        assert len(first_step) >= 6 and max(abs(x - y) for x, y in first_step) < 0.1, first_step
        assert_same_up_to_near_ties(f, a, TIE=1.0)


def test_cuda_graphs_cover_contexts_up_to_the_model_length(tmp_path):
    """The graphs' block table spans the model length (the paged MLA kernel reads only each context), so a decode
    at 5k tokens of context (past the old 4k limit) replays a graph, and gives eager's tokens up to near ties."""
    tiny = make_tiny(tmp_path / "model", seed=4)
    config = json.loads((tiny / "config.json").read_text())
    (tiny / "config.json").write_text(json.dumps({**config, "model_max_length": 12000}))  # NoPE: any length runs
    llm = LLM(tiny, device="cuda", dtype="bfloat16", max_model_len=12000, enable_prefix_caching=False,
              max_num_batched_tokens=8192)  # the prompt in one chunk: one shape for fla's autotuning
    graphs = llm.engine.runner.graphs
    assert graphs.max_blocks * graphs.block_size >= 12000
    replays = []
    run = graphs.run
    graphs.run = lambda *args, **kwargs: replays.append(1) or run(*args, **kwargs)
    vocab = llm.engine.model_config.vocab_size
    assert_graphs_match_eager(llm, [[(i * 7919) % vocab for i in range(5000)], [3, 4]], max_tokens=8)
    assert len(replays) >= 6


def assert_graphs_match_eager(llm, prompts, max_tokens=24, TIE=0.1):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=8)
    prompts = [{"prompt_token_ids": p} for p in prompts]
    with_graphs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.engine.runner.graphs = None
    eager = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for g, e in zip(with_graphs, eager):
        assert_same_up_to_near_ties(g, e, TIE)


def test_steps_in_flight_replay_the_graphs_of_synchronous_steps_exactly(tiny):
    """bf16 with CUDA graphs: asynchronous scheduling (on by default on a GPU: each step queued before the one before
    it has synced, its graph inputs staged on the other side, its input tokens taken from the device) gives the very
    tokens of synchronous steps, greedy and seeded sampling: the same graphs replay the same inputs in the same
    order."""
    prompts = [{"prompt_token_ids": p} for p in PROMPTS + [list(range(20, 60))]]
    params = [SamplingParams(max_tokens=30 + 7 * i, temperature=0, ignore_eos=True) for i in range(3)]
    params += [SamplingParams(max_tokens=41, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True),
               SamplingParams(max_tokens=26, temperature=1.0, top_k=20, seed=6, ignore_eos=True)]
    tokens = {}
    for in_flight in (False, True):
        llm = LLM(tiny, device="cuda", dtype="bfloat16", max_model_len=512, async_scheduling=in_flight)
        assert llm.engine.runner.graphs is not None and llm.engine.async_scheduling == in_flight
        plans = record_steps(llm)
        tokens[in_flight] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        # one-token prompts: their first step replays a graph, and the step queued after it stages its inputs
        # while that step is unsynced (on the other staging side)
        short = [{"prompt_token_ids": [5 + i]} for i in range(4)]
        greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        tokens[in_flight] += [o.outputs[0].token_ids for o in llm.generate(short, greedy, use_tqdm=False)]
        assert any(ahead for _, ahead in plans) == in_flight
        del llm
    assert tokens[True] == tokens[False]
    assert LLM(tiny, device="cuda", dtype="bfloat16", max_model_len=512).engine.async_scheduling  # the default


def test_a_short_bf16_prompt_runs_without_fla_and_a_long_one_with_it(tiny):
    """fla-core's imports take seconds: a prompt of at most RECURRENT_PREFILL_MAX_LEN tokens prefills through our
    recurrent kernel and never imports it (nor its fla-core tuning); a longer one imports it then. One process a
    case (sys.modules is per process)."""
    import subprocess
    import sys

    from deltaserve.kernels.kda import RECURRENT_PREFILL_MAX_LEN

    pytest.importorskip("fla.ops.kda")
    code = ("import json, sys\nfrom deltaserve import LLM, SamplingParams\n"
            f"llm = LLM({str(tiny)!r}, device='cuda', dtype='bfloat16', max_model_len=512)\n"
            "out = llm.generate([{{'prompt_token_ids': list(range(3, 3 + {n}))}}], SamplingParams(max_tokens=8, "
            "temperature=0, ignore_eos=True), use_tqdm=False)\n"
            "print(json.dumps([out[0].outputs[0].token_ids, any(m.split('.')[0] == 'fla' for m in sys.modules)]))")
    for n, imports_fla in ((RECURRENT_PREFILL_MAX_LEN, False), (200, True)):  # 200: a first chunk of 192
        run = subprocess.run([sys.executable, "-c", code.format(n=n)], capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        tokens, fla_imported = json.loads(run.stdout.strip().splitlines()[-1])
        assert fla_imported == imports_fla and len(tokens) == 8
