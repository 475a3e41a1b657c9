"""lm-eval's `local-completions` model against the server, end to end and offline: the loglikelihood task in
lm_eval_task/ (a JSONL in this repository), run with the README's command. Every loglikelihood lm-eval reports
must equal the sum of the offline API's prompt logprobs over that continuation's tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.http_server import API_KEY

from deltaserve import SamplingParams

REPO = Path(__file__).resolve().parents[3]
TASK_DIR = Path(__file__).resolve().parent / "lm_eval_task"


@pytest.mark.slow
def test_lm_eval_loglikelihood_task_matches_offline_logprobs(server, tiny_model, offline_llm, tmp_path):
    model_args = (f"model=tiny,base_url={server.base_url}/v1/completions,tokenizer_backend=huggingface,"
                  f"tokenizer={tiny_model},num_concurrent=1,max_retries=1")
    env = {**os.environ, "OPENAI_API_KEY": API_KEY, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf")}
    run = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
         "--tasks", "deltaserve_tiny_choice", "--include_path", str(TASK_DIR.relative_to(REPO)),
         "--output_path", str(tmp_path / "out"), "--log_samples"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    samples = [json.loads(line) for path in (tmp_path / "out").rglob("samples_deltaserve_tiny_choice_*.jsonl")
               for line in path.read_text().splitlines()]
    assert len(samples) == len((TASK_DIR / "tiny_choice.jsonl").read_text().splitlines())
    tokenizer = offline_llm.tokenizer
    for sample in samples:
        for (context, continuation), (loglikelihood, _) in zip(
                [(a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()], sample["filtered_resps"]):
            ids = tokenizer.encode(context + continuation)
            num_context = len(tokenizer.encode(context))
            prompt_logprobs = offline_llm.generate([{"prompt_token_ids": ids}],
                                                   SamplingParams(max_tokens=1, prompt_logprobs=0),
                                                   use_tqdm=False)[0].prompt_logprobs
            expected = sum(prompt_logprobs[i][ids[i]].logprob for i in range(num_context, len(ids)))
            assert float(loglikelihood) == pytest.approx(expected, abs=1e-4)
