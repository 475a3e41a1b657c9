"""benchmarks/host_step.py on the CPU: a short run at a prompt longer than one prefill chunk times its steps; bad
counts are refused."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "host_step.py"


def test_host_step_times_decode_steps_after_a_long_prompt():
    result = subprocess.run([sys.executable, str(SCRIPT), "--batch", "2", "--steps", "3", "--num-decode-steps", "2",
                             "--prompt-len", "9000"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "batch 2, 2 decode steps a step" in result.stdout and "ms a step" in result.stdout


def test_host_step_refuses_an_empty_prompt():
    result = subprocess.run([sys.executable, str(SCRIPT), "--prompt-len", "0"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and "--prompt-len" in result.stderr
