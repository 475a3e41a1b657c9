"""The sampler one row at a time, token by token where that is clearer: the spec and test oracle of sampling.py.

Same order of processing and the same random source as sampling.py (see its docstring); the arithmetic on
logits is float32, as there, so both pick the same tokens from the same generators."""

from __future__ import annotations

from collections import Counter

import torch

from deltaserve.kernels.sampling import MIN_TEMPERATURE, SampledLogprobs, SamplerOutput, row_seed
from deltaserve.sampling_params import SamplingParams

_NOISE_FLOOR = torch.finfo(torch.float32).tiny


def sample_naive(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    default_generator: torch.Generator,
) -> SamplerOutput:
    """logits [B, V] float32 -> token_ids [B] int64 and, when any row asked, the raw logprobs (as sample)."""
    noise = _row_noises(logits, params, output_token_ids, default_generator)
    token_ids = [
        _sample_row(logits[row], params[row], prompt_token_ids[row], output_token_ids[row], noise[row])
        for row in range(len(params))
    ]
    token_ids = torch.tensor(token_ids, dtype=torch.int64, device=logits.device)
    requested = [p.logprobs for p in params if p.logprobs is not None]
    if not requested:
        return SamplerOutput(token_ids, None)
    return SamplerOutput(token_ids, _logprobs(logits, token_ids, max(requested)))


def apply_penalties_naive(
    logits: torch.Tensor, params: SamplingParams, prompt_token_ids: list[int], output_token_ids: list[int]
) -> torch.Tensor:
    """Penalised copy of one row's logits [V]: repetition (HF), then frequency and presence (OpenAI)."""
    logits = logits.clone()
    repetition = _f32(params.repetition_penalty)
    for token in set(prompt_token_ids) | set(output_token_ids):
        logit = logits[token]
        logits[token] = logit / repetition if logit > 0 else logit * repetition
    frequency, presence = _f32(params.frequency_penalty), _f32(params.presence_penalty)
    for token, count in Counter(output_token_ids).items():
        logits[token] = logits[token] - frequency * count - presence
    return logits


def _sample_row(
    logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int], noise: torch.Tensor | None
) -> int:
    """One row's token: logits [V] float32, noise [V] Exponential(1) (None for a greedy row)."""
    logits = apply_penalties_naive(logits, params, prompt, output)
    if params.greedy:
        return int(logits.argmax())
    logits = logits / _f32(max(params.temperature, MIN_TEMPERATURE))  # a tiny one overflowed to +inf: NaN
    logits = _keep_only(logits, _top_k_tokens(logits, params.top_k))
    logits = _keep_only(logits, _top_p_tokens(logits, params.top_p))
    logits = _keep_only(logits, _min_p_tokens(logits, params.min_p))
    return int((logits.softmax(dim=-1) / noise).argmax())


def _top_k_tokens(logits: torch.Tensor, top_k: int) -> list[int]:
    """The k most likely tokens, ties to the lower id; all of them when top_k is 0."""
    ranked = _most_likely_first(logits)
    return ranked[:top_k] if top_k > 0 else ranked


def _top_p_tokens(logits: torch.Tensor, top_p: float) -> list[int]:
    """The smallest set of most likely tokens with probability >= top_p in total, at least one; all for 1."""
    if top_p == 1:
        return list(range(logits.shape[0]))
    probs = logits.softmax(dim=-1).tolist()
    kept, mass = [], 0.0
    for token in _most_likely_first(logits):
        if mass >= top_p:
            break
        kept.append(token)
        mass += probs[token]
    return kept


def _min_p_tokens(logits: torch.Tensor, min_p: float) -> list[int]:
    """The tokens whose probability is at least min_p times the largest."""
    probs = logits.softmax(dim=-1)
    threshold = (_f32(min_p) * probs.max()).item()
    return [token for token, prob in enumerate(probs.tolist()) if prob >= threshold]


def _most_likely_first(logits: torch.Tensor) -> list[int]:
    values = logits.tolist()
    return sorted(range(len(values)), key=lambda token: -values[token])  # stable: ties to the lower id


def _keep_only(logits: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    kept = torch.full_like(logits, float("-inf"))
    kept[tokens] = logits[tokens]
    return kept


def _row_noises(
    logits: torch.Tensor, params: list[SamplingParams], output_token_ids: list[list[int]], default_generator
) -> list[torch.Tensor | None]:
    """Per row, Exponential(1) noise [V]: a seeded row's from its own generator, an unseeded row's from one
    [B, V] draw of default_generator (made only when such a row samples); None for greedy rows."""
    unseeded = any(not p.greedy and p.seed is None for p in params)
    shared = torch.empty_like(logits).exponential_(generator=default_generator) if unseeded else None
    noises = []
    for row, p in enumerate(params):
        if p.greedy:
            noises.append(None)
        elif p.seed is None:
            noises.append(shared[row].clamp_min(_NOISE_FLOOR))
        else:
            noises.append(_seeded_noise(logits[row], row_seed(p.seed, len(output_token_ids[row]))))
    return noises


def _seeded_noise(logits: torch.Tensor, seed: int) -> torch.Tensor:
    """Exponential(1) noise like logits [V], from a fresh generator on their device seeded with seed."""
    generator = torch.Generator(device=logits.device).manual_seed(seed)
    return torch.empty_like(logits).exponential_(generator=generator).clamp_min(_NOISE_FLOOR)


def _logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> SampledLogprobs:
    """Per row of logits [B, V]: the top num_logprobs of log_softmax, and the chosen token's logprob and rank."""
    num_top = min(num_logprobs, logits.shape[-1])
    top_ids, top_values, sampled, ranks = [], [], [], []
    for row, token in enumerate(token_ids.tolist()):
        logprobs = logits[row].log_softmax(dim=-1)
        ranked = _most_likely_first(logprobs)[:num_top]
        top_ids.append(ranked)
        top_values.append(logprobs[ranked])
        sampled.append(logprobs[token])
        ranks.append(1 + sum(value > logprobs[token].item() for value in logprobs.tolist()))
    device = logits.device
    return SampledLogprobs(
        top_token_ids=torch.tensor(top_ids, dtype=torch.int64, device=device).reshape(len(top_ids), num_top),
        top_logprobs=torch.stack(top_values),
        sampled_logprobs=torch.stack(sampled),
        sampled_ranks=torch.tensor(ranks, dtype=torch.int64, device=device),
    )


def _f32(value: float) -> torch.Tensor:
    """A float32 scalar, so arithmetic with it rounds as the batched sampler's float32 columns do."""
    return torch.tensor(value, dtype=torch.float32)
