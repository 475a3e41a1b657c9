"""Dummy weights route like a trained model: the decode steps of many requests spread over the experts as balanced
routing would, measured on the 48B shape's router (hidden 2304, 256 experts, top-8) fed by the dummy model's own
hidden states.

The model is the 48B config cut to two layers (KDA with the dense MLP, then MLA with a MoE), with the attention
heads, vocabulary and MLP widths reduced so that it runs on a CPU; the router, the hidden size and the norms that
shape its inputs are the real ones. What depth adds to the router's inputs was measured apart (BENCHMARKS.md,
dummy routing)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.checkpoints import CONFIG_48B

from deltaserve.config import EngineConfig
from deltaserve.core.engine import Engine
from deltaserve.entrypoints.bench import measure_routing
from deltaserve.entrypoints.routing_stats import uniform_distinct_experts


def cut_48b_config() -> dict:
    raw = json.loads(CONFIG_48B.read_text())
    raw.update(num_hidden_layers=2, vocab_size=2048, intermediate_size=256, moe_intermediate_size=16,
               num_attention_heads=4, num_key_value_heads=4, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    raw["linear_attn_config"].update(kda_layers=[1], full_attn_layers=[2], num_heads=4)
    return raw


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    folder = tmp_path_factory.mktemp("cut_48b")
    (folder / "config.json").write_text(json.dumps(cut_48b_config()))
    torch.manual_seed(0)
    return Engine(str(folder), EngineConfig(load_format="dummy", threads=2, max_model_len=16, max_num_seqs=256,
                                            max_num_batched_tokens=1024, cache_bytes=256 << 20))


@pytest.mark.slow
@pytest.mark.parametrize("batch", [64, 256])
def test_decode_steps_of_many_requests_choose_as_many_experts_as_balanced_routing(engine, batch):
    stats = measure_routing(engine, batch, prompt_len=4, output_len=3, seed=batch)  # 2 decode steps
    assert stats.tokens_per_step == batch and stats.num_steps == 2
    balanced = uniform_distinct_experts(256, 8, batch)
    assert abs(stats.distinct_experts - balanced) < 0.1 * balanced, (stats.distinct_experts, balanced)
    if batch == 256:  # 4,096 picks: uniform routing puts the busiest expert near 1.8x the mean
        assert stats.busiest_expert_load < 2.5
