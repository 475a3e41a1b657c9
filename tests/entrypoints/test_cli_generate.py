"""`deltaserve generate` and `deltaserve make-tiny` as DESIGN.md section 5 states them: what goes to stdout (and
nothing else), exit codes, one-line errors on stderr, the three layouts, the bundled default model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.checkpoints import read_tensors, rewrite_tensors

from deltaserve import LLM, SamplingParams
from deltaserve.entrypoints.cli import main

LAYOUTS = ("moonshot", "saved", "transformers")
JSON_KEYS = ["prompt_token_ids", "output_token_ids", "text", "finish_reason"]
FAST = ["--threads", "1", "--max-model-len", "256"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """make-tiny with one seed in each layout, through the command line."""
    root = tmp_path_factory.mktemp("cli_tiny")
    for layout in LAYOUTS:
        assert main(["make-tiny", str(root / layout), "--seed", "3", "--layout", layout]) == 0
    return {layout: root / layout for layout in LAYOUTS}


@pytest.fixture
def no_tokenizer(tiny, tmp_path) -> Path:
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny["moonshot"] / name, tmp_path / name)
    return tmp_path


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def error_lines(err: str) -> list[str]:
    assert "Traceback" not in err
    return [line for line in err.splitlines() if line.startswith("error:")]


def test_make_tiny_writes_a_small_complete_model(tiny):
    for folder in tiny.values():
        assert {p.name for p in folder.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json",
                                                      "tokenizer_config.json"}
        assert (folder / "model.safetensors").stat().st_size < 8 << 20
        tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
        assert tokenizer_config["model_max_length"] == 4096 and tokenizer_config["chat_template"]
    assert len({frozenset(read_tensors(f)) for f in tiny.values()}) == 3, "each layout spells its tensors its way"


def test_make_tiny_refuses_a_folder_that_is_not_empty(capsys, tiny):
    code, out, err = run(capsys, "make-tiny", tiny["moonshot"])
    assert code == 2 and out == ""
    [line] = error_lines(err)
    assert str(tiny["moonshot"]) in line and "not empty" in line


def test_make_tiny_where_no_folder_can_be_made_is_one_clear_error(capsys, tmp_path):
    (tmp_path / "file").write_text("")
    code, out, err = run(capsys, "make-tiny", tmp_path / "file" / "model")
    assert code == 2 and out == ""
    [line] = error_lines(err)
    assert f"cannot create {tmp_path / 'file'}" in line and "writable place" in line


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.startswith("deltaserve ")


def test_generate_json_is_one_object_per_prompt_in_order(capsys, tiny):
    prompts = [[5, 6, 7, 8, 9, 10, 11], [42], [300, 301]]
    argv = ["generate", "--model", tiny["moonshot"], "--max-tokens", 9, "--ignore-eos", "--json", *FAST]
    for p in prompts:
        argv += ["--prompt-token-ids", ",".join(map(str, p))]
    code, out, err = run(capsys, *argv)
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == len(prompts) and out.endswith("\n")
    records = [json.loads(line) for line in lines]
    llm = LLM(str(tiny["moonshot"]), device="cpu", max_model_len=256, threads=1)
    expected = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=9, temperature=0, ignore_eos=True), use_tqdm=False)
    for record, prompt, want in zip(records, prompts, expected):
        assert list(record) == JSON_KEYS
        assert record["prompt_token_ids"] == prompt
        assert record["output_token_ids"] == want.outputs[0].token_ids and len(record["output_token_ids"]) == 9
        assert record["text"] == want.outputs[0].text
        assert record["finish_reason"] == "length"


def test_generate_without_json_prints_only_the_texts(capsys, tiny):
    argv = ["generate", "--model", tiny["moonshot"], "--prompt", "Hello there", "--prompt-token-ids", "7,8,9",
            "--max-tokens", 6, "--ignore-eos", *FAST]
    code, text_out, err = run(capsys, *argv)
    assert code == 0
    code, json_out, _ = run(capsys, *argv, "--json")
    texts = [json.loads(line)["text"] for line in json_out.splitlines()]
    assert len(texts) == 2 and all(texts)
    assert text_out == "".join(t + "\n" for t in texts)
    assert "tok/s" in err  # timings go to stderr


def test_every_layout_gives_the_same_greedy_tokens(capsys, tiny):
    outputs = []
    for layout in LAYOUTS:
        code, out, _ = run(capsys, "generate", "--model", tiny[layout], "--prompt-token-ids", "3,1,4,1,5,9,2,6",
                           "--prompt-token-ids", "100", "--max-tokens", 12, "--ignore-eos", "--json", *FAST)
        assert code == 0
        outputs.append([json.loads(line)["output_token_ids"] for line in out.splitlines()])
    assert outputs[0] == outputs[1] == outputs[2]


def test_seeded_sampling_repeats(capsys, tiny):
    argv = ["generate", "--model", tiny["moonshot"], "--prompt-token-ids", "10,11,12", "--max-tokens", 10,
            "--temperature", "0.9", "--top-p", "0.95", "--seed", "7", "--ignore-eos", "--json", *FAST]
    first, second = (json.loads(run(capsys, *argv)[1])["output_token_ids"] for _ in range(2))
    assert first == second and len(first) == 10


def test_folder_without_tokenizer_takes_token_ids(capsys, no_tokenizer):
    code, out, _ = run(capsys, "generate", "--model", no_tokenizer, "--prompt-token-ids", "1,2,3", "--max-tokens", 4,
                       "--ignore-eos", "--json", *FAST)
    assert code == 0
    record = json.loads(out)
    assert record["text"] == "" and len(record["output_token_ids"]) == 4


def test_text_prompt_without_tokenizer_is_one_clear_error(capsys, no_tokenizer):
    for prompt in (["--prompt", "hello"], []):  # the default prompt is text too
        code, out, err = run(capsys, "generate", "--model", no_tokenizer, *prompt, "--max-tokens", 4, *FAST)
        assert code == 2 and out == ""
        [line] = error_lines(err)
        assert "no tokenizer" in line and "--prompt-token-ids 1,2,3" in line  # the flag, not the Python API's dict


@pytest.mark.parametrize("value,message", [
    ("1,x,3", "expected comma-separated integers"),
    ("1.5,2", "expected comma-separated integers"),
    ("", "empty token id list"),
    (",", "empty token id list"),
])
def test_malformed_prompt_token_ids_are_usage_errors(capsys, tiny, value, message):
    with pytest.raises(SystemExit) as info:
        main(["generate", "--model", str(tiny["moonshot"]), "--prompt-token-ids", value])
    out, err = capsys.readouterr()
    assert info.value.code == 2 and out == ""
    assert message in err and "--prompt-token-ids" in err


@pytest.mark.parametrize("value", ["1,2,512", "1,-3"])
def test_out_of_vocabulary_prompt_token_ids(capsys, tiny, value):
    code, out, err = run(capsys, "generate", "--model", tiny["moonshot"], "--prompt-token-ids", value, *FAST)
    assert code == 2 and out == ""
    [line] = error_lines(err)
    assert "out of range" in line and "[0, 512)" in line


def test_a_file_passed_as_the_model_folder_is_named_so(capsys, tiny):
    code, out, err = run(capsys, "generate", "--model", tiny["moonshot"] / "model.safetensors", "--prompt", "hi", *FAST)
    assert code == 2 and out == ""
    [line] = error_lines(err)
    assert "model.safetensors is a file, not a model folder" in line and "JSON" not in line


def test_cuda_on_a_machine_without_it_is_a_clear_error(capsys, tiny, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = run(capsys, "generate", "--model", tiny["moonshot"], "--prompt", "hi", "--device", "cuda", *FAST)
    assert code == 2 and out == ""
    [line] = error_lines(err)
    assert "device 'cuda': CUDA is not available" in line and "--device cpu" in line


def test_a_mistyped_option_is_one_line_naming_the_help(capsys):
    with pytest.raises(SystemExit) as info:
        main(["generate", "--max-tokens", "abc"])
    out, err = capsys.readouterr()
    assert info.value.code == 2 and out == ""
    assert err.splitlines() == ["deltaserve generate: error: argument --max-tokens: invalid int value: 'abc' "
                                "(see deltaserve generate --help)"]


def test_max_tokens_past_the_models_length_is_noted(capsys, tiny):
    code, out, err = run(capsys, "generate", "--model", tiny["moonshot"], "--prompt-token-ids", "1,2",
                         "--max-tokens", 1000, "--ignore-eos", "--json", *FAST)
    assert code == 0 and json.loads(out)["finish_reason"] == "length"
    assert "note: --max-tokens 1000 is past the model's length, 256 tokens" in err


def test_missing_model_folder(capsys, tmp_path):
    code, out, err = run(capsys, "generate", "--model", tmp_path / "nowhere", "--prompt-token-ids", "1", *FAST)
    assert code == 2 and out == ""
    [line] = error_lines(err)
    assert str(tmp_path / "nowhere") in line


def test_broken_checkpoint_names_the_tensor(capsys, tiny, tmp_path):
    shutil.copytree(tiny["moonshot"], tmp_path, dirs_exist_ok=True)
    tensors = read_tensors(tmp_path)
    del tensors["model.layers.2.self_attn.kv_b_proj.weight"]
    rewrite_tensors(tmp_path, tensors)
    code, out, err = run(capsys, "generate", "--model", tmp_path, "--prompt-token-ids", "1", *FAST)
    assert code == 2 and out == ""
    [line] = error_lines(err)
    assert "missing tensor model.layers.2.self_attn.kv_b_proj.weight" in line


def test_bundled_model_runs_when_model_is_omitted(capsys):
    code, out, _ = run(capsys, "generate", "--prompt-token-ids", "1,2,3", "--max-tokens", 5, "--ignore-eos", "--json",
                       *FAST)
    assert code == 0
    assert len(json.loads(out)["output_token_ids"]) == 5
    code, out, _ = run(capsys, "generate", "--max-tokens", 5, "--ignore-eos", *FAST)  # the default prompt
    assert code == 0 and out.strip()


@pytest.mark.slow  # a fresh interpreter imports torch: ~5-10 s
def test_module_entry_point_in_a_subprocess(tiny):
    """`python -m deltaserve.entrypoints.cli` (what the console script runs): stdout is the JSON line alone."""
    result = subprocess.run(
        [sys.executable, "-m", "deltaserve.entrypoints.cli", "generate", "--model", str(tiny["saved"]),
         "--prompt-token-ids", "5,6,7", "--max-tokens", "4", "--ignore-eos", "--json", *FAST],
        capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert list(record) == JSON_KEYS and len(record["output_token_ids"]) == 4


def test_out_of_range_num_decode_steps_is_one_clear_error(capsys, tiny):
    code, out, err = run(capsys, "generate", "--model", tiny["moonshot"], "--prompt-token-ids", "1",
                         "--num-decode-steps", 0, *FAST)
    assert code == 2 and out == ""
    [line] = error_lines(err)
    assert "num_decode_steps = 0" in line and "[1, 64]" in line
