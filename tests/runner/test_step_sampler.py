"""The runner's step output on the host side: a step waits for its device work even when it sampled nothing, and a
step's logprobs reach the host with its tokens (queued copies, one wait), never by a blocking read after the next
step was queued. Found in review of the unified step; the device is mocked (the events and copies of a GPU)."""

from __future__ import annotations

import torch

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
