"""capture: run a reference greedily over prompts and record the golden (see golden.py for the format)."""

from __future__ import annotations

from pathlib import Path

from deltaserve.parity.backends import open_backend
from deltaserve.parity.defaults import DEFAULT_TOPK
from deltaserve.parity.golden import Golden, GoldenPrompt
from deltaserve.parity.logits import topk_logprobs


def capture(model_dir: str, prompts: list[list[int]], max_tokens: int, reference: str, dtype: str,
            device: str | None, vocab_size: int, topk: int = DEFAULT_TOPK, seed: int | None = None) -> Golden:
    max_model_len = max(len(p) for p in prompts) + max_tokens
    backend = open_backend(reference, model_dir, dtype, device, max_model_len, len(prompts))
    return Golden(model=str(Path(model_dir).resolve()), reference=reference, dtype=dtype,
                  prompts=capture_prompts(backend, prompts, max_tokens, topk), vocab_size=vocab_size,
                  device=device or str(next(backend.model.parameters()).device), seed=seed,
                  topk=min(topk, vocab_size))


def capture_prompts(backend, prompts: list[list[int]], max_tokens: int, topk: int) -> list[GoldenPrompt]:
    """Greedy tokens and top-2 margins from the backend's own decode loop; the top-k log-probabilities from one
    teacher-forced pass over prompt + continuation (what `check` compares its teacher-forced logits to)."""
    records = []
    for prompt, greedy in zip(prompts, backend.greedy(prompts, max_tokens)):
        ids, logprobs = topk_logprobs(backend.teacher_forced(prompt, greedy.output_token_ids), topk)
        records.append(GoldenPrompt(prompt, greedy.output_token_ids, greedy.top2, ids, logprobs))
    return records
