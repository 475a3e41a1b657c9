"""benchmarks/stub_forward: with STUB_FORWARD=1 on its PYTHONPATH an engine's logits are zeros (greedy picks token 0
every step); without it the folder changes nothing."""

import os
import subprocess
import sys
from pathlib import Path

FOLDER = Path(__file__).resolve().parents[2] / "benchmarks" / "stub_forward"
CODE = ("from deltaserve import LLM, SamplingParams; "
        "out = LLM(threads=1).generate([{'prompt_token_ids': [5, 6, 7]}], "
        "SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False); "
        "print(out[0].outputs[0].token_ids)")


def _tokens(stub: str) -> str:
    env = {**os.environ, "STUB_FORWARD": stub,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(FOLDER), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]


def test_stub_forward_gives_zero_logits_only_when_asked():
    assert _tokens("1") == "[0, 0, 0, 0]"
    assert _tokens("0") != "[0, 0, 0, 0]"
