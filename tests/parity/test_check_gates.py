"""What fails a check besides a real divergence: another model (top-1 agreement under the floor, KL over the
ceiling) in any regime, and the tie margin taken from the coarser of the golden's regime and the run's."""

from __future__ import annotations

import argparse
import re

import pytest

from deltaserve.entrypoints.cli import main
from deltaserve.parity.commands import _tie_margin
from deltaserve.parity.golden import Golden
from deltaserve.parity.report import MAX_LISTED

LISTED = re.compile(r"^  (free-running|teacher-forced): ")


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    """The captured model's architecture with another seed's weights: a different model."""
    from helpers.reference import SPECS, build_reference

    folder = tmp_path_factory.mktemp("other") / "model"
    build_reference(SPECS["hybrid"], seed=4).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_another_model_fails_and_the_report_says_why(captured, other_model, capsys, dtype):
    status = main(["parity", "check", "--model", str(other_model), "--golden", str(captured.golden), "--dtype", dtype])
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert status == 1, out
    verdict = next(line for line in lines if line.startswith("verdict: "))
    assert verdict.startswith("verdict: FAIL: ") and "(--min-top1)" in verdict and "(--max-kl)" in verdict
    assert f"captured from model {captured.model.resolve()}; checking model {other_model}" in err
    total = int(re.search(r"divergences: (\d+) \(", out).group(1))
    assert total > MAX_LISTED and sum(bool(LISTED.match(line)) for line in lines) == MAX_LISTED
    assert f"... {total - MAX_LISTED} more divergences (the first {MAX_LISTED} listed)" in lines
    assert re.fullmatch(r"match \d+/\d+", lines[-1])


def regime_args(dtype="float32", quantization=None, kv_cache_dtype="auto", tie_margin=None):
    return argparse.Namespace(dtype=dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                              tie_margin=tie_margin, golden="g.json")


@pytest.mark.parametrize("golden_dtype, args, margin, regime", [
    ("float32", regime_args(), 4.4e-5, "float32"),
    ("bfloat16", regime_args(), 6.2, "bfloat16"),
    ("float32", regime_args("bfloat16"), 6.2, "bfloat16"),
    ("float32", regime_args(quantization="fp8"), 8.5, "fp8"),
    ("bfloat16", regime_args("bfloat16", kv_cache_dtype="fp8"), 8.5, "fp8"),
])
def test_tie_margin_is_the_coarser_regimes(golden_dtype, args, margin, regime):
    value, source = _tie_margin(args, Golden("m", "transformers", golden_dtype, []))
    assert value == margin and source.startswith(f"the {regime} default")


def test_tie_margin_flag_wins_and_an_unknown_golden_dtype_asks_for_it():
    golden = Golden("m", "transformers", "float16", [])
    assert _tie_margin(regime_args(tie_margin=0.5), golden) == (0.5, "--tie-margin")
    with pytest.raises(ValueError, match="pass --tie-margin"):
        _tie_margin(regime_args(), golden)


def test_bfloat16_golden_checked_in_float32_takes_the_bfloat16_margin(captured, capsys, tmp_path):
    golden = tmp_path / "bf16.json"
    assert main(["parity", "capture", "--model", str(captured.model), "--out", str(golden), "--reference",
                 "deltaserve", "--dtype", "bfloat16", "--num-prompts", "4", "--prompt-len", "12",
                 "--max-tokens", "8"]) == 0
    status = main(["parity", "check", "--model", str(captured.model), "--golden", str(golden)])
    out = capsys.readouterr().out
    assert status == 0, out
    assert ("at tie margin 6.2 (the bfloat16 default: the coarser of the golden's bfloat16 and this run's "
            "float32)") in out and "verdict: pass" in out
