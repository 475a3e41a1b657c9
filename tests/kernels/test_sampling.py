"""The batched sampler against its per-row twin, and against the facts that define each sampling step."""

import math
import random

import pytest
import torch

from deltaserve.kernels.sampling import _top_k_top_p, apply_penalties, build_sampling_metadata, mix64, sample
from deltaserve.kernels.sampling_naive import apply_penalties_naive, sample_naive
from deltaserve.sampling_params import SamplingParams


def _sample(logits, params, prompts=None, outputs=None, seed=0):
    """Run the fast sampler with default_generator seeded by `seed`; no history unless given."""
    prompts = prompts or [[] for _ in params]
    outputs = outputs or [[] for _ in params]
    generator = torch.Generator().manual_seed(seed)
    meta = build_sampling_metadata(params, prompts, outputs, logits.shape[1], logits.device, generator)
    return sample(logits, meta)


def _random_params(rng: random.Random, vocab_size: int) -> SamplingParams:
    """Each knob on or off at random, so a batch mixes every combination."""

    def on() -> bool:
        return rng.random() < 0.5

    return SamplingParams(
        temperature=0.0 if rng.random() < 0.2 else rng.uniform(0.3, 2.0),
        top_k=rng.randint(1, vocab_size + 2) if on() else 0,
        top_p=rng.uniform(0.05, 1.0) if on() else 1.0,
        min_p=rng.uniform(0.0, 0.5) if on() else 0.0,
        presence_penalty=rng.uniform(-2, 2) if on() else 0.0,
        frequency_penalty=rng.uniform(-2, 2) if on() else 0.0,
        repetition_penalty=rng.uniform(0.5, 2.0) if on() else 1.0,
        seed=rng.randrange(-(2**40), 2**40) if on() else None,
        logprobs=rng.randint(0, 20) if rng.random() < 0.3 else None,
    )


def _random_tokens(rng: random.Random, vocab_size: int, max_len: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(rng.randint(0, max_len))]


@pytest.mark.parametrize("vocab_size", [7, 100, 1000])
@pytest.mark.parametrize("batch_size", [1, 3, 16])
@pytest.mark.parametrize("trial", range(4))
def test_fast_equals_naive(batch_size, vocab_size, trial):
    rng = random.Random(f"{batch_size}-{vocab_size}-{trial}")
    torch.manual_seed(rng.randrange(2**31))
    logits = torch.randn(batch_size, vocab_size) * 3
    original = logits.clone()
    params = [_random_params(rng, vocab_size) for _ in range(batch_size)]
    prompts = [_random_tokens(rng, vocab_size, 12) for _ in range(batch_size)]
    outputs = [_random_tokens(rng, vocab_size, 12) for _ in range(batch_size)]

    fast = _sample(logits, params, prompts, outputs, seed=trial)
    naive = sample_naive(logits, params, prompts, outputs, torch.Generator().manual_seed(trial))

    assert torch.equal(logits, original)
    assert torch.equal(fast.token_ids, naive.token_ids)
    assert (fast.logprobs is None) == (naive.logprobs is None)
    if fast.logprobs is not None:
        assert torch.equal(fast.logprobs.top_token_ids, naive.logprobs.top_token_ids)
        torch.testing.assert_close(fast.logprobs.top_logprobs, naive.logprobs.top_logprobs, rtol=0, atol=1e-6)
        torch.testing.assert_close(fast.logprobs.sampled_logprobs, naive.logprobs.sampled_logprobs, rtol=0, atol=1e-6)
        assert torch.equal(fast.logprobs.sampled_ranks, naive.logprobs.sampled_ranks)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.5, top_k=1),
        SamplingParams(temperature=1.5, top_p=1e-6),
        SamplingParams(temperature=1.5, min_p=1.0),
        SamplingParams(temperature=1.5, top_k=1, seed=7),
    ],
    ids=["greedy", "top_k=1", "tiny top_p", "min_p=1", "top_k=1 seeded"],
)
@pytest.mark.parametrize("batch_size", [1, 33])
def test_filters_that_leave_one_token_are_greedy(params, batch_size):
    logits = torch.randn(batch_size, 1000)
    assert torch.equal(_sample(logits, [params] * batch_size).token_ids, logits.argmax(dim=-1))


@pytest.mark.parametrize("temperature", [1e-40, 1e-45, 1e-30])
@pytest.mark.parametrize("seeded", [False, True])
def test_a_tiny_temperature_takes_the_argmax(temperature, seeded):
    # logits / 1e-40 overflowed to +inf for every positive logit: a softmax of nan, and token 0 every time
    logits = torch.tensor([[1.0, 30.0, 2.0, -1.0, 29.9, 0.5, -3.0, 0.1]]).expand(8, -1).contiguous()
    params = [SamplingParams(temperature=temperature, seed=row if seeded else None) for row in range(8)]
    assert _sample(logits, params).token_ids.tolist() == [1] * 8
    empty = [[] for _ in params]
    assert sample_naive(logits, params, empty, empty, torch.Generator().manual_seed(0)).token_ids.tolist() == [1] * 8


def test_penalties_match_a_hand_computation():
    logits = torch.tensor([2.0, -1.0, 0.5, -0.5, 1.0, 3.0, -2.0]).repeat(4, 1)
    prompt, output = [0, 1], [1, 2, 2, 4]  # seen: 0 1 2 4; output counts: 1 once, 2 twice, 4 once
    params = [
        SamplingParams(repetition_penalty=2.0),
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(),
    ]
    expected = torch.tensor(
        [
            [1.0, -2.0, 0.25, -0.5, 0.5, 3.0, -2.0],  # positive / 2, negative * 2, prompt tokens included
            [2.0, -1.75, -0.75, -0.5, 0.25, 3.0, -2.0],  # - 0.5 * count - 0.25, output tokens only
            [1.0, -2.75, -1.0, -0.5, -0.25, 3.0, -2.0],  # repetition first, then frequency and presence
            [2.0, -1.0, 0.5, -0.5, 1.0, 3.0, -2.0],
        ]
    )
    meta = build_sampling_metadata(params, [prompt] * 4, [output] * 4, 7, "cpu", torch.Generator())
    assert torch.equal(apply_penalties(logits, meta), expected)
    for row, p in enumerate(params):
        assert torch.equal(apply_penalties_naive(logits[row], p, prompt, output), expected[row])


def test_greedy_takes_the_argmax_after_penalties():
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]])
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=1)]
    out = _sample(logits, params, prompts=[[1]])
    assert out.token_ids.tolist() == [2]  # 3 / 2 = 1.5 < 2
    assert out.logprobs.sampled_ranks.tolist() == [2]  # ranked in the raw distribution
    assert out.logprobs.top_token_ids.tolist() == [[1]]


@pytest.mark.parametrize("num_outputs", [0, 1, 5, 40])
def test_seeded_row_is_independent_of_batch_and_position(num_outputs):
    request = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    row_logits = torch.randn(1000) * 0.1  # near uniform: a different draw would almost surely differ
    output = list(range(num_outputs))
    alone = _sample(row_logits[None], [request], outputs=[output], seed=1).token_ids[0]

    others = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.0), SamplingParams(seed=99)]
    for position in range(len(others) + 1):
        params = others[:position] + [request] + others[position:]
        logits = torch.randn(len(params), 1000)
        logits[position] = row_logits
        outputs = [[3, 4]] * len(params)
        outputs[position] = output
        batched = _sample(logits, params, outputs=outputs, seed=position + 2).token_ids[position]
        assert batched == alone


def test_seeded_row_draws_fresh_noise_each_step():
    request = SamplingParams(temperature=1.0, seed=5)
    logits = torch.zeros(1, 1000)
    tokens = {_sample(logits, [request], outputs=[[0] * step]).token_ids.item() for step in range(10)}
    assert len(tokens) > 5


@pytest.mark.parametrize("high", [2**32, 2**40, 2**63])
def test_seeds_differing_only_in_high_bits_draw_differently(high):
    # torch's CPU generator keeps a seed's low 32 bits: row_seed mixes all 64 into them
    logits = torch.zeros(1, 1000)
    draws = [
        [_sample(logits, [SamplingParams(temperature=1.0, seed=seed)], outputs=[[0] * step]).token_ids.item()
         for step in range(4)]
        for seed in (7, 7 + high)
    ]
    assert draws[0] != draws[1]


def test_mix64_is_a_bijection_that_spreads_every_bit():
    assert len({mix64(x) for x in range(1 << 16)}) == 1 << 16
    assert all(0 <= mix64(x) < 2**64 for x in (0, -1, 2**64, 2**70 + 5))
    assert mix64(-1) == mix64(2**64 - 1)
    low = {mix64(k << 32) % 2**32 for k in range(1, 1 << 12)}  # differ only above bit 31
    assert len(low) > 4000


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of the draws `tokens` [N] against probs [V]; tokens of probability 0 give inf."""
    observed = torch.bincount(tokens, minlength=probs.shape[0]).double()
    expected = probs.double() * tokens.shape[0]
    if (observed[expected == 0] > 0).any():
        return math.inf
    kept = expected > 0
    return float(((observed[kept] - expected[kept]) ** 2 / expected[kept]).sum())


_CHI2_999 = {9: 27.9, 2: 13.8}  # 99.9% quantiles of chi-square for these degrees of freedom


@pytest.mark.parametrize("seeded", [False, True])
def test_draws_follow_softmax(seeded):
    logits = torch.randn(10, generator=torch.Generator().manual_seed(0))
    num_draws = 10000
    params = [SamplingParams(seed=row if seeded else None) for row in range(num_draws)]
    tokens = _sample(logits.expand(num_draws, -1).contiguous(), params, seed=3).token_ids
    assert _chi_square(tokens, logits.softmax(-1)) < _CHI2_999[9]


def test_draws_follow_the_filtered_distribution():
    logits = torch.randn(10, generator=torch.Generator().manual_seed(1))
    num_draws = 20000
    params = [SamplingParams(temperature=0.5, top_k=3)] * num_draws
    tokens = _sample(logits.expand(num_draws, -1).contiguous(), params, seed=4).token_ids
    top3 = logits.topk(3).indices
    expected = torch.zeros(10)
    expected[top3] = (logits[top3] / 0.5).softmax(-1)
    assert _chi_square(tokens, expected) < _CHI2_999[2]


_PROBS = [0.4, 0.3, 0.15, 0.1, 0.05]


@pytest.mark.parametrize(
    "params, kept",
    [
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_p=0.35), {0}),
        (SamplingParams(top_p=0.6), {0, 1}),
        (SamplingParams(top_p=0.72), {0, 1, 2}),
        (SamplingParams(top_k=4, top_p=0.72), {0, 1}),  # top-p sees the top-k distribution renormalised
        (SamplingParams(min_p=0.5), {0, 1}),
        (SamplingParams(min_p=0.3), {0, 1, 2}),
        (SamplingParams(temperature=0.5, min_p=0.3), {0, 1}),  # (0.15 / 0.4)**2 < 0.3
    ],
)
@pytest.mark.parametrize("sampler", ["fast", "naive"])
def test_filters_keep_exactly_the_defined_set(params, kept, sampler):
    num_draws = 400
    logits = torch.tensor(_PROBS).log().expand(num_draws, -1).contiguous()
    batch = [params] * num_draws
    if sampler == "fast":
        tokens = _sample(logits, batch, seed=5).token_ids
    else:
        empty = [[] for _ in batch]
        tokens = sample_naive(logits, batch, empty, empty, torch.Generator().manual_seed(5)).token_ids
    assert set(tokens.tolist()) == kept


def test_top_p_one_keeps_a_tail_that_a_float32_running_sum_rounds_away():
    logits = torch.tensor([[0.0, 0.0, -40.0]] * 2)  # the mass before the tail token rounds to 1.0
    filtered = _top_k_top_p(logits, torch.tensor([0, 0]), torch.tensor([1.0, 0.999]))
    assert torch.isfinite(filtered[0]).all()
    assert filtered[1].isinf().tolist() == [False, False, True]


def test_logprobs_are_the_raw_log_softmax_with_ranks():
    torch.manual_seed(0)
    logits = torch.randn(6, 100)
    params = [
        SamplingParams(logprobs=None, temperature=0.0),
        SamplingParams(logprobs=0, temperature=1.0, repetition_penalty=1.8),
        SamplingParams(logprobs=3, temperature=2.0, top_k=50),
        SamplingParams(logprobs=5, temperature=0.0, presence_penalty=2.0),
        SamplingParams(logprobs=None, temperature=0.8, seed=3),
        SamplingParams(logprobs=1, temperature=1.2, frequency_penalty=-1.0),
    ]
    outputs = [[int(logits[row].argmax()), 7, 7] for row in range(6)]
    out = _sample(logits, params, prompts=[[1, 2]] * 6, outputs=outputs)

    expected = logits.log_softmax(dim=-1)
    top = expected.topk(5, dim=-1)
    sampled = expected.gather(-1, out.token_ids[:, None])[:, 0]
    assert torch.equal(out.logprobs.top_token_ids, top.indices)
    torch.testing.assert_close(out.logprobs.top_logprobs, top.values, rtol=0, atol=0)
    torch.testing.assert_close(out.logprobs.sampled_logprobs, sampled, rtol=0, atol=0)
    assert torch.equal(out.logprobs.sampled_ranks, (expected > sampled[:, None]).sum(-1) + 1)
    assert out.logprobs.sampled_ranks[0] == 1


def test_no_logprobs_unless_asked():
    logits = torch.randn(3, 50)
    assert _sample(logits, [SamplingParams()] * 3).logprobs is None
    assert _sample(logits, [SamplingParams(), SamplingParams(logprobs=0), SamplingParams()]).logprobs is not None


def test_logprobs_wider_than_the_vocabulary_give_all_tokens():
    logits = torch.randn(2, 7)
    out = _sample(logits, [SamplingParams(logprobs=20)] * 2)
    assert out.logprobs.top_token_ids.shape == (2, 7)


def test_common_case_skips_the_optional_work():
    meta = build_sampling_metadata([SamplingParams(temperature=0.0)] * 2, [[1], [2]], [[], [3]], 10, "cpu", None)
    assert meta.all_greedy and meta.no_penalties
    assert meta.output_token_counts is None and meta.seen_token_mask is None
    assert meta.default_generator is None and meta.generators == {}
    assert meta.max_num_logprobs is None


def test_mismatched_inputs_are_rejected():
    with pytest.raises(ValueError, match="one of each per row"):
        build_sampling_metadata([SamplingParams()], [[1], [2]], [[]], 10, "cpu", torch.Generator())
    meta = build_sampling_metadata([SamplingParams()], [[1]], [[]], 10, "cpu", torch.Generator())
    with pytest.raises(ValueError, match="float32"):
        sample(torch.randn(1, 10, dtype=torch.float64), meta)
