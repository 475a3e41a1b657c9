"""bench measures the experts its decode steps chose and sizes each row's floor from them: a router that sends
every token to the same experts earns a lower floor than uniform routing assumes, and a row faster than its floor
is flagged."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from helpers.checkpoints import read_tensors, rewrite_tensors

from deltaserve import LLM
from deltaserve.config import EngineConfig, ModelConfig
from deltaserve.entrypoints.bench import bench, decode_step_bytes, floor_fields, floor_warning, print_report
from deltaserve.entrypoints.routing_stats import RoutingRecorder, RoutingStats


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


def test_the_steady_part_of_the_decode_phase_has_every_request_in_every_step(tiny_model, monkeypatch):
    """run_batch's steady figures: prompts admitted two a step (a 16-token budget, 7-token prompts), so the first
    requests decode in the prefill phase's mixed steps and finish first; the steady part ends with the first one to
    finish, so every request got as many tokens in it as that one still lacked when the decode phase began. A
    request finished before the decode phase leaves no steady part."""
    from deltaserve.entrypoints import bench

    engine = LLM(str(tiny_model), threads=1, max_model_len=64, max_num_batched_tokens=16, num_decode_steps=1).engine
    at_start = []

    def prefill_phase(engine, batch):  # records each request's tokens when the decode phase begins
        finished, tokens = phase(engine, batch)
        at_start[:] = [len(r.output_token_ids) for r in engine.scheduler.requests.values()]
        assert sorted(tokens.values()) == sorted(at_start + [1] * len(finished))  # run_batch's view, from outputs
        return finished, tokens

    phase = bench._prefill_phase
    monkeypatch.setattr(bench, "_prefill_phase", prefill_phase)
    row = bench.run_batch(engine, 6, 7, 10, seed=1)
    assert len(at_start) == 6 and max(at_start) > min(at_start)  # staggered: the first started decoding early
    assert row["steady_tokens"] == 6 * (10 - max(at_start))
    assert min(at_start) == 1 and row["decode_rows_mean"] == (60 - sum(at_start)) / 9
    assert row["steady_tok_s"] > 0 and row["steady_tpot_ms"] > 0
    short = bench.run_batch(engine, 6, 7, 1, seed=2)  # the first request's only token ends it in the prefill phase
    assert short["steady_tokens"] == 0 and math.isnan(short["steady_tok_s"])


def test_routing_statistics_can_keep_the_steps_of_a_full_batch_only(tiny_model):
    model = LLM(str(tiny_model), threads=1, max_model_len=32).engine.model
    recorder = RoutingRecorder(model)
    k = recorder.moes[0].cfg.num_experts_per_token
    steps = [torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.tensor([[0, 1], [0, 1]]), torch.tensor([[6, 7]] * 3)]
    for ids in steps:
        for layer in range(len(recorder.moes)):
            recorder._record(layer, ids[:, :k])
    full = recorder.stats(tokens=3)
    assert full.num_steps == 2 and full.tokens_per_step == 3.0 and full.distinct_experts == (6 + 2) / 2
    assert recorder.stats().num_steps == 3 and recorder.stats(tokens=5) is None


def test_mean_rows_count_a_request_that_starts_the_decode_phase_with_lookahead_tokens(tiny_model):
    """A prompt whose last chunk is one token, nothing waiting: that step takes lookahead tokens, so the request
    starts the decode phase with several; a batch of one still carries one row a step."""
    from deltaserve.entrypoints.bench import run_batch

    engine = LLM(str(tiny_model), threads=1, max_model_len=64, max_num_batched_tokens=16, num_decode_steps=4).engine
    row = run_batch(engine, 1, 17, 10, seed=3)
    assert row["decode_rows_mean"] == 1.0
    assert math.isnan(run_batch(engine, 1, 7, 1, seed=4)["decode_rows_mean"])  # no decode step at all


def test_routing_falls_back_to_every_decode_step_where_none_had_the_whole_batch(tiny_model):
    """Requests that finish in the prefill phase leave no decode step with the whole batch: the floor is then sized
    from the decode steps there were (their routed tokens a step say so), not from uniform routing."""
    from deltaserve.entrypoints.bench import measure_routing

    engine = LLM(str(tiny_model), threads=1, max_model_len=64, max_num_batched_tokens=16, num_decode_steps=1).engine
    stats = measure_routing(engine, 6, 7, 3, seed=5)  # the first two requests finish before the last starts
    assert stats is not None and 0 < stats.tokens_per_step < 6 and stats.distinct_experts > 0
