"""Prefix caching is exact: in float32, an engine with caching on gives the tokens (and logprobs, to rounding) of one
with caching off, for multi-turn chats, partly shared prompts, chunked prefill, preemption, aborts, sampling and
pools small enough to evict; and a hit really skips the prefill of the cached prefix. Every test ends with every
page free or cached-unreferenced and every snapshot slot free or cached (the make_llm fixture checks)."""

from __future__ import annotations

import itertools

import pytest
from helpers.engine import SAMPLING_KINDS, as_inputs, assert_same_logprobs, random_prompts, token_ids
from scheduler_harness import step

from deltaserve import SamplingParams
from deltaserve.cache.manager import CacheManager
from deltaserve.config import EngineConfig
from deltaserve.core.scheduler import Scheduler
from deltaserve.request import Request

BS = 16
SYSTEM = "<|im_start|>system\nYou are a terse assistant. Answer in one short line and never ask back.<|im_end|>\n"
USER_TEXTS = ("hello there", "what is a delta rule?", "and the forget gate", "why chunks of 64",
              "is the state float32", "ok, what about MLA", "latent dim 576?", "no rope at all",
              "thanks, one more", "bye now")


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def chat_turn_ids(tokenizer, text: str) -> list[int]:
    """The template's user turn and the assistant header, as ids."""
    return tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


def record_steps(llm) -> list:
    """Every SchedulerOutput the engine's scheduler produces from now on."""
    scheduler, steps = llm.engine.scheduler, []
    schedule = scheduler.schedule

    def recording():
        out = schedule()
        steps.append(out)
        return out

    scheduler.schedule = recording
    return steps


def run_chats(llm, openings: list[list[int]], user_turns: list[list[list[int]]], end_of_answer: list[int],
              params: list[SamplingParams]) -> list[list]:
    """Several conversations in lockstep: each turn's prompts run together; the next prompt is prompt + answer +
    end_of_answer + the next user turn. Returns each turn's outputs (one per conversation)."""
    prompts = [opening + turns[0] for opening, turns in zip(openings, user_turns)]
    turns = []
    for turn in range(len(user_turns[0])):
        outputs = llm.generate(as_inputs(prompts), params, use_tqdm=False)
        turns.append(outputs)
        if turn + 1 < len(user_turns[0]):
            prompts = [o.prompt_token_ids + o.outputs[0].token_ids + end_of_answer + user[turn + 1]
                       for o, user in zip(outputs, user_turns)]
    return turns


def assert_same_turns(got: list[list], expected: list[list]) -> None:
    for turn, (g_outs, e_outs) in enumerate(zip(got, expected, strict=True)):
        for conv, (g, e) in enumerate(zip(g_outs, e_outs, strict=True)):
            where = f"turn {turn}, conversation {conv}"
            assert g.prompt_token_ids == e.prompt_token_ids, where
            assert g.outputs[0].token_ids == e.outputs[0].token_ids, where
            assert_same_logprobs(g.outputs[0].logprobs, e.outputs[0].logprobs, where)


def expected_hit(previous) -> int:
    """What the next turn must find: the state saved at the last block boundary of the previous prompt + answer
    (its last token is never computed)."""
    computed = len(previous.prompt_token_ids) + len(previous.outputs[0].token_ids) - 1
    return computed // BS * BS


def chat_setup(tokenizer, num_conversations: int, num_turns: int = 10):
    system = tokenizer.encode(SYSTEM, add_special_tokens=True)
    users = [[chat_turn_ids(tokenizer, f"{USER_TEXTS[t % len(USER_TEXTS)]} ({c})") for t in range(num_turns)]
             for c in range(num_conversations)]
    return [system] * num_conversations, users, tokenizer.encode("<|im_end|>\n")


@pytest.mark.parametrize("max_num_batched_tokens", [2048, 7])
def test_ten_turn_chats_sharing_a_system_prompt_give_the_tokens_of_no_caching(make_llm, max_num_batched_tokens):
    """Two conversations (greedy; seeded sampling with logprobs) share the system prompt; a token budget of 7 also
    cuts every prefill into chunks."""
    off = make_llm(max_model_len=1024, enable_prefix_caching=False)
    openings, users, end = chat_setup(off.tokenizer, 2)
    params = [greedy(12),
              SamplingParams(max_tokens=10, ignore_eos=True, **SAMPLING_KINDS[6])]
    expected = run_chats(off, openings, users, end, params)
    on = make_llm(max_model_len=1024, enable_prefix_caching=True, max_num_batched_tokens=max_num_batched_tokens)
    got = run_chats(on, openings, users, end, params)
    assert_same_turns(got, expected)
    assert len(got[-1][0].prompt_token_ids) > 300
    assert [o.num_cached_tokens for o in got[0]] == [0, 0], "first turns run in one step: nothing to share yet"
    for previous, current in zip(got, got[1:]):
        assert [o.num_cached_tokens for o in current] == [expected_hit(o) for o in previous]
    stats = on.engine.prefix_cache_stats
    assert stats.num_hits == 18 and stats.hit_rate > 0.8


def test_prompts_sharing_none_one_block_many_blocks_or_all_but_one_token(make_llm):
    base, other = random_prompts((150, 60), seed=3)
    # states saved at 16, 96, and 48 and 64 for a prompt of whole blocks (the shared one before its last token, the
    # rolling one at its end, published when it finished)
    warm = [base[:20], base[:100], base[:64]]
    queries = [other[:40], base[:16] + other[:30], base[:96] + other[:10], base[:99], base[:100], base[:63],
               base[:64]]
    hits = [0, 16, 96, 96, 96, 48, 48]  # at least one token is computed: base[:64] cannot use the state at 64
    params = [SamplingParams(max_tokens=6, ignore_eos=True, **SAMPLING_KINDS[i % 3]) for i in range(len(queries))]
    results = {}
    for caching in (False, True):
        llm = make_llm(enable_prefix_caching=caching)
        for prompt in warm:
            llm.generate(as_inputs([prompt]), params[0], use_tqdm=False)
        results[caching] = llm.generate(as_inputs(queries), params, use_tqdm=False)
    assert token_ids(results[True]) == token_ids(results[False])
    assert [o.num_cached_tokens for o in results[True]] == hits


def test_a_hit_skips_the_prefill_of_the_cached_prefix(make_llm):
    llm = make_llm(enable_prefix_caching=True)
    (prompt,) = random_prompts((70,), seed=4)
    first = llm.generate(as_inputs([prompt]), greedy(9), use_tqdm=False)[0]
    steps = record_steps(llm)
    follow_up = prompt + first.outputs[0].token_ids + [7, 8, 9, 10, 11]
    second = llm.generate(as_inputs([follow_up]), greedy(5), use_tqdm=False)[0]
    assert second.num_cached_tokens == 64 == (70 + 9 - 1) // BS * BS
    new = steps[0].new_reqs[0]
    assert new.num_computed_tokens == 64 and new.restore_snapshot_slot is not None
    rid = second.request_id
    scheduled = sum(s.num_scheduled_tokens[rid] + s.num_lookahead_tokens.get(rid, 0) for s in steps)
    assert scheduled == len(follow_up) - 64 + 5 - 1, "only the uncached tokens and the decodes were computed"


def test_a_request_of_a_prompt_being_computed_waits_for_it_and_reuses_its_pages(make_llm):
    """Two requests of one prompt queued together: the second waits until the first's prompt is cached and then
    computes only its last partial block; a request of another prompt queued between them is not held up."""
    prompt, other = random_prompts((50, 30), seed=5)
    params = greedy(4)
    llm = make_llm(enable_prefix_caching=True)
    steps = record_steps(llm)
    together = llm.generate(as_inputs([prompt, other, prompt]), params, use_tqdm=False)
    assert [o.num_cached_tokens for o in together] == [0, 0, 48]
    first, second, third = (o.request_id for o in together)
    assert [r.req_id for r in steps[0].new_reqs] == [first, second], "the repeat waits, the other prompt does not"
    admitted = next(i for i, s in enumerate(steps) if third in {r.req_id for r in s.new_reqs})
    assert admitted <= 2 and steps[admitted].num_scheduled_tokens[third] == 2
    assert llm.engine.prefix_cache_stats.num_cached_blocks == 3 + 2, "one copy of each computed block is indexed"
    later = llm.generate(as_inputs([prompt]), params, use_tqdm=False)[0]
    assert later.num_cached_tokens == 48
    assert token_ids([later]) == token_ids(together[:1]) == token_ids(together[2:])
    with make_llm(enable_prefix_caching=False) as plain:
        assert token_ids(plain.generate(as_inputs([prompt, other, prompt]), params, use_tqdm=False)) == \
            token_ids(together)


def test_prompts_that_share_a_system_prompt_share_its_state_from_the_second_on(make_llm):
    """A prompt that parts from a cached one where no snapshot is (a shared system prompt, then its own message)
    computes its first chunk up to there and saves a snapshot, which the next such prompt restores; one queued
    with it waits for that snapshot. The tokens are those of an engine without caching."""
    system, *messages = random_prompts((300, 9, 9, 9, 9), seed=7)
    prompts = [system + m for m in messages]
    params = greedy(3)
    llm = make_llm(enable_prefix_caching=True)
    steps = record_steps(llm)
    first, second = llm.generate(as_inputs(prompts[:1]), params, use_tqdm=False) + llm.generate(
        as_inputs(prompts[1:2]), params, use_tqdm=False)
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 0), "no snapshot inside the system prompt yet"
    (admitted,) = [s for s in steps if second.request_id in {n.req_id for n in s.new_reqs}]
    assert admitted.num_scheduled_tokens[second.request_id] == 288, "its first chunk ends where it parts"
    assert [position for _, _, position in admitted.snapshot_saves] == [288]
    together = llm.generate(as_inputs(prompts[2:]), params, use_tqdm=False)
    assert [o.num_cached_tokens for o in together] == [288, 288]
    with make_llm(enable_prefix_caching=False) as plain:
        assert token_ids(plain.generate(as_inputs(prompts), params, use_tqdm=False)) == token_ids(
            [first, second, *together])


def test_a_request_queued_with_a_branching_one_waits_for_its_snapshot(make_llm):
    system, *messages = random_prompts((300, 9, 9, 9), seed=8)
    llm = make_llm(enable_prefix_caching=True)
    llm.generate(as_inputs([system + messages[0]]), greedy(2), use_tqdm=False)
    outs = llm.generate(as_inputs([system + m for m in messages[1:]]), greedy(2), use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 288]


@pytest.mark.parametrize("budget", [64, 200])
def test_a_branch_beyond_a_steps_budget_is_reached_by_a_later_chunk(make_llm, budget):
    """A step's budget ends the first chunk short of the branch (or past a block boundary before it): the chunks
    after it are cut to end there, and the snapshot is saved."""
    system, *messages = random_prompts((300, 9, 9, 9), seed=10)
    llm = make_llm(enable_prefix_caching=True, max_num_batched_tokens=budget)
    steps = record_steps(llm)
    outs = [llm.generate(as_inputs([system + m]), greedy(2), use_tqdm=False)[0] for m in messages]
    assert [o.num_cached_tokens for o in outs] == [0, 0, 288]
    rid = outs[1].request_id
    chunks = [s.num_scheduled_tokens[rid] for s in steps if rid in s.num_scheduled_tokens]
    assert 288 in itertools.accumulate(chunks), f"no chunk ended at the branch: {chunks}"


def test_no_branch_where_it_saves_little_the_prompts_own_snapshot_serves_or_no_slot_is_free(make_llm):
    """The cut costs a step: none for fewer than BRANCH_MIN_TOKENS tokens, none where the cached pages reach the
    prompt's own snapshot position (its prompt-end save serves there), and none when every snapshot slot is taken."""
    system, tail, other = random_prompts((300, 9, 9), seed=9)
    llm = make_llm(enable_prefix_caching=True)
    llm.generate(as_inputs([system + tail]), greedy(2), use_tqdm=False)
    cache = llm.engine.scheduler.cache
    assert cache.find_cached_prefix(Request("a", system + other, greedy(1))).branch_blocks == 18
    assert cache.find_cached_prefix(Request("b", system[:290], greedy(1))).branch_blocks == 0  # its prompt end: 288
    assert cache.find_cached_prefix(Request("c", system[:200] + other, greedy(1))).branch_blocks == 0  # 192 < 256
    taken = [cache.snapshots.allocate() for _ in range(cache.snapshots.num_available)]
    assert cache.find_cached_prefix(Request("d", system + other, greedy(1))).branch_blocks == 0
    for slot in taken:
        cache.snapshots.discard(slot)


def test_a_prompt_that_begins_with_a_computing_prompt_waits_for_its_snapshot(make_llm):
    """A request whose prompt extends a running request's prompt waits for that prompt's snapshot; a request that
    asks for prompt logprobs (which a hit would skip) does not wait."""
    (prompt,) = random_prompts((40,), seed=6)
    llm = make_llm(enable_prefix_caching=True)
    longer = prompt + [3, 4, 5, 6, 7, 8, 9, 10]
    outs = llm.generate(as_inputs([prompt, longer, longer]), [greedy(3), greedy(3),
                                                                SamplingParams(max_tokens=3, temperature=0,
                                                                               ignore_eos=True, prompt_logprobs=0)],
                        use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 32, 0]


def test_preempted_requests_come_back_through_their_cached_prefix(make_llm):
    """Three chats on a cache of 16 pages: turns preempt each other; a preempted request's full pages stay cached,
    so its recompute restarts from its last saved state, and all tokens match a large cache without caching."""
    off = make_llm(max_model_len=1024, enable_prefix_caching=False)
    openings, users, end = chat_setup(off.tokenizer, 3, num_turns=4)
    params = [SamplingParams(max_tokens=16, ignore_eos=True, **SAMPLING_KINDS[i]) for i in range(3)]
    expected = run_chats(off, openings, users, end, params)
    on = make_llm(max_model_len=1024, enable_prefix_caching=True, num_cache_blocks=16, max_num_batched_tokens=64)
    steps = record_steps(on)
    got = run_chats(on, openings, users, end, params)
    assert_same_turns(got, expected)
    assert on.engine.scheduler.num_preemptions > 0
    admissions = [n for s in steps for n in s.new_reqs]
    first = {}
    for n in admissions:
        first.setdefault(n.req_id, n)
    resumed = [n for n in admissions
               if n is not first[n.req_id] and n.num_computed_tokens > first[n.req_id].num_computed_tokens]
    assert resumed, "no preempted request was re-admitted from a cached prefix longer than it first had"
    assert on.engine.prefix_cache_stats.num_block_evictions > 0


def test_a_snapshot_pool_of_two_evicts_and_stays_exact(make_llm):
    off = make_llm(max_model_len=1024, enable_prefix_caching=False)
    openings, users, end = chat_setup(off.tokenizer, 3, num_turns=4)
    params = [greedy(8)] * 3
    expected = run_chats(off, openings, users, end, params)
    on = make_llm(max_model_len=1024, enable_prefix_caching=True, num_snapshot_slots=2)
    got = run_chats(on, openings, users, end, params)
    assert_same_turns(got, expected)
    stats = on.engine.prefix_cache_stats
    assert stats.num_snapshot_evictions > 0 and stats.num_snapshots <= 2
    assert stats.num_hits > 0, "the most recent snapshots still serve some turns"


def test_aborted_requests_leave_a_consistent_cache(make_llm):
    """With a budget of 32 tokens a step, the 60-token prompt is still prefilling when the 90-token one samples its
    first token: abort it there, and the 90-token one after 10 tokens. Its rolling state (at 96) is published, and
    later requests over both prefixes match an engine without caching."""
    long, short = random_prompts((90, 60), seed=6)
    params = greedy(20)
    on = make_llm(enable_prefix_caching=True, max_num_batched_tokens=32)
    stream = on.stream(as_inputs([long, short]), params)
    out = next(stream)
    assert out.request_id == "0" and on.engine.scheduler.requests["1"].num_computed_tokens < len(short)
    on.abort("1")
    while len(out.outputs[0].token_ids) < 10:
        out = next(stream)
    on.abort("0")
    assert list(stream) == []
    follow_ups = [long + out.outputs[0].token_ids + [3, 4, 5], long + [3, 4, 5], short + [3, 4, 5]]
    got = on.generate(as_inputs(follow_ups), params, use_tqdm=False)
    expected = make_llm(enable_prefix_caching=False).generate(as_inputs(follow_ups), params, use_tqdm=False)
    assert token_ids(got) == token_ids(expected)
    assert [o.num_cached_tokens for o in got] == [96, 80, 0]


def test_scheduler_saves_inside_the_prompt_at_its_last_full_block_and_at_each_boundary():
    """No model: a 37-token prompt on 16-token pages is computed in one step, its state saved inside it at 32;
    decoding saves the rolling state at 48 and 64, and finishing publishes the last one."""
    cache = CacheManager(num_blocks=16, num_slots=2, block_size=BS, num_snapshot_slots=4)
    scheduler = Scheduler(EngineConfig(block_size=BS, max_num_seqs=2, num_decode_steps=1), cache, max_model_len=256)
    scheduler.add_request(Request("a", list(range(1, 38)), greedy(30)))
    steps = [step(scheduler)[0] for _ in range(31)]
    assert [s.num_scheduled_tokens["a"] for s in steps[:3]] == [37, 1, 1]
    saves = {i: s.snapshot_saves for i, s in enumerate(steps) if s.snapshot_saves}
    assert [save[2] for save in saves[0]] == [32]
    assert list(saves) == [0, 48 - 37, 64 - 37], "step k >= 1 decodes position 36 + k"
    assert saves[11][0][1] == saves[27][0][1], "the rolling snapshot is one slot, rewritten"
    assert not scheduler.has_unfinished_requests() and cache.snapshots.num_committed == 2
    assert cache.find_cached_prefix(Request("b", list(range(1, 38)) + [1] * 40, SamplingParams())).block_ids
