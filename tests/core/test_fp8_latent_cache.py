"""--kv-cache-dtype fp8: the MLA latent cache in float8_e4m3fn. A float32 run with it is no longer the reference's
arithmetic, but it stays deterministic: a prompt's chunk reads its own keys as the cache keeps them, so chunking,
prefix caching and decoding step by step give the tokens of one whole-prompt prefill."""

from __future__ import annotations

import pytest
import torch
from helpers.engine import as_inputs, assert_same_outputs, mixed_params, random_prompts

from deltaserve.kernels.cache_ops import write_latents
from deltaserve.kernels.mla.attention import gather_latents

PROMPT_LENS = (150, 65, 17, 1)


def test_written_latents_are_clamped_and_rounded_to_float8_and_read_back_widened():
    cache = torch.zeros(3, 4, 5, dtype=torch.float8_e4m3fn)
    latents = torch.tensor([[1000.0, -1000.0, 0.1, 3.3, -0.0]] * 2)
    write_latents(cache, torch.tensor([5, 2]), latents)
    expected = torch.tensor([448.0, -448.0, 0.1015625, 3.25, 0.0])
    read = gather_latents(cache, torch.tensor([0, 1]), 6, 2, dtype=torch.float32)  # positions 2..5
    assert torch.equal(read[0], expected) and torch.equal(read[3], expected)
    assert not read[1:3].any() and cache.dtype == torch.float8_e4m3fn


def test_chunks_and_cached_prefixes_give_the_tokens_of_a_whole_prompt(make_llm):
    prompts, params = random_prompts(PROMPT_LENS, seed=4), mixed_params(len(PROMPT_LENS), min_tokens=4)
    whole = make_llm(max_num_seqs=4, max_num_batched_tokens=2048, enable_prefix_caching=False, kv_cache_dtype="fp8")
    assert all(c["latent"].dtype == torch.float8_e4m3fn for c in whole.engine.runner.caches if "latent" in c)
    expected = whole.generate(as_inputs(prompts), params, use_tqdm=False)
    chunked = make_llm(max_num_seqs=4, max_num_batched_tokens=7, enable_prefix_caching=False, kv_cache_dtype="fp8")
    assert_same_outputs(chunked.generate(as_inputs(prompts), params, use_tqdm=False), expected, "chunks of 7")
    cached = make_llm(max_num_seqs=4, kv_cache_dtype="fp8")
    cached.generate(as_inputs(prompts), params, use_tqdm=False)  # the prompts' pages now cached
    again = cached.generate(as_inputs(prompts), params, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in again) > 0
    assert_same_outputs(again, expected, "prompts served from the prefix cache")


def test_a_gpu_without_float8_loads_is_refused_with_the_fix(monkeypatch):
    from deltaserve.runner import model_runner

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"compute capability 8.9 or later .* is 8\.0: use kv_cache_dtype 'auto'"):
        model_runner._check_latent_dtype(torch.float8_e4m3fn, torch.device("cuda"))
    model_runner._check_latent_dtype(torch.bfloat16, torch.device("cuda"))  # the run dtype's cache: any GPU
    model_runner._check_latent_dtype(torch.float8_e4m3fn, torch.device("cpu"))
