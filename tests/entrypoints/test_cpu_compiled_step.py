"""benchmarks/cpu_compiled_step.py's DecodeStep re-states the model's decode math (issue 3's probe): run eagerly, it
must give the engine's greedy tokens, so that the timings it reports stay timings of the same model as the engine
changes. (Its compiled variants take seconds to build and are for the benchmark only.)"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import cpu_compiled_step as probe  # noqa: E402


def test_the_eager_decode_step_gives_the_engine_tokens(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # the benchmark saves its model under ~/.cache: here, under tmp_path
    llm, model = probe.load_engine()  # the small preset (its routing: no expert groups, which the probe assumes)
    prompt = [5, 17, 3, 90, 41, 8, 77]
    expected, _ = probe.engine_generate(llm, prompt, 24)
    probe.STEP = probe.DecodeStep(model).eval()
    tokens, logits, _ = probe.probe_generate(probe.STEP, prompt, 24)
    assert tokens == expected
    assert torch.isfinite(logits).all()
