"""Tensor and expert parallel on the CPU: 2 gloo processes give the single process's tokens, in float32; each rank
loads exactly its shard of every parameter, in every checkpoint layout."""

from __future__ import annotations

import pytest
import torch

from deltaserve.config import ConfigError, ModelConfig
from deltaserve.distributed import ParallelConfig
from deltaserve.entrypoints.llm import LLM
from deltaserve.loader.model_loader import load_model
from deltaserve.loader.sharding import shard_specs
from deltaserve.sampling_params import SamplingParams

PARALLEL_RUNS = [dict(tensor_parallel_size=2), dict(tensor_parallel_size=2, enable_expert_parallel=True)]


def _prompts(vocab: int) -> list[dict]:
    """Ragged prompts (1 to 40 tokens), so one step mixes decodes with prefill chunks."""
    return [{"prompt_token_ids": [(7 * i + 13 * j + 1) % vocab for j in range(n)]}
            for i, n in enumerate([1, 5, 17, 40])]


def _tokens(model_dir, prompts, vocab: int, **options) -> list[list[int]]:
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    # min_tokens masks every even id: a rank that did not mask would compute its next steps from other tokens
    masked = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, min_tokens=8,
                            stop_token_ids=list(range(0, vocab, 2)))
    sampled = SamplingParams(max_tokens=8, temperature=0.9, seed=3, ignore_eos=True)
    llm = LLM(model_dir, threads=1, max_model_len=128, max_num_batched_tokens=32, **options)
    try:
        outputs = llm.generate(prompts, [greedy, masked] + [greedy] * (len(prompts) - 3) + [sampled], use_tqdm=False)
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outputs]


def _check_equal_tokens(model_dir, vocab: int) -> None:
    prompts = _prompts(vocab)
    single = _tokens(model_dir, prompts, vocab)
    assert all(token % 2 for token in single[1])
    for options in PARALLEL_RUNS:
        assert _tokens(model_dir, prompts, vocab, **options) == single, options


def test_tensor_and_expert_parallel_match_one_process_on_make_tiny(tiny_model):
    _check_equal_tokens(tiny_model, ModelConfig.from_file(tiny_model).vocab_size)


def test_tensor_and_expert_parallel_match_one_process_on_a_transformers_model(tmp_path):
    from helpers.reference import SPECS, build_reference, save_layouts

    folders = save_layouts(build_reference(SPECS["hybrid"], seed=2), tmp_path)
    _check_equal_tokens(folders["transformers"], ModelConfig.from_file(folders["transformers"]).vocab_size)


@pytest.mark.parametrize("layout", ["saved", "moonshot", "transformers"])
def test_each_rank_loads_exactly_its_shard(tmp_path, layout):
    from helpers.reference import SPECS, build_reference, save_layouts

    folder = save_layouts(build_reference(SPECS["hybrid"], seed=1), tmp_path)[layout]
    cfg = ModelConfig.from_file(folder)
    full = dict(load_model(folder, cfg, torch.float32, "cpu").named_parameters())
    for expert_parallel in (False, True):
        ranks = [ParallelConfig(r, 2, expert_parallel) for r in range(2)]
        shards = [dict(load_model(folder, cfg, torch.float32, "cpu", parallel=p).named_parameters()) for p in ranks]
        specs = [shard_specs(cfg, p) for p in ranks]
        for name, whole in full.items():
            if name not in specs[0]:
                assert all(torch.equal(s[name], whole) for s in shards), name
                continue
            rebuilt = torch.full_like(whole, float("nan"))
            for shard, spec in zip(shards, specs):
                dim, ranges = spec[name]
                offset = 0
                for start, stop in ranges:
                    rebuilt.narrow(dim, start, stop - start).copy_(shard[name].narrow(dim, offset, stop - start))
                    offset += stop - start
                assert offset == shard[name].shape[dim], name
            assert torch.equal(rebuilt, whole), (name, expert_parallel)


@pytest.mark.parametrize("options, field", [
    (dict(tensor_parallel_size=3), "num_attention_heads"),
    (dict(tensor_parallel_size=3, enable_expert_parallel=True), "num_attention_heads"),
])
def test_sizes_that_do_not_divide_are_refused_naming_the_field(tiny_model, options, field):
    with pytest.raises(ConfigError, match=field):
        LLM(tiny_model, threads=1, **options)


def test_expert_parallel_needs_several_ranks():
    with pytest.raises(ConfigError, match="enable_expert_parallel"):
        LLM(None, enable_expert_parallel=True)


def test_bench_runs_tensor_parallel(tiny_model):
    from deltaserve.config import EngineConfig
    from deltaserve.entrypoints.bench import bench

    result = bench(tiny_model, EngineConfig(threads=1, max_model_len=64, max_num_seqs=2, tensor_parallel_size=2),
                   [1, 2], prompt_len=8, output_len=4)
    assert result["tensor_parallel_size"] == 2
    assert [row["batch"] for row in result["rows"]] == [1, 2]
    assert all(row["tpot_ms"] > 0 and row["floor_ms"] > 0 for row in result["rows"])
