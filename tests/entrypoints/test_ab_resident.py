"""benchmarks/gpu/ab_resident.py on the CPU (the demo model, both sides this tree): each side starts once, the
rounds alternate ABBA, each side's rows come back per round, and the summary compares the medians."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from deltaserve.entrypoints.llm import BUNDLED_MODEL

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu" / "ab_resident.py"


def test_two_resident_sides_alternate_and_are_summarised(tmp_path):
    out = tmp_path / "ab.json"
    result = subprocess.run([sys.executable, str(SCRIPT), "--tree", f"a={ROOT}", "--tree", f"b={ROOT}", "--rounds", "2",
                             "--model", str(BUNDLED_MODEL), "--load-format", "auto", "--device", "cpu",
                             "--batch-sizes", "1,3", "--prompt-len", "16", "--output-len", "4",
                             "--log-dir", str(tmp_path), "--json-out", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:] + result.stdout[-2000:]
    report = json.loads(out.read_text())
    assert report["order"] == [[0, "a"], [0, "b"], [1, "b"], [1, "a"]]
    for side in ("a", "b"):
        assert [[row["batch"] for row in r["rows"]] for r in report["results"][side]] == [[1, 3], [1, 3]]
    assert [entry["batch"] for entry in report["summary"]] == [1, 3]
    assert all(entry["tpot_ms"]["ratio"] > 0 for entry in report["summary"])
    assert "a ready after" in result.stdout and "b ready after" in result.stdout and "a / b" in result.stdout


def test_summary_takes_the_median_of_the_rounds_with_numbers():
    """A steady figure is NaN in a round where a request finished before the decode phase: the median is over the
    other rounds, in whatever order they came, and a side with none has no ratio."""
    spec = importlib.util.spec_from_file_location("ab_resident", SCRIPT)
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    nan = float("nan")
    rounds = {"a": [[nan, 1.0], [1.0, nan], [2.0, nan]], "b": [[4.0, nan], [nan, nan], [6.0, nan]]}
    results = {side: [{"rows": [{"batch": 8, "tpot_ms": 1.0, "steady_tpot_ms": v, "output_tok_s": 1.0,
                                 "steady_tok_s": w, "ttft_ms": 1.0}]} for v, w in values]
               for side, values in rounds.items()}
    entry = ab.summarise(results, ["a", "b"])[0]
    assert entry["steady_tpot_ms"] == {"a": 1.5, "b": 5.0, "ratio": 0.3}
    assert entry["steady_tok_s"]["a"] == 1.0 and entry["steady_tok_s"]["ratio"] is None


@pytest.mark.parametrize("flag", ["--rounds", "--output-len", "--batch-sizes"])
def test_bad_counts_are_refused(flag):
    result = subprocess.run([sys.executable, str(SCRIPT), "--model", "unused", "--tree", "a=.", "--tree", "b=.",
                             flag, "0"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "'0': must be a positive integer" in result.stderr


def test_two_trees_are_required():
    result = subprocess.run([sys.executable, str(SCRIPT), "--model", "unused", "--tree", "a=."],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--tree NAME=DIR twice" in result.stderr
