"""benchmarks/gpu/ab_resident.py on the CPU (the demo model, both sides this tree): each side starts once, the
rounds alternate ABBA, each side's rows come back per round, and the summary compares the medians."""

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


@pytest.mark.parametrize("flag", ["--rounds", "--output-len", "--batch-sizes"])
def test_bad_counts_are_refused(flag):
    result = subprocess.run([sys.executable, str(SCRIPT), "--model", "unused", "--tree", "a=.", "--tree", "b=.",
                             flag, "0"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "'0': must be a positive integer" in result.stderr


def test_two_trees_are_required():
    result = subprocess.run([sys.executable, str(SCRIPT), "--model", "unused", "--tree", "a=."],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--tree NAME=DIR twice" in result.stderr
