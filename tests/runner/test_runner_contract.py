"""The runner refuses a SchedulerOutput that breaks the step's contract, with a message naming what is wrong:
uneven lookahead, lookahead on a prompt chunk, a snapshot save no step reaches or a second one inside a chunk, a
decode whose input token no step before sampled, more than one input token missing. (The scheduler never sends
these; a bug that did would otherwise compute from wrong inputs.)"""

from __future__ import annotations

import pytest

from deltaserve import SamplingParams
from deltaserve.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def new(req_id: str, num_tokens: int, slot: int, pages: list[int]) -> NewRequestData:
    return NewRequestData(req_id, list(range(5, 5 + num_tokens)), num_tokens, GREEDY, pages, slot)


@pytest.mark.parametrize("case, message", [
    ("uneven lookahead", r"lookahead needs every request of the step to decode one token with the same lookahead"),
    ("lookahead on a prompt", r"lookahead needs every request of the step to decode one token"),
    ("save out of reach", r"snapshot save \(0, 0, 9\) names a state slot or position no step of this one reaches"),
    ("two saves inside a chunk", r"snapshot save \(2, 1, 5\) names .* at most one save inside a chunk"),
    ("input never sampled", r"requests \['a'\] decode a token that the step before \(of \['b'\]\) did not sample"),
    ("two inputs missing", r"request 'a' computes tokens 4\.\.5 but the runner has 4"),
])
def test_a_step_that_breaks_the_contract_is_refused(make_llm, case, message):
    runner = make_llm(enable_prefix_caching=True).engine.runner
    prompts = SchedulerOutput(new_reqs=[new("a", 4, 0, [0]), new("b", 4, 1, [1])],
                              num_scheduled_tokens={"a": 4, "b": 4})
    runner.execute(prompts)  # both prompts computed, one token sampled each: 5 tokens, 4 computed
    if case == "uneven lookahead":
        sched = SchedulerOutput(cached_reqs=[CachedRequestData("a", [], 4), CachedRequestData("b", [], 4)],
                                num_scheduled_tokens={"a": 1, "b": 1}, num_lookahead_tokens={"a": 2, "b": 1})
    elif case == "lookahead on a prompt":
        sched = SchedulerOutput(new_reqs=[new("c", 3, 2, [2])], num_scheduled_tokens={"c": 3},
                                num_lookahead_tokens={"c": 2})
    elif case == "save out of reach":
        sched = SchedulerOutput(cached_reqs=[CachedRequestData("a", [], 4)], num_scheduled_tokens={"a": 1},
                                snapshot_saves=[(0, 0, 9)])
    elif case == "two saves inside a chunk":
        sched = SchedulerOutput(new_reqs=[new("c", 9, 2, [2, 3])], num_scheduled_tokens={"c": 9},
                                snapshot_saves=[(2, 0, 3), (2, 1, 5)])
    elif case == "input never sampled":
        runner.execute(SchedulerOutput(cached_reqs=[CachedRequestData("b", [], 4)], num_scheduled_tokens={"b": 1}))
        sched = SchedulerOutput(cached_reqs=[CachedRequestData("a", [], 5)], num_scheduled_tokens={"a": 1})
    else:
        sched = SchedulerOutput(cached_reqs=[CachedRequestData("a", [3], 4)], num_scheduled_tokens={"a": 2})
        runner.requests["a"].token_ids.pop()  # its sampled token not on the host: two inputs short
    with pytest.raises(ValueError, match=message):
        runner.submit(sched)
