"""Batched sampler: one token per row of logits [B, V], with no host sync; `sampling_naive.py` is its spec.

Order of processing, per row:
1. logprobs (when any row asks) of the raw model distribution: log_softmax of the logits as given, before
   penalties and temperature (vLLM's default);
2. penalties: repetition first (HF: over prompt + output tokens, a positive logit is divided by the penalty,
   a negative one multiplied), then frequency and presence (OpenAI: over output tokens only,
   logit - frequency * count - presence * (count > 0));
3. greedy rows (temperature 0) take the argmax, ties to the lowest token id; the other rows go on:
4. divide by the temperature, at least MIN_TEMPERATURE (a tiny one overflowed every positive logit to +inf: a
   softmax of NaN, token 0 drawn every time; at MIN_TEMPERATURE the draw is already the argmax's);
5. top-k: keep the k largest logits, ties to the lowest token id (0 = off);
6. top-p: on the top-k distribution renormalised, keep the smallest set of most likely tokens whose
   probability sums to >= top_p; always at least one token (1 = off);
7. min-p: drop tokens whose probability is < min_p * the largest probability (0 = off);
8. sample by the exponential race: argmax(probs / q), q ~ Exponential(1) i.i.d., an exact draw from probs.

Randomness: a row with a seed draws its q [V] from its own generator, seeded with
row_seed(seed, num_output_tokens), so its token depends only on its logits, its seed and how many tokens it
has generated (the same on one device whatever the batch, the row index, or a preemption and recompute).
The rows without a seed take their row of one [B, V] draw from default_generator."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deltaserve.kernels.varlen import to_device
from deltaserve.sampling_params import SamplingParams

_SEED_STRIDE = 1_000_003  # a prime: (seed, step) pairs map to distinct 64-bit seeds for runs under a million tokens
# the smallest temperature divided by: logits of magnitude up to 3e8 stay finite (float32's max is 3.4e38), and any
# logit gap over 1e-28 is a factor past e^100 (the draw is the argmax's, as temperature -> 0)
MIN_TEMPERATURE = 1e-30
_NOISE_FLOOR = torch.finfo(torch.float32).tiny  # Exponential(1) may round to 0: keep p / q finite, never nan


@dataclass
class SamplingMetadata:
    """One step's sampling inputs for B rows, on the logits' device; made by build_sampling_metadata."""

    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32, 1 = off
    min_p: torch.Tensor  # [B] float32, 0 = off
    presence_penalty: torch.Tensor  # [B] float32, 0 = off
    frequency_penalty: torch.Tensor  # [B] float32, 0 = off
    repetition_penalty: torch.Tensor  # [B] float32, 1 = off
    output_token_counts: torch.Tensor | None  # [B, V] float32 occurrences in the output; None: no presence/frequency
    seen_token_mask: torch.Tensor | None  # [B, V] bool, in prompt or output; None: no repetition penalty
    generators: dict[int, torch.Generator]  # row -> its own generator, for the seeded rows that sample
    default_generator: torch.Generator | None  # for the sampling rows without a seed; None when there are none
    all_greedy: bool
    no_penalties: bool
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool
    max_num_logprobs: int | None  # the largest n asked for; None when no row asked


@dataclass
class SampledLogprobs:
    """Log-probabilities of the raw model distribution for every row; the runner keeps the rows that asked."""

    top_token_ids: torch.Tensor  # [B, n] int64, most likely first
    top_logprobs: torch.Tensor  # [B, n] float32
    sampled_logprobs: torch.Tensor  # [B] float32, of the token chosen
    sampled_ranks: torch.Tensor  # [B] int64, 1 = most likely


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: SampledLogprobs | None  # None when no row asked for logprobs


def row_seed(seed: int, num_output_tokens: int) -> int:
    """The generator seed, in [0, 2**64), of a seeded request's token number num_output_tokens (0-based)."""
    return mix64(seed * _SEED_STRIDE + num_output_tokens)


def mix64(seed: int) -> int:
    """seed mod 2**64 through splitmix64's finaliser: a bijection of 64-bit words whose every output bit depends on
    every input bit. Generators are seeded through it because torch's CPU generator (mt19937) keeps only a seed's low
    32 bits: unmixed, seeds that differ by a multiple of 2**32 (0 and 2**32) would draw the same numbers there."""
    z = seed % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return z ^ (z >> 31)


def plain_greedy(params: list[SamplingParams]) -> bool:
    """Whether every row is greedy with no penalties and no logprobs: then sample() is logits.argmax(-1)."""
    return all(p.greedy and p.logprobs is None and not p.penalized for p in params)


def build_sampling_metadata(
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    vocab_size: int,
    device: torch.device | str,
    default_generator: torch.Generator,
    num_output_tokens: list[int] | None = None,
) -> SamplingMetadata:
    """Gather B requests' sampling parameters into device tensors, once per step.

    prompt_token_ids, output_token_ids: per row, the prompt and the tokens generated so far.
    default_generator: on `device`, the random source of the rows that sample without a seed.
    num_output_tokens: per row, the outputs before the token sampled now, for seeded rows' generators (default: the
    lengths of output_token_ids; more when some are still being computed)."""
    _check_rows(params, prompt_token_ids, output_token_ids)
    sampling = [p for p in params if not p.greedy]
    needs_counts = any(p.presence_penalty != 0 or p.frequency_penalty != 0 for p in params)
    needs_seen = any(p.repetition_penalty != 1 for p in params)

    def column(name: str, dtype: torch.dtype) -> torch.Tensor:
        return to_device([getattr(p, name) for p in params], dtype, device)  # no wait: the step before may be in flight

    return SamplingMetadata(
        temperature=column("temperature", torch.float32),
        top_k=column("top_k", torch.int64),
        top_p=column("top_p", torch.float32),
        min_p=column("min_p", torch.float32),
        presence_penalty=column("presence_penalty", torch.float32),
        frequency_penalty=column("frequency_penalty", torch.float32),
        repetition_penalty=column("repetition_penalty", torch.float32),
        output_token_counts=_token_counts(output_token_ids, vocab_size, device) if needs_counts else None,
        seen_token_mask=_token_counts([prompt + output for prompt, output in zip(prompt_token_ids, output_token_ids)],
                                      vocab_size, device) > 0 if needs_seen else None,
        generators=row_generators(params, num_output_tokens or [len(output) for output in output_token_ids], device),
        default_generator=default_generator if any(p.seed is None for p in sampling) else None,
        all_greedy=not sampling,
        no_penalties=not (needs_counts or needs_seen),
        no_top_k=all(p.top_k == 0 or p.top_k >= vocab_size for p in sampling),
        no_top_p=all(p.top_p == 1 for p in sampling),
        no_min_p=all(p.min_p == 0 for p in sampling),
        max_num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=None),
    )


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
    """Pick one token per row, in the order of the module docstring.

    logits: [B, V] float32, left unchanged. Returns token_ids [B] int64 and, when any row asked, the raw
    logprobs: top n [B, n] (n = meta.max_num_logprobs, at most V) and the chosen token's logprob and rank [B]."""
    _check_logits(logits, meta)
    penalised = logits if meta.no_penalties else apply_penalties(logits, meta)
    token_ids = penalised.argmax(dim=-1)
    if not meta.all_greedy:
        token_ids = torch.where(meta.temperature == 0, token_ids, _random_sample(penalised, meta))
    if meta.max_num_logprobs is None:
        return SamplerOutput(token_ids, None)
    return SamplerOutput(token_ids, _logprobs(logits, token_ids, meta.max_num_logprobs))


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Penalised copy of logits [B, V] float32: repetition (HF), then frequency and presence (OpenAI)."""
    if meta.seen_token_mask is not None:
        penalty = meta.repetition_penalty[:, None]
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(meta.seen_token_mask, penalised, logits)
    if meta.output_token_counts is not None:
        counts = meta.output_token_counts
        logits = logits - meta.frequency_penalty[:, None] * counts
        logits = torch.where(counts > 0, logits - meta.presence_penalty[:, None], logits)
    return logits


def _random_sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Steps 4-8 for every row (greedy rows get temperature 1 and are overridden): logits [B, V] -> [B]."""
    temperature = meta.temperature.masked_fill(meta.temperature == 0, 1.0).clamp_min(MIN_TEMPERATURE)
    logits = logits / temperature[:, None]
    if not (meta.no_top_k and meta.no_top_p):
        logits = _top_k_top_p(logits, meta.top_k, meta.top_p)
    if not meta.no_min_p:
        logits = _min_p(logits, meta.min_p)
    probs = logits.softmax(dim=-1)
    return (probs / _exponential_noise(probs, meta)).argmax(dim=-1)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf what top-k, then top-p, drop. logits: [B, V]; top_k [B] int64 (0 = off); top_p [B]."""
    vocab_size = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab_size, device=logits.device)
    k = torch.where(top_k > 0, top_k, vocab_size)
    sorted_logits = sorted_logits.masked_fill(rank >= k[:, None], float("-inf"))
    cum_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    mass_before = F.pad(cum_probs[:, :-1], (1, 0))  # [B, V] probability of the more likely tokens
    # top_p == 1 must keep all: a float32 running sum may reach 1 before the tail.
    outside = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf the tokens with prob < min_p * max prob. logits: [B, V]; min_p: [B]."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _exponential_noise(probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Exponential(1) noise like probs [B, V]: seeded rows from their own generator, others from the default."""
    if meta.default_generator is None:
        noise = torch.ones_like(probs)
    else:
        noise = torch.empty_like(probs).exponential_(generator=meta.default_generator)
    for row, generator in meta.generators.items():
        noise[row].exponential_(generator=generator)
    return noise.clamp_min_(_NOISE_FLOOR)


def _logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> SampledLogprobs:
    """Raw log_softmax of logits [B, V]: top num_logprobs per row, and the logprob and rank of token_ids [B]."""
    logprobs = logits.log_softmax(dim=-1)
    top_logprobs, top_token_ids = logprobs.topk(min(num_logprobs, logits.shape[-1]), dim=-1)
    sampled = logprobs.gather(-1, token_ids[:, None])  # [B, 1]
    ranks = (logprobs > sampled).sum(dim=-1) + 1
    return SampledLogprobs(top_token_ids, top_logprobs, sampled[:, 0], ranks)


def _token_counts(token_ids: list[list[int]], vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """Occurrences of each token id per row: B ragged lists -> [B, V] float32 on device."""
    width = max(map(len, token_ids), default=0)
    padded = [ids + [vocab_size] * (width - len(ids)) for ids in token_ids]  # pad with an extra column, dropped
    index = to_device(padded, torch.int64, device).reshape(len(token_ids), width)  # no wait for a step in flight
    counts = torch.zeros(len(token_ids), vocab_size + 1, device=device)
    counts.scatter_add_(1, index, torch.ones(index.shape, device=device))
    return counts[:, :vocab_size]


def row_generators(
    params: list[SamplingParams], num_output_tokens: list[int], device: torch.device | str
) -> dict[int, torch.Generator]:
    """row -> a generator seeded with row_seed(seed, number of outputs so far), for seeded rows that sample (a
    step with lookahead makes a new set for each of its steps)."""
    return {
        row: torch.Generator(device=device).manual_seed(row_seed(p.seed, n))
        for row, (p, n) in enumerate(zip(params, num_output_tokens))
        if p.seed is not None and not p.greedy
    }


def _check_rows(params: list, prompt_token_ids: list, output_token_ids: list) -> None:
    if not len(params) == len(prompt_token_ids) == len(output_token_ids):
        raise ValueError(
            f"build_sampling_metadata: {len(params)} params, {len(prompt_token_ids)} prompts and "
            f"{len(output_token_ids)} outputs; pass one of each per row"
        )


def _check_logits(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    rows = meta.temperature.shape[0]
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.shape[0] != rows:
        raise ValueError(
            f"sample: logits are {logits.dtype} {tuple(logits.shape)}, expected float32 [{rows}, V] "
            "(one row per request of the metadata); cast with .float()"
        )
