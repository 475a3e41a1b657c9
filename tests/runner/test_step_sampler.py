"""The runner's step output on the host side: a step waits for its device work even when it sampled nothing, and a
step's logprobs reach the host with its tokens (queued copies, one wait), never by a blocking read after the next
step was queued. Found in review of the unified step; the device is mocked (the events and copies of a GPU)."""

from __future__ import annotations

import random

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


def _masked_twin(logits: torch.Tensor, states: list[RequestState], step: int) -> torch.Tensor:
    """The slow twin of StepSampler's min_tokens mask: row by row, -inf at the stop ids of a request whose token at
    lookahead step `step` is one of its first min_tokens outputs."""
    masked = logits.clone()
    for row, state in enumerate(states):
        if state.num_computed_tokens - state.num_prompt_tokens + step < state.sampling_params.min_tokens:
            for token in state.min_tokens_stop_ids:
                if token < logits.shape[1]:
                    masked[row, token] = float("-inf")
    return masked


@pytest.mark.parametrize("kind", [dict(temperature=0), dict(temperature=0, logprobs=3),
                                  dict(temperature=1.0, seed=7), dict(temperature=0.8, top_k=5)],
                         ids=["plain greedy", "greedy with logprobs", "seeded", "unseeded"])
@pytest.mark.parametrize("num_states", [1, 2, 7])
def test_min_tokens_mask_equals_a_row_by_row_twin(kind, num_states):
    """Rows with and without min_tokens, short of it by 0 to 4 outputs, over lookahead steps 0 to 3 and rows of a
    wider logits tensor (step 0 reads its sampling rows): the tokens (and logprobs) of the fast mask are those of
    an unmasked sampler over the twin's masked logits, and the logits read are left unchanged."""
    rng = random.Random(num_states)
    vocab = 37
    states, twins = [], []
    for i in range(num_states):
        prompt, outputs = rng.randint(1, 5), rng.randint(0, 4)
        min_tokens = rng.choice([0, outputs, outputs + 1, outputs + 3])
        ids = tuple(sorted(rng.sample(range(vocab), rng.randint(1, 4)))) + (vocab + 5,)  # one past the vocabulary
        params = SamplingParams(max_tokens=20, min_tokens=min_tokens, **kind)
        tokens = list(range(1, prompt + outputs + 1))
        states.append(RequestState(str(i), tokens, prompt, params, [0], i, prompt + outputs, ids if min_tokens else ()))
        twins.append(RequestState(str(i), list(tokens), prompt, params, [0], i, prompt + outputs))
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
        expected = twin.sample(lambda r: _masked_twin(read[rows] if step == 0 else read, states, step), step)
        assert torch.equal(got, expected), step
        assert torch.equal(logits, read), "the mask wrote into the logits it read"
        if step == 0 and sampler.result is not None and sampler.result.logprobs is not None:
            for name in ("top_logprobs", "sampled_logprobs"):
                assert torch.equal(getattr(sampler.result.logprobs, name), getattr(twin.result.logprobs, name))


def test_a_step_without_min_tokens_builds_no_mask(monkeypatch):
    """No request short of min_tokens (none asks, or every one has its outputs): no tensor is made for the mask."""
    def refuse(*args):
        raise AssertionError("a mask was built")

    monkeypatch.setattr(step_sampler, "to_device", refuse)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, min_tokens=2)]
    states = [RequestState(str(i), [1, 2, 3, 4], 2, p, [0], i, 4, (3,) if p.min_tokens else ())
              for i, p in enumerate(params)]
    sampler = StepSampler(states, [0, 1], 11, torch.Generator())
    logits = torch.randn(2, 11)
    assert torch.equal(sampler.sample(lambda rows: logits[rows], 0), logits.argmax(-1))
