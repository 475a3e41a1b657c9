"""Structured outputs through the LLM API on the demo model (decode bursts on, so that the constrained requests'
single steps are exercised beside free requests that would burst alone)."""

import itertools
import json
import random
import re
import sys
import threading
import time

import pytest
from structured.schemas import random_schema

from deltaserve import LLM
from deltaserve.sampling_params import ParamError, SamplingParams, StructuredOutputsParams

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar", reason="the structured extra is part of the test extra")
NUM_SCHEMAS = 100


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", num_decode_steps=4)


def constrained(max_tokens=48, temperature=1.0, seed=0, **spec) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                          structured_outputs=StructuredOutputsParams(**spec))


def test_generated_schemas_give_valid_json(llm):
    schemas = [random_schema(random.Random(i)) for i in range(NUM_SCHEMAS)]
    params = [constrained(max_tokens=160, seed=i, json=schema) for i, schema in enumerate(schemas)]
    outputs = llm.generate(["Answer in JSON:"] * NUM_SCHEMAS, params, use_tqdm=False)
    for schema, output in zip(schemas, outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (schema, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)  # json.loads refuses raw control characters


@pytest.mark.parametrize("pattern", [r"[a-z]{3}-\d{2,4}", r"(yes|no), because [a-z ]{1,12}\.", r"\d+(\.\d{1,2})?"])
def test_regex_outputs_match_in_full(llm, pattern):
    params = [constrained(seed=seed, regex=pattern) for seed in range(4)]
    for output in llm.generate(["Go:"] * 4, params, use_tqdm=False):
        assert re.fullmatch(pattern, output.outputs[0].text), output.outputs[0].text


def test_choice_outputs_are_one_of_the_choices(llm):
    choices = ["positive", "negative", "it is \"neutral\""]
    params = [constrained(seed=seed, choice=choices) for seed in range(6)]
    texts = [o.outputs[0].text for o in llm.generate(["Sentiment:"] * 6, params, use_tqdm=False)]
    assert set(texts) <= set(choices)


def test_free_requests_get_the_same_tokens_beside_constrained_ones(llm):
    free = [SamplingParams(max_tokens=24, temperature=0), SamplingParams(max_tokens=24, temperature=0.9, seed=7)]
    alone = llm.generate(["The sea", "A king"], free, use_tqdm=False)
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 20}}, "required": ["a"]}
    mixed = llm.generate(["The sea", "JSON:", "A king", "Pick:"],
                         [free[0], constrained(json=schema), free[1], constrained(regex="[0-9]{1,30}")],
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in (mixed[0], mixed[2])] == [o.outputs[0].token_ids for o in alone]


def test_a_batch_with_a_constrained_request_takes_single_steps(llm, monkeypatch):
    steps = []
    submit = llm.engine.runner.submit
    monkeypatch.setattr(llm.engine.runner, "submit", lambda sched: steps.append(
        (1 + max(sched.num_lookahead_tokens.values(), default=0), set(sched.num_scheduled_tokens))) or submit(sched))
    llm.generate(["Hi", "Yo"], [SamplingParams(max_tokens=16, temperature=0), constrained(regex="[ab]{30}")],
                 use_tqdm=False)
    assert all(n == 1 for n, _ in steps)
    steps.clear()
    llm.generate(["Hi"], SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    assert max(n for n, _ in steps) == 4  # alone, the free request bursts


@pytest.mark.parametrize("spec, message", [
    (dict(regex="a(b"), r"^regex: Regex parsing error at position 4"),
    (dict(grammar="root ::= foo"), r'^grammar: EBNF parser error.*Rule "foo" is not defined'),
    (dict(json={"type": "array", "uniqueItems": True}), r"^json: keyword 'uniqueItems' at '/uniqueItems'"),
    (dict(json="{oops"), r"^json is not valid JSON"),
])
def test_a_bad_constraint_raises_at_the_call(llm, spec, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["x"], constrained(**spec), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_ignore_eos_is_refused_with_a_constraint(llm):
    with pytest.raises(ValueError, match="ignore_eos cannot go with structured outputs"):
        llm.generate(["x"], SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputsParams(regex="a")),
                     use_tqdm=False)


def test_min_tokens_is_refused_with_a_constraint(llm):
    """A grammar may allow only EOS where min_tokens masks it."""
    params = SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a"))
    with pytest.raises(ParamError, match="min_tokens = 2 cannot go with structured outputs") as e:
        llm.generate(["x"], params, use_tqdm=False)
    assert e.value.field == "min_tokens" and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_tool_call_returns_valid_arguments(llm, tool_choice):
    parameters = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                  "required": ["city", "days"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": parameters}},
             {"type": "function", "function": {"name": "get_time", "parameters": {
                 "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
    out = llm.chat([{"role": "user", "content": "Weather in Paris?"}], SamplingParams(max_tokens=80, temperature=0),
                   tools=tools, tool_choice=tool_choice, parallel_tool_calls=False).outputs[0]
    assert out.finish_reason == "tool_calls" and out.content is None and out.tool_calls
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}
    for call in out.tool_calls:
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    assert len(out.tool_calls) == 1
    if isinstance(tool_choice, dict):
        assert out.tool_calls[0].name == "get_weather"


def test_a_forced_tool_call_and_a_constraint_of_ones_own_are_refused_together(llm):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(ValueError, match="send only one of them"):
        llm.chat([{"role": "user", "content": "x"}], params, tools=tools, tool_choice="required")
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "book"}}])
def test_forced_tools_whose_parameters_use_refs(llm, tool_choice):
    """Parameters as pydantic writes them (nested types under $defs, reached by $ref), two tools defining the same
    name differently: "required" embeds each schema in an array, so their $defs must follow them there."""
    def tool(name, city):
        return {"type": "function", "function": {"name": name, "parameters": {
            "$defs": {"City": city}, "type": "object", "properties": {"to": {"$ref": "#/$defs/City"}},
            "required": ["to"]}}}

    tools = [tool("book", {"type": "object", "properties": {"name": {"enum": ["Paris", "Rome"]}},
                           "required": ["name"]}),
             tool("route", {"type": "string", "maxLength": 8})]
    out = llm.chat([{"role": "user", "content": "Book Paris"}], SamplingParams(max_tokens=60, temperature=0),
                   tools=tools, tool_choice=tool_choice, parallel_tool_calls=False).outputs[0]
    assert out.finish_reason == "tool_calls" and len(out.tool_calls) == 1
    call = out.tool_calls[0]
    jsonschema.validate(json.loads(call.arguments), {t["function"]["name"]: t for t in tools}[call.name]["function"][
        "parameters"])


def test_a_slow_grammar_does_not_stall_the_others(llm, monkeypatch):
    engine = llm.engine
    manager = engine.structured_outputs()
    release, compile_ = threading.Event(), manager._compile
    monkeypatch.setattr(manager, "_compile", lambda spec: release.wait(30) and compile_(spec))
    slow = engine.add_request([1, 2, 3], constrained(regex="[xyz]{5}"))  # a pattern no other test compiles
    free = engine.add_request([4, 5, 6], SamplingParams(max_tokens=12, temperature=0))
    finished = {}
    while free not in finished:
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert slow not in finished and engine.has_unfinished_requests()  # it waited while the other ran to the end
    release.set()
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert re.fullmatch("[xyz]{5}", finished[slow].outputs[0].text)


def test_without_xgrammar_a_constrained_request_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` raises ImportError
    fresh = LLM(device="cpu")
    with pytest.raises(ValueError, match=r"need xgrammar.*pip install 'deltaserve\[structured\]'"):
        fresh.generate(["x"], constrained(regex="a"), use_tqdm=False)
    assert fresh.generate(["x"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_a_grammar_that_fails_while_its_request_waits_finishes_it_as_aborted(llm, monkeypatch):
    from deltaserve.structured import GrammarError

    engine = llm.engine
    manager = engine.structured_outputs()
    release = threading.Event()

    def failing(spec):
        release.wait(30)
        raise GrammarError("regex: refused by the test", "regex")

    monkeypatch.setattr(manager, "_compile", failing)
    req_id = engine.add_request([1, 2, 3], constrained(regex="[pqr]{7}"))  # not compiled before: it waits
    assert engine.step() == [] and engine.has_unfinished_requests()
    release.set()
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    [output] = outputs
    assert (output.request_id, output.finished, output.outputs[0].finish_reason) == (req_id, True, "abort")


def test_a_constraint_that_does_not_compile_in_time_is_refused_and_its_compile_goes_on(llm, monkeypatch):
    """LLM.generate raises (nothing queued); a request added to the engine waiting for it finishes as aborted; the
    compile itself runs on and is cached for the next request."""
    from deltaserve.structured import errors

    engine = llm.engine
    manager = engine.structured_outputs()
    release, compile_ = threading.Event(), manager._compile
    monkeypatch.setattr(manager, "_compile", lambda spec: release.wait(30) and compile_(spec))
    monkeypatch.setattr(errors, "COMPILE_TIMEOUT_S", 0.2)
    spec = dict(regex="[stu]{6}")  # a pattern no other test compiles
    with pytest.raises(ValueError, match=r"did not compile within 0\.2 s; simplify it"):
        llm.generate(["Go:"], constrained(**spec), use_tqdm=False)
    assert not engine.has_unfinished_requests()
    req_id = engine.add_request([1, 2, 3], constrained(**spec))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [(o.request_id, o.outputs[0].finish_reason) for o in outputs] == [(req_id, "abort")]
    release.set()
    monkeypatch.setattr(errors, "COMPILE_TIMEOUT_S", 60.0)
    [output] = llm.generate(["Go:"], constrained(**spec), use_tqdm=False)
    assert re.fullmatch("[stu]{6}", output.outputs[0].text)


def test_constrained_requests_with_a_step_in_flight_give_the_tokens_of_synchronous_steps():
    """Asynchronous scheduling: a constrained request's step is scheduled and its forward queued while the step
    before runs; its mask is filled once that step's token is accepted. Same tokens as synchronous steps, beside a
    free request."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 12}},
              "required": ["n", "s"]}
    params = [constrained(seed=3, json=schema), SamplingParams(max_tokens=24, temperature=0),
              constrained(seed=4, regex=r"[a-z]{3}-\d{2,4}")]
    prompts = ["JSON:", "The sea", "Go:"]
    expected = LLM(device="cpu", num_decode_steps=4).generate(prompts, params, use_tqdm=False)
    pipelined = LLM(device="cpu", num_decode_steps=4, async_scheduling=True)
    scheduler, ahead = pipelined.engine.scheduler, []
    schedule = scheduler.schedule
    scheduler.schedule = lambda: ahead.append(any(r.num_pending_outputs for r in scheduler.running)) or schedule()
    got = pipelined.generate(prompts, params, use_tqdm=False)
    assert any(ahead)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    json.loads(got[0].outputs[0].text)


def test_compiles_in_flight_are_bounded_and_requests_wait_for_room(llm, monkeypatch):
    """Past MAX_COMPILES_IN_FLIGHT, a request added to the engine waits outside the scheduler for room (as for its
    compile) and runs once a compile ends; LLM.generate waits for room too: a batch of more distinct constraints
    than the bound completes."""
    from deltaserve.structured import errors

    engine = llm.engine
    manager = engine.structured_outputs()
    release, compile_ = threading.Event(), manager._compile
    monkeypatch.setattr(manager, "_compile", lambda spec: release.wait(30) and compile_(spec))
    monkeypatch.setattr(errors, "MAX_COMPILES_IN_FLIGHT", 2)
    blocked = [manager.submit(StructuredOutputsParams(regex=f"[ab]{{{n}}}z")) for n in (7, 8)]  # no other test's
    with pytest.raises(errors.CompilesBusy, match="2 constraints are compiling already"):
        manager.submit(StructuredOutputsParams(regex="[ab]{9}z"))
    req_id = engine.add_request([1, 2, 3], constrained(regex="[ab]{9}z"))
    assert engine._compiling[req_id][1] is None  # no room: not even queued for the pool yet
    threading.Timer(0.3, release.set).start()
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    [done] = [o for o in outputs if o.finished]
    assert done.outputs[0].finish_reason == "stop" and re.fullmatch("[ab]{9}z", done.outputs[0].text)
    assert all(future.result(timeout=30) for future in blocked)

    release = threading.Event()
    threading.Timer(0.3, release.set).start()
    patterns = [f"[cd]{{{n}}}" for n in range(3, 8)]  # five distinct constraints through a bound of two
    outputs = llm.generate(["Go:"] * len(patterns), [constrained(regex=p) for p in patterns], use_tqdm=False)
    assert all(re.fullmatch(p, o.outputs[0].text) for p, o in zip(patterns, outputs))


def test_an_offline_batch_of_more_constraints_than_the_cache_keeps_completes(llm, monkeypatch):
    """More distinct constraints than MAX_CACHED_GRAMMARS: those evicted before their request is added compile
    again, waiting for room rather than failing the batch."""
    from deltaserve.structured import errors
    from deltaserve.structured import manager as manager_module

    manager = llm.engine.structured_outputs()
    compile_ = manager._compile
    monkeypatch.setattr(manager, "_compile", lambda spec: time.sleep(0.1) or compile_(spec))
    monkeypatch.setattr(manager_module, "MAX_CACHED_GRAMMARS", 3)
    monkeypatch.setattr(errors, "MAX_COMPILES_IN_FLIGHT", 2)
    patterns = [f"[ef]{{{n}}}y" for n in range(2, 8)]
    outputs = llm.generate(["Go:"] * len(patterns), [constrained(regex=p) for p in patterns], use_tqdm=False)
    assert all(re.fullmatch(p, o.outputs[0].text) for p, o in zip(patterns, outputs))


def test_waiting_for_room_is_bounded_by_the_compile_timeout(llm, monkeypatch):
    from deltaserve.structured import errors

    manager = llm.engine.structured_outputs()
    release, compile_ = threading.Event(), manager._compile
    monkeypatch.setattr(manager, "_compile", lambda spec: release.wait(30) and compile_(spec))
    monkeypatch.setattr(errors, "MAX_COMPILES_IN_FLIGHT", 1)
    monkeypatch.setattr(errors, "COMPILE_TIMEOUT_S", 0.2)
    blocked = manager.submit(StructuredOutputsParams(regex="[gh]{5}x"))
    with pytest.raises(ValueError, match=r"did not compile within 0\.2 s"):
        llm.generate(["Go:"], constrained(regex="[gh]{6}x"), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    release.set()
    blocked.result(timeout=30)


def test_a_grammar_whose_mask_is_slow_to_fill_is_aborted_and_the_free_requests_go_on(llm, monkeypatch):
    """A constrained request whose mask takes longer than FILL_LIMIT_S at FILL_STRIKES steps ends as aborted (it
    would hold up every request's sampling); a free request beside it gets the tokens it gets alone."""
    from deltaserve.structured import manager

    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    [alone] = llm.generate(["The"], free, use_tqdm=False)
    monkeypatch.setattr(manager, "FILL_LIMIT_S", 0.0)  # every fill is slow
    monkeypatch.setattr(manager, "FILL_STRIKES", 3)
    slow, beside = llm.generate(["Go:", "The"], [constrained(regex="[gh]{40}", max_tokens=40), free], use_tqdm=False)
    assert slow.outputs[0].finish_reason == "abort" and len(slow.outputs[0].token_ids) == 3
    assert re.fullmatch("[gh]*", slow.outputs[0].text)
    assert beside.outputs[0].token_ids == alone.outputs[0].token_ids
    assert not llm.engine.structured._slow_fills  # released with the request


def test_slow_fills_must_come_in_a_row_to_abort_a_request(llm, monkeypatch):
    """Two slow steps, then a fast one, over and over: never FILL_STRIKES (3) in a row, so the request runs to its
    end (a one-off stall, e.g. a throttled CPU, does not end a healthy request)."""
    from deltaserve.structured import manager as manager_module

    engine = llm.engine
    manager = engine.structured_outputs()
    manager.submit(StructuredOutputsParams(regex="[gh]{12}")).result(timeout=30)  # the backend built, cached
    backend, stalls = manager._backend, {"slow": False}
    fill = backend.fill
    monkeypatch.setattr(backend, "fill", lambda *args: (time.sleep(0.03) if stalls["slow"] else None, fill(*args)))
    monkeypatch.setattr(manager_module, "FILL_LIMIT_S", 0.02)
    monkeypatch.setattr(manager_module, "FILL_STRIKES", 3)
    engine.add_request([1, 2, 3], constrained(regex="[gh]{12}", max_tokens=12))
    outputs = []
    for step in itertools.count():  # synchronous steps on the CPU: one sampling of the request each
        stalls["slow"] = step % 3 != 2
        outputs += engine.step()
        if not engine.has_unfinished_requests():
            break
    [done] = [o for o in outputs if o.finished]
    assert done.outputs[0].finish_reason != "abort" and re.fullmatch("[gh]{12}", done.outputs[0].text)
    assert step >= 8


def refusing(monkeypatch, req_position: int, times: int) -> list[int]:
    """Make every matcher refuse the token sampled at output position req_position, `times` times (a stand-in
    for xgrammar's mask allowing a token its matcher refuses: BENCHMARKS.md); returns the refused tokens."""
    from deltaserve.structured.manager import StructuredOutputManager

    real, taken, refused = StructuredOutputManager.accept, {}, []

    def accept(self, req_id, token_ids):
        position = taken.get(req_id, 0)
        if req_id in self._matchers and position == req_position and refused.count(req_id) < times:
            refused.append(req_id)
            refused.append(token_ids[0])
            return 0
        n = real(self, req_id, token_ids)
        taken[req_id] = position + n
        return n

    monkeypatch.setattr(StructuredOutputManager, "accept", accept)
    return refused


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_token_the_grammar_refuses_is_sampled_again_without_it(monkeypatch, async_scheduling):
    """The request is taken back to the refused position and computed again (preempted: steps in flight that read
    the token are dropped), the token kept out of its mask there: greedy picks the next allowed token, the output
    before it is unchanged and the whole matches; a free request beside it gets its tokens as alone."""
    pattern = r"[a-z]{3}-\d{2,4}"
    params = [constrained(temperature=0, regex=pattern), SamplingParams(max_tokens=24, temperature=0)]
    prompts = ["Go:", "The sea"]
    make = lambda: LLM(device="cpu", num_decode_steps=4, async_scheduling=async_scheduling)  # noqa: E731
    expected = [o.outputs[0] for o in make().generate(prompts, params, use_tqdm=False)]
    llm = make()
    refused = refusing(monkeypatch, req_position=2, times=1)
    got = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert refused[1] == expected[0].token_ids[2]
    assert got[0].token_ids[:2] == expected[0].token_ids[:2] and got[0].token_ids[2] != refused[1]
    assert got[0].finish_reason == "stop" and re.fullmatch(pattern, got[0].text), got[0].text
    assert got[1].token_ids == expected[1].token_ids
    assert llm.engine.scheduler.num_preemptions == 1


@pytest.mark.parametrize("position", [0, 1])  # hundreds of tokens allowed there; one only (then none is left)
def test_a_position_whose_tokens_are_all_refused_ends_the_request_as_aborted(monkeypatch, position):
    from deltaserve.structured.manager import MAX_REFUSED_TOKENS

    params = [constrained(temperature=0, regex=r"[a-z]{3}-\d{2,4}"), SamplingParams(max_tokens=24, temperature=0)]
    llm = LLM(device="cpu", num_decode_steps=4, async_scheduling=True)
    alone = llm.generate(["The sea"], params[1], use_tqdm=False)[0].outputs[0]
    log = refusing(monkeypatch, req_position=position, times=100)
    got = [o.outputs[0] for o in llm.generate(["Go:", "The sea"], params, use_tqdm=False)]
    refused = log[1::2]
    assert got[0].finish_reason == "abort" and len(got[0].token_ids) == position
    assert len(refused) <= MAX_REFUSED_TOKENS + 1 and len(set(refused)) >= len(refused) - 1
    if position == 0:
        assert len(set(refused)) == MAX_REFUSED_TOKENS + 1  # each sampled again without those before it
    assert got[1].token_ids == alone.token_ids


@pytest.mark.parametrize("max_tokens, position", [(1, 0), (48, 2)])  # the max_tokens-th token; the stop token
def test_a_refused_token_that_ended_the_request_is_sampled_again_too(monkeypatch, max_tokens, position):
    pattern = r"[a-z]{3}-\d{0,4}"
    params = constrained(max_tokens=max_tokens, temperature=0, regex=pattern)
    llm = LLM(device="cpu", num_decode_steps=4, async_scheduling=True)
    expected = llm.generate(["Go:"], params, use_tqdm=False)[0].outputs[0]
    assert len(expected.token_ids) == position + 1  # the token at `position` ended it
    refused = refusing(monkeypatch, req_position=position, times=1)
    got = llm.generate(["Go:"], params, use_tqdm=False)[0].outputs[0]
    assert refused[1] == expected.token_ids[position] and got.token_ids[:position] == expected.token_ids[:position]
    assert got.token_ids[position] != refused[1] and got.finish_reason in ("stop", "length")
    assert re.fullmatch(pattern, got.text) or got.finish_reason == "length", got.text


@pytest.mark.parametrize("position", [0, 1, 2, 3, 8])
def test_a_rewind_with_a_step_in_flight_and_cached_pages_gives_the_tokens_of_synchronous_steps(monkeypatch, position):
    """The same refusal under steps in flight with prefix caching (blocks of 4, so the rewound request's pages and
    snapshots are cached and hit again) and under synchronous steps without caching: the same tokens, text and
    logprobs (seeded sampling, a free request beside)."""
    prompts = ["Go: " * 9, "The sea and the king " * 3]
    params = [SamplingParams(max_tokens=48, temperature=0.9, seed=1, logprobs=2,
                             structured_outputs=StructuredOutputsParams(regex=r"[a-z]{40}")),
              SamplingParams(max_tokens=30, temperature=0)]
    outputs, later = [], []
    for async_scheduling in (False, True):
        llm = LLM(device="cpu", num_decode_steps=4, async_scheduling=async_scheduling,
                  enable_prefix_caching=async_scheduling, block_size=4)
        with monkeypatch.context() as patch:
            refused = refusing(patch, req_position=position, times=1)
            outputs.append([o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)])
        assert len(refused) == 2
        # later prompts through the rewound position, with the refused token in it and with the kept one: served
        # from the cache (pages and snapshots the rewound request left), they must give the uncached tokens
        done = outputs[-1][0].token_ids
        head = llm.engine.tokenizer.encode(prompts[0]) + done[:position]
        follow = [head + [refused[1]] + done[position + 1:], head + done[position:]]
        later.append([o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": f} for f in follow],
                                                                  params[1], use_tqdm=False)])
    (want, want_free), (got, got_free) = outputs
    assert got.token_ids == want.token_ids and got.text == want.text and got_free.token_ids == want_free.token_ids
    assert [lp[t].logprob for t, lp in zip(got.token_ids, got.logprobs)] == pytest.approx(
        [lp[t].logprob for t, lp in zip(want.token_ids, want.logprobs)], abs=1e-4)
    assert later[1] == later[0]
