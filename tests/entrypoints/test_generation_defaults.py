"""Sampling defaults from the model folder's generation_config.json (as vLLM reads them): the file's values, the
command's own where it has none, an explicit flag over both; the demo model ships one, so it samples."""

from __future__ import annotations

import json
import shutil

import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.entrypoints.cli import main
from deltaserve.sampling_params import generation_defaults

FAST = ["--threads", "1", "--max-model-len", "128", "--json"]


@pytest.fixture
def sampling_model(tiny_model, tmp_path):
    """The tiny model with a generation_config.json that asks for sampling."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.9, "top_k": 5, "do_sample": True,
                                                                "max_length": 20, "top_p": None}))
    return folder


def test_generation_defaults_reads_the_sampling_fields_only(sampling_model, tiny_model):
    assert generation_defaults(sampling_model) == {"temperature": 0.9, "top_k": 5}
    assert generation_defaults(tiny_model) == {}


def test_a_bad_generation_config_is_an_error_naming_the_file(sampling_model):
    path = sampling_model / "generation_config.json"
    path.write_text('{"top_p": 2}')
    with pytest.raises(ValueError, match="generation_config.json: SamplingParams.top_p = 2"):
        generation_defaults(sampling_model)
    path.write_text("{")
    with pytest.raises(ValueError, match="generation_config.json is not valid JSON"):
        generation_defaults(sampling_model)


def output_ids(capsys, *argv) -> list[int]:
    assert main([str(a) for a in argv]) == 0
    return json.loads(capsys.readouterr().out)["output_token_ids"]


def test_generate_samples_with_the_folders_defaults_and_flags_override_them(capsys, sampling_model):
    base = ["generate", "--model", sampling_model, "--prompt-token-ids", "5,6,7", "--max-tokens", 12, "--ignore-eos",
            "--seed", 3, *FAST]
    llm = LLM(str(sampling_model), device="cpu", max_model_len=128, threads=1)
    assert llm.get_default_sampling_params().temperature == 0.9

    def expected(**params):
        prompt = {"prompt_token_ids": [5, 6, 7]}
        out = llm.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True, seed=3, **params), use_tqdm=False)
        return out[0].outputs[0].token_ids

    assert output_ids(capsys, *base) == expected(temperature=0.9, top_k=5)
    assert output_ids(capsys, *base, "--top-k", 0) == expected(temperature=0.9)
    assert output_ids(capsys, *base, "--temperature", 0) == expected(temperature=0)
    assert expected(temperature=0.9, top_k=5) != expected(temperature=0)


def test_the_demo_model_samples_by_default_and_says_which_prompt_it_used(capsys):
    assert LLM(device="cpu", max_model_len=64).get_default_sampling_params().temperature > 0
    assert main(["generate", "--max-tokens", "4", *FAST]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["prompt_token_ids"] and "no --prompt given: generating from 'Once upon a time'" in err


def test_a_bad_model_without_a_prompt_is_one_line(capsys, tmp_path):
    """The default prompt's notice comes once the model loaded: a bad --model's error is stderr's only line."""
    assert main(["generate", "--model", str(tmp_path / "missing"), *FAST]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
