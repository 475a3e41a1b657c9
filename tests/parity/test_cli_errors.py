"""Bad input to `deltaserve parity`: one line on stderr that names the problem, exit code 2, before any model runs."""

from __future__ import annotations

import json
import shutil

import pytest

from deltaserve.entrypoints.cli import main


def run(capsys, *args: str) -> tuple[int, str]:
    status = main(["parity", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return status, err[0]


def write_golden(captured, tmp_path, edit) -> str:
    raw = captured.load()
    edit(raw)
    path = tmp_path / "golden.json"
    path.write_text(json.dumps(raw))
    return str(path)


def test_missing_golden_file(captured, capsys, tmp_path):
    status, err = run(capsys, "check", "--model", str(captured.model), "--golden", str(tmp_path / "nope.json"))
    assert status == 2 and "nope.json does not exist" in err and "parity capture" in err


def test_golden_for_another_vocab_size(captured, capsys, tmp_path):
    model = tmp_path / "bigger-vocab"
    shutil.copytree(captured.model, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"vocab_size": 512}))
    status, err = run(capsys, "check", "--model", str(model), "--golden", str(captured.golden))
    assert status == 2 and "vocab_size 256" in err and "vocab_size 512" in err


@pytest.mark.parametrize("edit, says", [
    (lambda raw: raw["prompts"][2]["top2"].pop(), "prompts[2].top2"),
    (lambda raw: raw.pop("reference"), "reference"),
    (lambda raw: raw["prompts"][0].update(prompt_token_ids=[]), "prompts[0].prompt_token_ids"),
    (lambda raw: raw["prompts"][1]["output_token_ids"].__setitem__(0, 300), "token id 300"),
])
def test_malformed_golden(captured, capsys, tmp_path, edit, says):
    golden = write_golden(captured, tmp_path, edit)
    status, err = run(capsys, "check", "--model", str(captured.model), "--golden", golden)
    assert status == 2 and says in err


def test_golden_that_is_not_json(captured, capsys, tmp_path):
    (tmp_path / "g.json").write_text("{not json")
    status, err = run(capsys, "check", "--model", str(captured.model), "--golden", str(tmp_path / "g.json"))
    assert status == 2 and "not valid JSON" in err


def test_negative_tie_margin(captured, capsys):
    status, err = run(capsys, "check", "--model", str(captured.model), "--golden", str(captured.golden),
                      "--tie-margin", "-1")
    assert status == 2 and "--tie-margin" in err


def test_text_prompts_for_a_model_without_tokenizer(captured, capsys, tmp_path):
    (tmp_path / "prompts.txt").write_text("[1, 2, 3]\nhello there\n")
    status, err = run(capsys, "capture", "--model", str(captured.model), "--out", str(tmp_path / "g.json"),
                      "--prompts", str(tmp_path / "prompts.txt"))
    assert status == 2 and "prompts.txt:2" in err and "no tokenizer" in err
    assert not (tmp_path / "g.json").exists()


def test_capture_to_a_folder_that_does_not_exist_fails_before_capturing(capsys, tmp_path):
    status, err = run(capsys, "capture", "--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "x" / "g.json"))
    assert status == 2 and f"the folder {tmp_path / 'x'} does not exist" in err  # not the missing model: before it


def test_capture_out_a_folder_fails_before_capturing(capsys, tmp_path):
    status, err = run(capsys, "capture", "--model", str(tmp_path / "no-model"), "--out", str(tmp_path))
    assert status == 2 and err.endswith(f"--out {tmp_path}: a folder; name a file in it to write")


def test_check_plot_in_a_missing_folder_fails_before_checking(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    status, err = run(capsys, "check", "--golden", str(tmp_path / "no-golden.json"),
                      "--plot", str(tmp_path / "nope" / "m.png"))
    assert status == 2 and f"--plot {tmp_path / 'nope' / 'm.png'}: the folder {tmp_path / 'nope'} does not" in err


@pytest.mark.parametrize("command, flag", [("check", "--golden"), ("capture", "--prompts")])
def test_an_input_folder_is_named_as_one(captured, capsys, tmp_path, command, flag):
    args = ["--golden", str(tmp_path)] if command == "check" else [
        "--out", str(tmp_path / "g.json"), "--prompts", str(tmp_path)]
    status, err = run(capsys, command, "--model", str(captured.model), *args)
    assert status == 2 and f"{flag} {tmp_path}: a folder" in err


@pytest.fixture
def short_model(captured, tmp_path):
    """The captured model with a max length of 20 tokens."""
    model = tmp_path / "short"
    shutil.copytree(captured.model, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"model_max_length": 20}))
    return model


def test_capture_longer_than_the_model_fails_before_capturing(short_model, capsys, tmp_path):
    status, err = run(capsys, "capture", "--model", str(short_model), "--out", str(tmp_path / "g.json"),
                      "--num-prompts", "2", "--prompt-len", "12", "--max-tokens", "9")
    assert status == 2 and "--prompt-len (12 tokens) + --max-tokens 9 = 21 tokens, over the max length 20" in err
    assert not (tmp_path / "g.json").exists()


def test_check_of_a_golden_longer_than_the_model(captured, short_model, capsys):
    status, err = run(capsys, "check", "--model", str(short_model), "--golden", str(captured.golden))
    longest = captured.prompt_len + captured.max_tokens
    assert status == 2 and f"holds a sequence of {longest} tokens, over the max length 20" in err


@pytest.mark.parametrize("flag, value", [("--min-top1", "1.5"), ("--max-kl", "-1")])
def test_bad_gate(captured, capsys, flag, value):
    status, err = run(capsys, "check", "--model", str(captured.model), "--golden", str(captured.golden), flag, value)
    assert status == 2 and flag in err
