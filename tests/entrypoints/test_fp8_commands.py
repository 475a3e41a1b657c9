"""--quantization fp8 on the commands: generate runs FP8 weights, bench sizes its floor from FP8 bytes."""

from __future__ import annotations

import json

from helpers.checkpoints import CONFIG_48B

from deltaserve.config import EngineConfig, ModelConfig
from deltaserve.entrypoints.bench import decode_step_bytes
from deltaserve.entrypoints.cli import main


def test_generate_with_fp8_weights(tiny_model, capsys):
    args = ["generate", "--model", str(tiny_model), "--prompt-token-ids", "5,6,7", "--max-tokens", "5", "--json",
            "--ignore-eos", "--threads", "1", "--quantization", "fp8"]
    assert main(args) == 0
    assert len(json.loads(capsys.readouterr().out)["output_token_ids"]) == 5


def test_bench_runs_fp8_dummy_weights(tiny_model):
    from deltaserve.entrypoints.bench import bench

    result = bench(str(tiny_model), EngineConfig(threads=1, max_model_len=32, max_num_seqs=1, load_format="dummy",
                                                 quantization="fp8"), [1], prompt_len=8, output_len=3)
    assert result["quantization"] == "fp8" and result["rows"][0]["tpot_ms"] > 0


def test_fp8_halves_the_48b_decode_floor_but_for_lm_head_and_caches():
    bf16 = decode_step_bytes(ModelConfig.from_file(CONFIG_48B), 1, 512, 2)
    fp8 = decode_step_bytes(ModelConfig.from_file(CONFIG_48B, quantization="fp8"), 1, 512, 2)
    assert 0.5 < fp8 / bf16 < 0.65  # lm_head (0.75 GB in bf16) and the high-precision rest stay
