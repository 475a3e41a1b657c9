"""benchmarks/offline_throughput.py refuses a bad --repeats before it builds or loads any model."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "offline_throughput.py"


@pytest.mark.parametrize("repeats", ["0", "-2"])
def test_repeats_below_one_is_refused_with_its_value(repeats):
    result = subprocess.run([sys.executable, str(SCRIPT), "--repeats", repeats], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert f"--repeats must be at least 1, got {repeats}" in result.stderr
