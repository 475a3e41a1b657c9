"""LLM's calls as users make them: each stream and generate gets only its own requests' outputs, whichever call ran
the step (also from several threads); a stream closed or dropped early aborts what it has not finished; no failed
call leaves a request queued; the arguments' types are checked at the call; shutdown ends the LLM."""

from __future__ import annotations

import gc
import threading

import pytest
from helpers.engine import as_inputs, assert_idle, random_prompts, token_ids

from deltaserve import SamplingParams
from deltaserve.sampling_params import ParamError

LONG = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


def test_interleaved_streams_and_a_generate_each_get_their_own_outputs(make_llm):
    llm = make_llm()
    a_prompt, b_prompt, c_prompt = (as_inputs(random_prompts([n], seed=n)) for n in (7, 9, 11))
    expected = [token_ids(llm.generate(p, SHORT, use_tqdm=False)) for p in (a_prompt, b_prompt, c_prompt)]
    a, b = llm.stream(a_prompt, SHORT), llm.stream(b_prompt, SHORT)
    first_a = next(a)
    c = llm.generate(c_prompt, SHORT, use_tqdm=False)  # runs a's and b's requests too; their outputs wait for them
    rest_a, all_b = [first_a, *a], list(b)
    assert {o.request_id for o in rest_a} == set(a.request_ids) and {o.request_id for o in all_b} == set(b.request_ids)
    assert [rest_a[-1].outputs[0].token_ids, all_b[-1].outputs[0].token_ids, token_ids(c)[0]] == \
        [e[0] for e in expected]
    assert rest_a[-1].finished and all_b[-1].finished
    assert_idle(llm)


@pytest.mark.parametrize("how", ["close", "drop", "drop before the first output"])
def test_a_stream_closed_or_dropped_early_aborts_its_requests(make_llm, how):
    llm = make_llm()
    stream = llm.stream(as_inputs(random_prompts([20, 30], seed=2)), LONG)
    if how != "drop before the first output":
        next(stream)
    if how == "close":
        stream.close()
    del stream
    gc.collect()
    assert_idle(llm)  # nothing left running for the next call to wait on
    assert len(token_ids(llm.generate({"prompt_token_ids": [5, 6]}, SHORT, use_tqdm=False))[0]) == 3


def test_generate_from_several_threads_at_once(make_llm):
    llm = make_llm()
    prompts = [as_inputs(random_prompts([5 + i], seed=i)) for i in range(4)]
    expected = [token_ids(llm.generate(p, SHORT, use_tqdm=False)) for p in prompts]
    got, errors = [None] * 4, []

    def run(i):
        try:
            got[i] = token_ids(llm.generate(prompts[i], SHORT, use_tqdm=False))
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and got == expected
    assert_idle(llm)


def test_params_changed_after_construction_are_checked_at_the_call(make_llm):
    llm = make_llm()
    for field, value in (("temperature", -1.0), ("max_tokens", "7"), ("stop_token_ids", None), ("stop", 5),
                         ("min_tokens", 4)):
        params = SamplingParams(max_tokens=3)
        setattr(params, field, value)
        with pytest.raises(ValueError, match=f"SamplingParams.{field} = "):
            llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7]}], [LONG, params], use_tqdm=False)
        assert_idle(llm)  # the first prompt, queued before the second failed, was taken back


@pytest.mark.parametrize("fields", [dict(min_tokens=-1), dict(min_tokens=1.5), dict(min_tokens=True),
                                    dict(min_tokens="2"), dict(min_tokens=None), dict(max_tokens=3, min_tokens=4)])
def test_bad_min_tokens_is_a_param_error_saying_how_to_fix(fields):
    with pytest.raises(ParamError, match=r"SamplingParams.min_tokens = .*: must be an integer in \[0, max_tokens = "
                                         r"\d+\]; lower it or raise max_tokens") as e:
        SamplingParams(**fields)
    assert e.value.field == "min_tokens"
    assert SamplingParams(max_tokens=3, min_tokens=3).min_tokens == 3


@pytest.mark.parametrize("prompts, params, error, words", [
    (None, None, TypeError, "prompts of type NoneType"),
    (b"hello", None, TypeError, "prompts of type bytes"),
    ({"prompt_token_ids": [5], "prompt": "x"}, None, ValueError, "and no other key"),
    ({"prompt_token_ids": [True, 5]}, None, ValueError, "token ids must be integers"),
    ({"prompt_token_ids": [5]}, {"max_tokens": 3}, TypeError, "sampling_params of type dict"),
    ([{"prompt_token_ids": [5]}] * 2, [SHORT, None], TypeError, "sampling_params of type list"),
], ids=["None", "bytes", "extra key", "bool id", "dict params", "None in params"])
def test_wrong_argument_types_say_what_to_pass(make_llm, prompts, params, error, words):
    llm = make_llm()
    with pytest.raises(error, match=words):
        llm.generate(prompts, params, use_tqdm=False)
    assert_idle(llm)


def test_numpy_token_ids_are_token_ids(make_llm):
    np = pytest.importorskip("numpy")
    llm = make_llm()
    ids = list(np.array([5, 6, 7]))
    assert token_ids(llm.generate({"prompt_token_ids": ids}, SHORT, use_tqdm=False)) == \
        token_ids(llm.generate({"prompt_token_ids": [5, 6, 7]}, SHORT, use_tqdm=False))


def test_shutdown_ends_the_llm(make_llm):
    llm = make_llm()
    with llm:
        llm.generate({"prompt_token_ids": [5]}, SHORT, use_tqdm=False)
    llm.shutdown()  # a second time: nothing
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate({"prompt_token_ids": [5]}, SHORT, use_tqdm=False)


@pytest.mark.parametrize("options, words", [
    ({"device": 0}, "device = 0"), ({"dtype": []}, r"dtype = \[\]"), ({"model": ""}, "model '' is empty"),
])
def test_a_falsy_option_is_refused_not_replaced_by_the_default(options, words):
    from deltaserve import LLM

    with pytest.raises(ValueError, match=words):
        LLM(**options)
