"""The runner's step output on the host side: a step waits for its device work even when it sampled nothing, and a
step's logprobs reach the host with its tokens (queued copies, one wait), never by a blocking read after the next
step was queued. Found in review of the unified step; the device is mocked (the events and copies of a GPU)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from deltaserve.runner import step_sampler
from deltaserve.runner.step_sampler import PendingOutput, RequestState, StepSampler
from deltaserve.runner_output import RunnerOutput
from deltaserve.sampling_params import SamplingParams


class FakeEvent:
    def __init__(self):
        self.waits = 0

    def synchronize(self):
        self.waits += 1


def test_a_step_that_sampled_nothing_still_waits_for_its_event_once():
    event = FakeEvent()
    pending = PendingOutput(RunnerOutput(["a"], {"a": []}), copied=event)
    assert pending.result().sampled_token_ids == {"a": []} and event.waits == 1
    pending.result()
    assert event.waits == 1


def test_logprobs_are_queued_to_the_host_with_the_tokens_and_read_from_the_copies():
    vocab = 11
    states = [RequestState(str(i), [1, 2, 3], 3, SamplingParams(temperature=0, logprobs=2, max_tokens=4), [0], i, 3)
              for i in range(2)]
    sampler = StepSampler(states, [0, 1], vocab, torch.Generator())
    logits = torch.randn(2, vocab)
    tokens = sampler.sample(lambda rows: logits[rows], 0)
    copies, event = [], FakeEvent()

    def to_host(x):  # as the runner's on a GPU: a copy queued now, the event of the last one
        copies.append(x.clone())
        return copies[-1], event

    pending = sampler.pending([tokens], RunnerOutput(["0", "1"], {"0": [], "1": []}), to_host)
    assert len(copies) == 5 and torch.equal(copies[-1], tokens)  # the four logprob tensors, then the tokens
    sampler.result.logprobs.top_logprobs.fill_(float("nan"))  # the device's tensors are not read in result()
    out = pending.result()
    assert event.waits == 1
    for row, req_id in enumerate("01"):
        entry = out.logprobs[req_id][0]
        assert entry.token_ids[0] == int(logits[row].argmax()) and entry.ranks[0] == 1
        assert entry.logprobs[1] == entry.logprobs[0] == float(logits[row].log_softmax(-1).max())


def _adjusted_twin(logits: torch.Tensor, states: list[RequestState], step: int) -> torch.Tensor:
    """The slow twin of StepSampler._adjust, row by row and id by id: every id outside allowed_token_ids -inf, then
    logit_bias added (clamped to [-100, 100]), then -inf at the stop ids of a request whose token at lookahead step
    `step` is one of its first min_tokens outputs."""
    adjusted = logits.clone()
    for row, state in enumerate(states):
        params = state.sampling_params
        if params.allowed_token_ids is not None:
            for token in range(logits.shape[1]):
                if token not in params.allowed_token_ids:
                    adjusted[row, token] = float("-inf")
        for token, bias in (params.logit_bias or {}).items():
            adjusted[row, token] += min(max(bias, -100.0), 100.0)
        if state.num_computed_tokens - state.num_prompt_tokens + step < params.min_tokens:
            for token in state.min_tokens_stop_ids:
                if token < logits.shape[1]:
                    adjusted[row, token] = float("-inf")
    return adjusted


def _random_adjustments(rng: random.Random, vocab: int, stop_ids: tuple[int, ...]) -> dict:
    """SamplingParams fields of one row: allowed_token_ids, logit_bias (some past +-100), both or neither; an
    allowed list always holds a non-stop id (the engine refuses one that min_tokens would mask whole)."""
    fields = {}
    if rng.random() < 0.5:
        free = [t for t in range(vocab) if t not in stop_ids]
        fields["allowed_token_ids"] = [rng.choice(free)] + rng.sample(range(vocab), rng.randint(0, 5))
    if rng.random() < 0.5:
        fields["logit_bias"] = {t: rng.choice([-150, -100, -3.5, 0.25, 4, 100, 250])
                                for t in rng.sample(range(vocab), rng.randint(1, 6))}
    return fields


@pytest.mark.parametrize("kind", [dict(temperature=0), dict(temperature=0, logprobs=3),
                                  dict(temperature=1.0, seed=7), dict(temperature=0.8, top_k=5)],
                         ids=["plain greedy", "greedy with logprobs", "seeded", "unseeded"])
@pytest.mark.parametrize("num_states", [1, 2, 7])
@pytest.mark.parametrize("adjust", ["min_tokens", "all"])
def test_adjusted_logits_equal_a_row_by_row_twin(kind, num_states, adjust):
    """Rows with and without min_tokens (short of it by 0 to 4 outputs), allowed_token_ids and logit_bias, over
    lookahead steps 0 to 3 and rows of a wider logits tensor (step 0 reads its sampling rows): the tokens (and
    logprobs) of the fast adjustment are those of an unadjusted sampler over the twin's adjusted logits, and the
    logits read are left unchanged."""
    rng = random.Random(num_states + 10 * (adjust == "all"))
    vocab = 37
    states, twins = [], []
    for i in range(num_states):
        prompt, outputs = rng.randint(1, 5), rng.randint(0, 4)
        min_tokens = rng.choice([0, outputs, outputs + 1, outputs + 3])
        ids = tuple(sorted(rng.sample(range(vocab), rng.randint(1, 4)))) + (vocab + 5,)  # one past the vocabulary
        extra = _random_adjustments(rng, vocab, ids) if adjust == "all" else {}
        params = SamplingParams(max_tokens=20, min_tokens=min_tokens, **kind, **extra)
        tokens = list(range(1, prompt + outputs + 1))
        states.append(RequestState(str(i), tokens, prompt, params, [0], i, prompt + outputs, ids if min_tokens else ()))
        plain = replace(params, logit_bias=None, allowed_token_ids=None)
        twins.append(RequestState(str(i), list(tokens), prompt, plain, [0], i, prompt + outputs))
    rows = sorted(rng.sample(range(3 * num_states), num_states))
    sampler = StepSampler(states, rows, vocab, torch.Generator().manual_seed(1))
    twin = StepSampler(twins, list(range(num_states)), vocab, torch.Generator().manual_seed(1))
    for step in range(4):
        logits = torch.randn(3 * num_states if step == 0 else num_states, vocab)
        for row, state in enumerate(states):  # make the mask matter: a stop id is the row's best token
            if state.min_tokens_stop_ids:
                logits[rows[row] if step == 0 else row, rng.choice(state.min_tokens_stop_ids[:-1])] += 10
        read = logits.clone()
        got = sampler.sample(lambda r: logits if len(r) == len(logits) else logits[r], step)  # as the runner's _rows
        expected = twin.sample(lambda r: _adjusted_twin(read[rows] if step == 0 else read, states, step), step)
        assert torch.equal(got, expected), step
        assert torch.equal(logits, read), "the adjustment wrote into the logits it read"
        view = read[rows] if step == 0 else read
        assert torch.equal(sampler._adjust(view, step), _adjusted_twin(view, states, step)), step
        for state, token in zip(states, got.tolist()):
            assert token in (state.sampling_params.allowed_token_ids or [token])
        if step == 0 and sampler.result is not None and sampler.result.logprobs is not None:
            for name in ("top_logprobs", "sampled_logprobs"):
                assert torch.equal(getattr(sampler.result.logprobs, name), getattr(twin.result.logprobs, name))


def test_a_step_without_adjustments_builds_no_tensor(monkeypatch):
    """No request short of min_tokens (none asks, or every one has its outputs), with allowed_token_ids or with a
    logit_bias entry: no tensor is made to adjust the logits."""
    def refuse(*args):
        raise AssertionError("a mask was built")

    monkeypatch.setattr(step_sampler, "to_device", refuse)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, min_tokens=2),
              SamplingParams(temperature=0, logit_bias={})]
    states = [RequestState(str(i), [1, 2, 3, 4], 2, p, [0], i, 4, (3,) if p.min_tokens else ())
              for i, p in enumerate(params)]
    sampler = StepSampler(states, [0, 1, 2], 11, torch.Generator())
    logits = torch.randn(3, 11)
    assert torch.equal(sampler.sample(lambda rows: logits[rows], 0), logits.argmax(-1))
