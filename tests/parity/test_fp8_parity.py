"""FP8 weights against the unquantized model through `parity check --quantization fp8`, on the bundled demo model (a
trained Kimi-Linear: on random weights the top-1 is a coin toss among near-equal logits, so agreement would
measure nothing): teacher-forced top-1 agreement >= 95% against the float32 golden, with the KL reported."""

from __future__ import annotations

import re

from deltaserve.entrypoints.cli import main

TOTALS = re.compile(r"top-1 agreement (\d+)/(\d+) \(([\d.]+)%\), KL\(golden \|\| ours\) mean ([\d.e+-]+)")


def test_fp8_keeps_95_percent_teacher_forced_top1_of_the_demo_model(tmp_path, capsys):
    golden = tmp_path / "golden.json"
    assert main(["parity", "capture", "--reference", "deltaserve", "--num-prompts", "8", "--prompt-len", "32",
                 "--max-tokens", "32", "--out", str(golden)]) == 0
    status = main(["parity", "check", "--golden", str(golden), "--quantization", "fp8"])
    out = capsys.readouterr().out
    assert status == 0 and "at tie margin 8.5 (the fp8 default: the coarser of the golden's float32" in out, out
    assert "checking deltaserve float32 with fp8 weights on cpu" in out
    agree, total, _, kl_mean = TOTALS.search(out).groups()
    assert int(total) == 256 and int(agree) >= 0.95 * 256, out
    assert 0 < float(kl_mean) < 1e-2, out  # FP8 changes the model a little, not nothing
