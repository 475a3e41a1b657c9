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
