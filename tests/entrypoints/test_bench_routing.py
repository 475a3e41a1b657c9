"""bench measures the experts its decode steps chose and sizes each row's floor from them: a router that sends
every token to the same experts earns a lower floor than uniform routing assumes, and a row faster than its floor
is flagged."""

from __future__ import annotations

import shutil

import pytest
from helpers.checkpoints import read_tensors, rewrite_tensors

from deltaserve import LLM
from deltaserve.config import EngineConfig, ModelConfig
from deltaserve.entrypoints.bench import bench, decode_step_bytes, floor_fields, floor_warning, print_report
from deltaserve.entrypoints.routing_stats import RoutingStats


def rigged_copy(tiny_model, folder):
    """The make-tiny model with every router rigged: zero logits, and a correction bias that lifts experts 0 and
    1 (of 8, top-2) above the rest, so every token chooses exactly those two."""
    shutil.copytree(tiny_model, folder)
    tensors = read_tensors(folder)
    for name, tensor in tensors.items():
        if name.endswith("gate.weight") and "block_sparse_moe" in name:
            tensors[name] = tensor * 0
        elif name.endswith("e_score_correction_bias"):
            tensors[name] = (tensor * 0).index_fill(0, tensor.new_tensor([0, 1]).long(), 1.0)
    rewrite_tensors(folder, tensors)
    return folder


def bench_row(folder, batch: int) -> dict:
    config = EngineConfig(threads=1, max_model_len=32, max_num_seqs=batch)
    return bench(str(folder), config, [batch], prompt_len=5, output_len=4)["rows"][0]


def test_a_router_that_picks_the_same_experts_for_every_token_gets_a_lower_floor(tiny_model, tmp_path):
    rigged, plain = bench_row(rigged_copy(tiny_model, tmp_path / "rigged"), 4), bench_row(tiny_model, 4)
    assert rigged["distinct_experts"] == 2.0 and rigged["busiest_expert_load"] == 4.0  # 2 of 8 experts: 4x the mean
    assert rigged["floor_ms"] < rigged["floor_uniform_ms"]
    assert plain["distinct_experts"] > 2.0 and plain["busiest_expert_load"] < 4.0
    cfg = ModelConfig.from_file(tiny_model / "config.json")
    measured = [decode_step_bytes(cfg, 4, 7, 4, row["distinct_experts"]) for row in (rigged, plain)]
    assert measured[0] < measured[1] < decode_step_bytes(cfg, 4, 7, 4, 8.0)


def test_the_statistics_count_the_real_tokens_of_decode_steps_only(tiny_model):
    row = bench_row(tiny_model, 3)  # 3 requests: a CUDA graph would pad them to 4
    assert row["routed_tokens_per_step"] == 3.0
    assert row["distinct_experts"] <= 3 * 2 and row["distinct_experts_uniform"] == pytest.approx(8 * (1 - 0.75 ** 3))


def test_a_row_faster_than_its_floor_is_flagged_and_warned_about(tiny_model, capsys):
    cfg = ModelConfig.from_file(tiny_model / "config.json")
    row = {"batch": 64, "prompt_len": 512, "ttft_ms": 1.0, "tpot_ms": 1e-9, "prefill_tok_s": 1.0, "output_tok_s": 1e12}
    row.update(floor_fields(cfg, row, RoutingStats(7.5, 1.2, 64.0, 10), context=528, dtype_bytes=2, bandwidth=4e12))
    assert row["faster_than_floor"] and row["distinct_experts"] == 7.5
    assert row["floor_ms"] < row["floor_uniform_ms"]  # 7.5 < the 8 * (1 - 0.75^64) uniform routing expects
    slower = {**row, **floor_fields(cfg, {**row, "output_tok_s": 1.0}, None, 528, 2, 4e12)}
    assert not slower["faster_than_floor"]
    result = {"device": "cpu", "dtype": "bfloat16", "copy_GBps": 4000.0, "peak_memory_GiB": None, "prompt_len": 512,
              "output_len": 32, "capacity": {"cache_GiB": 1.0, "max_context_batch1": 10, "batch_at_4k": 1},
              "rows": [row]}
    print_report(result)
    assert floor_warning(row) in capsys.readouterr().out


def test_eager_runs_bypass_the_decode_graphs_and_give_them_back(tiny_model):
    runner = LLM(str(tiny_model), threads=1, max_model_len=32).engine.runner
    graphs, compiled = object(), object()  # stand-ins: the CPU captures no CUDA graph
    runner.graphs, runner.compiled_decode = graphs, compiled
    with runner.eager():
        assert runner.graphs is None and runner.compiled_decode is None
    assert runner.graphs is graphs and runner.compiled_decode is compiled
