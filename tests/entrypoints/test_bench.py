"""`deltaserve bench` on the CPU: the table and JSON it writes, and its cache-capacity arithmetic."""

from __future__ import annotations

import json

import pytest

from deltaserve.cache.sizing import CachePlan
from deltaserve.entrypoints.bench import cache_capacity
from deltaserve.entrypoints.cli import main


def test_bench_command_writes_rows_and_capacity(tiny_model, tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["bench", "--model", str(tiny_model), "--load-format", "dummy", "--batch-sizes", "1,3", "--prompt-len",
            "7", "--output-len", "4", "--threads", "1", "--long-prompt-len", "40,50", "--json-out", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert [(row["batch"], row["prompt_len"]) for row in result["rows"]] == [(1, 7), (3, 7), (1, 40), (1, 50)]
    for row in result["rows"]:
        assert row["tpot_ms"] > 0 and row["output_tok_s"] > 0 and row["prefill_tok_s"] > 0 and row["floor_ms"] > 0
        assert row["floor_uniform_ms"] > 0 and row["faster_than_floor"] is False  # the CPU is far from its floor
        assert row["distinct_experts"] <= row["batch"] * 2 and row["distinct_experts_uniform"] <= 8
    assert [row["routed_tokens_per_step"] for row in result["rows"]] == [None, 3.0, None, None]  # batch 1: exactly k
    assert result["load_format"] == "dummy"
    assert result["capacity"]["max_context_batch1"] > 0 and "requests of 4k tokens" in printed
    assert result["programmatic_dependent_launch"] is False  # the CPU: off, and said in the JSON
    assert result["async_scheduling"] is False  # off by default on the CPU
    assert all(row["peak_memory_GiB"] is None for row in result["rows"]) and result["peak_memory_GiB"] is None
    assert all(row["alloc_retries"] is None for row in result["rows"])  # the GPU allocator's, per row
    assert "peak_memory_GiB" in printed  # a GPU's peak a row, "-" on the CPU


def test_cache_capacity_spends_the_allocated_bytes_on_one_request_or_on_4k_requests():
    # 10 pages of 16 tokens at 32 bytes a page, 2 KDA slots of 1000 bytes: 2320 bytes in all
    plan = CachePlan(num_blocks=10, num_slots=2, block_size=16, bytes_per_block=32, bytes_per_slot=1000)
    capacity = cache_capacity(plan)
    assert capacity["max_context_batch1"] == (2320 - 1000) // 2  # 2 bytes a token
    assert capacity["batch_at_4k"] == 2320 // (1000 + 256 * 32)  # = 0: a 4k request needs 9192 bytes
    assert cache_capacity(CachePlan(10, 4, 16, 0, 1000))["max_context_batch1"] is None  # no MLA layer: no limit


def test_bench_rejects_a_non_positive_long_prompt(tiny_model, capsys):
    assert main(["bench", "--model", str(tiny_model), "--long-prompt-len", "0"]) == 2
    assert "--long-prompt-len" in capsys.readouterr().err


def test_bench_rejects_a_long_prompt_past_max_model_len(tiny_model, capsys):
    assert main(["bench", "--model", str(tiny_model), "--prompt-len", "8", "--long-prompt-len", "100",
                 "--max-model-len", "64"]) == 2
    assert "--long-prompt-len 100 + 64 output tokens = 164 tokens exceeds --max-model-len 64" in capsys.readouterr().err


@pytest.mark.parametrize("flags,error", [
    (["--batch-sizes=-2,4"], "--batch-sizes -2,4: each must be a positive number of concurrent requests"),
    (["--batch-sizes", "0"], "--batch-sizes 0: must be a positive number"),
    (["--prompt-len", "0"], "--prompt-len 0: must be a positive number of tokens"),
    (["--output-len", "1"], "--output-len 1: must be at least 2"),
    # bench sets max_model_len to its longest request: past the model's own limit, the error names bench's flags
    (["--prompt-len", "5000"], "--prompt-len 5000 + --output-len 64 = 5064 tokens exceeds the model's limit (4096"),
    (["--max-model-len", "100"], "--prompt-len 512 + --output-len 64 = 576 tokens exceeds --max-model-len 100"),
    # checked before any row runs (before: the report printed, then the file failed)
    (["--json-out", "/nonexistent/b.json"], "--json-out /nonexistent/b.json: the folder /nonexistent does not exist"),
    (["--max-num-seqs", "2", "--batch-sizes", "1,4"], "--max-num-seqs 2 is below --batch-sizes' largest (4)"),
    (["--config", "c.json", "--load-format", "dummy"], "--config and --model both name the model; pass one"),
])
def test_bench_names_the_flag_a_bad_value_came_in(tiny_model, capsys, flags, error):
    """Each bad flag gets one line naming it (before: a negative batch size crashed in min() of an empty list, and
    a prompt past the model's limit was reported as a max_model_len the user never passed)."""
    assert main(["bench", "--model", str(tiny_model), *flags]) == 2
    err = capsys.readouterr().err
    assert error in err and "Traceback" not in err


@pytest.mark.parametrize("flag, words", [("--batch-sizes", "empty list of batch sizes; expected e.g. 1,16,64"),
                                         ("--long-prompt-len", "empty list of lengths; expected e.g. 8192,262144")])
def test_an_empty_list_is_named_for_what_it_lists(capsys, flag, words):
    with pytest.raises(SystemExit) as info:
        main(["bench", flag, ","])
    assert info.value.code == 2 and words in capsys.readouterr().err


def test_a_config_that_does_not_exist_is_named_as_a_file(capsys):
    assert main(["bench", "--config", "nofile.json", "--load-format", "dummy"]) == 2
    assert "nofile.json does not exist: pass the path of a config.json" in capsys.readouterr().err


def test_gpu_memory_utilization_out_of_range_is_refused(tiny_model, capsys):
    assert main(["bench", "--model", str(tiny_model), "--gpu-memory-utilization", "1.5"]) == 2
    assert "gpu_memory_utilization" in capsys.readouterr().err
