"""Engine.warm_up_prefill (serve's start on a GPU): random prompts at lengths that meet each prefill path and each
length bucket of fla-core's l2norm tuning key, run before the engine takes requests; the engine after it is as
before, but for the pages its prompts left in the prefix cache."""

from __future__ import annotations

import dataclasses
import logging

import pytest
from helpers.engine import as_inputs, random_prompts

from deltaserve import SamplingParams
from deltaserve.config import EngineConfig
from deltaserve.core.engine import prefill_warmup_lengths
from deltaserve.entrypoints.cli import _engine_fields, build_parser


@pytest.mark.parametrize("max_tokens,heads,expected", [
    # the 48B model at bench's budget: NB 1..4, our recurrent kernel; a ragged short and long step
    (8192, 32, [16, 17, 2048, 4096, 6144, 8191, 8192]),
    (2048, 32, [16, 17, 2047, 2048]),  # serve's default budget
    (3000, 32, [16, 17, 2048, 2992, 2999, 3000]),  # the last bucket ends at the budget
    (8192, 16, [16, 17, 4096, 8191, 8192]),  # tensor parallel over 2: half the heads a rank, twice the tokens a bucket
    (1000, 32, [16, 17, 992, 999, 1000]),  # a budget under one bucket: a round count past 32 all the same
    (3000, 48, [16, 17, 1365, 2730, 2992, 2999, 3000]),  # buckets that end on ragged counts
    (1025, 32, [16, 17, 1023, 1024, 1025]),  # the budget less one is round: one less again
    (10, 32, [10]),  # a model shorter than the short step
])
def test_warmup_lengths_meet_every_bucket_up_to_the_step_budget(max_tokens, heads, expected):
    lengths = prefill_warmup_lengths(max_tokens, heads)
    assert lengths == expected
    buckets = {-(-n * heads // 65536) for n in lengths}
    assert buckets == set(range(1, -(-max_tokens * heads // 65536) + 1))
    # Triton's integer specializations: a multiple of 16 and not, on each side of our recurrent kernel's limit (32)
    for side in ([n for n in lengths if n <= 32], [n for n in lengths if n > 32]):
        assert not side or {n % 16 == 0 for n in side} == {True, False} or max(side) < 16


def test_the_warmup_leaves_the_engine_as_it_was(make_llm, caplog):
    prompts, params = random_prompts((5, 40), seed=3), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    cold = make_llm(max_num_batched_tokens=64)
    expected = [o.outputs[0].token_ids for o in cold.generate(as_inputs(prompts), params, use_tqdm=False)]
    warm = make_llm(max_num_batched_tokens=64)
    caplog.set_level(logging.INFO, logger="deltaserve")
    warm.engine.warm_up_prefill()
    assert "start-up: prefill warm-up" in caplog.text and "steps of 16, 17, 63, 64 prompt tokens" in caplog.text
    assert not warm.engine.has_unfinished_requests()
    assert all(t.steps == 0 and t.tokens == 0 for t in warm.engine.step_totals.values())
    assert [o.outputs[0].token_ids for o in warm.generate(as_inputs(prompts), params, use_tqdm=False)] == expected


def test_serve_warms_its_prefill_up_and_generate_does_not():
    parser = build_parser()
    assert _engine_fields(parser.parse_args(["serve"]))["warmup_prefill"] is True
    assert "warmup_prefill" not in _engine_fields(parser.parse_args(["generate"]))
    assert EngineConfig().warmup_prefill is False
    with pytest.raises(ValueError, match="warmup_prefill"):
        EngineConfig(warmup_prefill="yes")


def test_a_step_total_past_the_model_length_is_split_over_prompts_of_one_step(make_llm):
    """serve_bench's engines: 8,192 tokens a step, a 768-token model: the bucket ends still reached in one step each."""
    llm = make_llm(max_num_batched_tokens=200, max_model_len=64, max_num_seqs=8)
    # buckets of 100 tokens: steps of 16, 17, 100, 192, 199 and 200 prompt tokens
    llm.engine.model_config = dataclasses.replace(llm.engine.model_config, kda_num_heads=65536 // 100)
    assert warmup_steps(llm)[:6] == [16, 17, 100, 192, 199, 200]  # then the mixed steps


def test_the_warmup_steps_are_no_larger_than_a_step_can_be(make_llm, caplog):
    """One sequence at a time of a 64-token model: the steps' sizes are what serving can meet (up to 63 tokens),
    each once, and the log names those that ran."""
    llm = make_llm(max_num_batched_tokens=200, max_model_len=64, max_num_seqs=1)
    caplog.set_level(logging.INFO, logger="deltaserve")
    assert warmup_steps(llm) == [16, 17, 48, 62, 63]
    assert "steps of 16, 17, 48, 62, 63 prompt tokens" in caplog.text


def warmup_steps(llm) -> list[int]:
    """The prompt tokens of each step llm's warm-up ran that was not a lone decode."""
    return [n for n in map(sum, warmup_schedules(llm)) if n > 1]


def warmup_schedules(llm) -> list[list[int]]:
    """The tokens of each request in each step llm's warm-up ran, ascending (its scheduler's outputs, read as they are
    made)."""
    scheduled, schedule = [], llm.engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        scheduled.append(sorted(out.num_scheduled_tokens.values()))
        return out

    llm.engine.scheduler.schedule = recording_schedule
    llm.engine.warm_up_prefill()
    return scheduled


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_warmup_mixes_decodes_with_a_prompt_on_each_side_of_the_recurrent_kernels_limit(make_llm, caplog,
                                                                                            async_scheduling):
    """After the prefill-only steps, 1, 2, 3, each power of two below max_num_seqs and max_num_seqs - 1 decode rows
    (one-token prompts) run beside a prompt of ragged length, one each side of the recurrent KDA kernel's 32 tokens (the
    prefill's tensors then slices past the decodes' rows, as in a server's steps), in one step also with
    asynchronous scheduling (a GPU's default), under which decodes started before the prompt came had finished before
    it was scheduled; the engine is left empty, and the log names the rounds."""
    from deltaserve.core.engine import MIXED_WARMUP_SHORT_PROMPT
    from deltaserve.kernels.kda import RECURRENT_PREFILL_MAX_LEN

    assert MIXED_WARMUP_SHORT_PROMPT == RECURRENT_PREFILL_MAX_LEN
    llm = make_llm(max_num_batched_tokens=200, max_model_len=128, max_num_seqs=10, async_scheduling=async_scheduling)
    caplog.set_level(logging.INFO, logger="deltaserve")
    steps = warmup_schedules(llm)
    # (decodes, prompt tokens) of the steps of one prompt beside one-token rows
    mixed = {(len(step) - 1, step[-1]) for step in steps if len(step) > 1 and step[-1] > 1 and step[-2] == 1}
    rounds = [(1, 25), (1, 41), (2, 26), (2, 42), (3, 27), (3, 43), (4, 28), (4, 44), (8, 25), (8, 41), (9, 26),
              (9, 42)]
    assert mixed == set(rounds)
    assert "decodes beside a prompt (decodes+tokens): " + ", ".join(f"{d}+{n}" for d, n in rounds) in caplog.text
    assert not llm.engine.has_unfinished_requests()
    assert all(t.steps == 0 and t.tokens == 0 for t in llm.engine.step_totals.values())


def test_one_sequence_at_a_time_runs_no_mixed_step(make_llm, caplog):
    llm = make_llm(max_num_batched_tokens=200, max_model_len=64, max_num_seqs=1)
    caplog.set_level(logging.INFO, logger="deltaserve")
    llm.engine.warm_up_prefill()
    assert "decodes beside a prompt" not in caplog.text
