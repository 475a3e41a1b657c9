"""benchmarks/gpu/async_ab.py on the CPU (its check mode, float32, the demo model's shape with dummy weights): both
ways give the same greedy tokens, and each round times both; bad counts are refused before any engine."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deltaserve.entrypoints.llm import BUNDLED_MODEL

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "async_ab.py"


def test_the_ab_runs_on_the_cpu_and_both_ways_give_the_same_tokens(tmp_path):
    out = tmp_path / "ab.json"
    result = subprocess.run([sys.executable, str(SCRIPT), "--config", str(Path(BUNDLED_MODEL) / "config.json"),
                             "--device", "cpu", "--rounds", "2", "--prompt-len", "32", "--output-len", "9",
                             "--json-out", str(out)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert all(report["same_tokens"].values()), report["same_tokens"]
    assert [len(report["tpot_ms"][k]) for k in ("sync", "async")] == [2, 2]


@pytest.mark.parametrize("flag", ["--batch", "--rounds", "--output-len"])
def test_bad_counts_are_refused(flag):
    result = subprocess.run([sys.executable, str(SCRIPT), "--config", "unused.json", flag, "0"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and f"{flag} 0: must be a positive integer" in result.stderr
