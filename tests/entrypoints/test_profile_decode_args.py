"""benchmarks/gpu/profile_decode.py, prefill_ab.py and benchmarks/host_prefill_inputs.py refuse bad counts right after
parsing, before they start any engine (so this runs without a GPU)."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "profile_decode.py"


@pytest.mark.parametrize("flag,value", [("--burst", "0"), ("--steps", "0"), ("--prefill-len", "-1")])
def test_bad_counts_are_refused_before_any_engine(flag, value):
    result = subprocess.run([sys.executable, str(SCRIPT), "--config", "unused.json", flag, value],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--burst and --steps must be at least 1, --prefill-len at least 0" in result.stderr
    assert f"{flag} {value}" in result.stderr  # the value given


@pytest.mark.parametrize("flag,value", [("--prompt-len", "0"), ("--reps", "0")])
def test_prefill_ab_refuses_bad_counts_before_any_engine(flag, value):
    script = SCRIPT.parent / "prefill_ab.py"
    result = subprocess.run([sys.executable, str(script), "--config", "unused.json", flag, value],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "must be at least 1" in result.stderr and value in result.stderr


def test_host_prefill_inputs_runs_and_refuses_a_short_step():
    script = SCRIPT.parents[1] / "host_prefill_inputs.py"
    ran = subprocess.run([sys.executable, str(script), "--tokens", "256", "--reps", "1"], capture_output=True,
                         text=True, timeout=120)
    assert ran.returncode == 0 and "snapshot split, 16 prompt(s) split" in ran.stdout, ran.stderr
    refused = subprocess.run([sys.executable, str(script), "--tokens", "100"], capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode == 2 and "--tokens must be at least 256" in refused.stderr and "100" in refused.stderr
