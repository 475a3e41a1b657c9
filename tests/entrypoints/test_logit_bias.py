"""logit_bias and allowed_token_ids through the offline API: the tokens are those of the model's logits adjusted as
vLLM adjusts them (a slow twin by whole-sequence prefills), the same with lookahead decode steps as without, and a
bad value is refused before anything is queued (make_llm checks every LLM ends idle)."""

from __future__ import annotations

import pytest
from helpers.engine import as_inputs, random_prompts
from helpers.hand_runner import prefill_logits

from deltaserve import SamplingParams
from deltaserve.sampling_params import ParamError

MAX_TOKENS = 12


def biased_greedy(llm, prompt: list[int], logit_bias: dict[int, float], max_tokens: int) -> list[int]:
    """The slow twin of logit_bias: greedy tokens by whole-sequence prefills, each bias added to its token's logit."""
    tokens = []
    while len(tokens) < max_tokens:
        logits = prefill_logits(llm.engine.runner.model, prompt + tokens)[-1].clone()
        for token, bias in logit_bias.items():
            logits[token] += bias
        tokens.append(int(logits.argmax()))
    return tokens


def generate(llm, prompts: list[list[int]], **params) -> list[list[int]]:
    params = dict(max_tokens=MAX_TOKENS, ignore_eos=True) | params
    outputs = llm.generate(as_inputs(prompts), SamplingParams(**params), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("num_decode_steps", [1, 8], ids=["single steps", "lookahead"])
def test_logit_bias_moves_greedy_tokens_as_its_twin(make_llm, num_decode_steps):
    """+100 on a token the model never picks makes it every output token; a small bias on the first few greedy
    tokens' runners-up gives the twin's tokens; with lookahead decode steps too (the bias is applied at each)."""
    llm = make_llm(num_decode_steps=num_decode_steps)
    prompts = random_prompts([7, 30], seed=3)
    plain = generate(llm, prompts, temperature=0)
    never = next(t for t in range(5, 512) if all(t not in p for p in plain))
    assert generate(llm, prompts, temperature=0, logit_bias={never: 100}) == [[never] * MAX_TOKENS] * 2
    assert generate(llm, prompts, temperature=0, logit_bias={never: 10**400}) == [[never] * MAX_TOKENS] * 2  # clamped

    for prompt, tokens in zip(prompts, plain):
        ranked = prefill_logits(llm.engine.runner.model, prompt)[-1].topk(3).indices.tolist()
        bias = {ranked[1]: 2.5, ranked[2]: 1.5, tokens[3]: -4.0, 500: 3.0}
        got = generate(llm, [prompt], temperature=0, logit_bias=bias)[0]
        assert got == biased_greedy(llm, prompt, bias, MAX_TOKENS) != tokens


def test_a_bias_of_minus_100_on_the_greedy_token_gives_the_second_best(make_llm):
    llm = make_llm()
    prompt = random_prompts([11], seed=8)[0]
    best, second = prefill_logits(llm.engine.runner.model, prompt)[-1].topk(2).indices.tolist()
    params = dict(temperature=0, max_tokens=1)
    assert llm.generate(as_inputs([prompt]), SamplingParams(**params), use_tqdm=False)[0].outputs[0].token_ids == [best]
    out = llm.generate(as_inputs([prompt]), SamplingParams(logit_bias={best: -100}, **params), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [second]


@pytest.mark.parametrize("sampling", [dict(temperature=1.5), dict(temperature=1.0, top_p=0.9, seed=4)],
                         ids=["unseeded", "seeded"])
def test_allowed_token_ids_restrict_every_sampled_token(make_llm, sampling):
    """Random sampling over many tokens and prompts draws only allowed ids (several of them), the same with
    lookahead as without for a seeded request; one allowed id is the whole output, greedy or not."""
    llm, single = make_llm(), make_llm(num_decode_steps=1)
    prompts = random_prompts([5, 17, 40, 64], seed=6)
    allowed = [9, 77, 78, 200, 333, 511]
    params = dict(sampling, max_tokens=48, allowed_token_ids=allowed)
    drawn = generate(llm, prompts, **params)
    assert all(t in allowed for tokens in drawn for t in tokens) and len({t for ts in drawn for t in ts}) > 2
    if "seed" in sampling:
        assert drawn == generate(single, prompts, **params)
    plain = [p | dict(temperature=0) for p in ({}, dict(logit_bias={9: 50}))]
    for kind in (sampling, *plain):
        assert generate(llm, prompts[:2], **kind, allowed_token_ids=[200]) == [[200] * MAX_TOKENS] * 2


@pytest.mark.parametrize("fields, field, words", [
    (dict(logit_bias={"5": 1.0}), "logit_bias", "logit_bias['5'] = 1.0: keys must be token ids"),
    (dict(logit_bias={-1: 1.0}), "logit_bias", "logit_bias[-1]"),
    (dict(logit_bias={5: float("inf")}), "logit_bias", "values finite numbers"),
    (dict(logit_bias={5: "up"}), "logit_bias", "logit_bias[5] = 'up'"),
    (dict(logit_bias=[5]), "logit_bias", "must be a dict of token ids to numbers"),
    (dict(allowed_token_ids=[]), "allowed_token_ids", "must be a non-empty list"),
    (dict(allowed_token_ids=[3, -2]), "allowed_token_ids", "allowed_token_ids[1] = -2"),
    (dict(allowed_token_ids=[3, True]), "allowed_token_ids", "allowed_token_ids[1] = True"),
], ids=["string key", "negative key", "infinite value", "string value", "a list", "empty list", "negative id",
        "a bool"])
def test_bad_values_are_refused_naming_the_field(make_llm, fields, field, words):
    """At construction, and by generate where set after it (nothing queued)."""
    with pytest.raises(ParamError, match=words.replace("[", r"\[").replace("]", r"\]")) as raised:
        SamplingParams(**fields)
    assert raised.value.field == field
    llm, params = make_llm(), SamplingParams(max_tokens=2)
    setattr(params, field, fields[field])
    with pytest.raises(ParamError, match=field) as raised:
        llm.generate(as_inputs([[5, 6]]), params, use_tqdm=False)
    assert raised.value.field == field


@pytest.mark.parametrize("fields, field, words", [
    (dict(logit_bias={3: 1.0, 512: 2.0}), "logit_bias", "logit_bias names token id 512, past this model's vocabulary"),
    (dict(allowed_token_ids=[3, 600]), "allowed_token_ids", "allowed_token_ids names token id 600"),
    (dict(allowed_token_ids=[7], stop_token_ids=[7], min_tokens=1), "allowed_token_ids",
     "are all stop or EOS ids, which min_tokens = 1 masks"),
], ids=["bias past the vocabulary", "allowed id past the vocabulary", "only ids min_tokens masks"])
def test_ids_the_model_cannot_sample_are_refused(make_llm, fields, field, words):
    llm = make_llm()
    with pytest.raises(ParamError, match=words) as raised:
        llm.generate(as_inputs([[5, 6]]), SamplingParams(max_tokens=2, **fields), use_tqdm=False)
    assert raised.value.field == field
