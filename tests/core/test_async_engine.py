"""EngineClient between asyncio handlers and the synchronous Engine, over the engine's core loop in a thread of this
process (EngineThread: so that a test can break a step; tests/core/test_engine_process.py runs it in a process).

Adds are all or none, an abort frees the request's pages and slot between steps and ends its stream, the bound
on requests in flight holds, and a failed step fails only the requests it ran (the loop goes on).
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from deltaserve import SamplingParams
from deltaserve.core.async_engine import EngineClient, EngineInput, QueueFullError, RequestStream
from deltaserve.core.engine_process import EngineThread
from deltaserve.core.outputs import CompletionOutput, RequestOutput


def run(make_llm, body, max_queue: int = 4, **options):
    """asyncio.run(body(client, engine)) with the client started and shut down around it."""
    engine = make_llm(**options).engine

    async def main():
        client = EngineClient(EngineThread(engine), max_queue)
        client.start()
        try:
            return await asyncio.wait_for(body(client, engine), timeout=60)
        finally:
            await client.shutdown()

    return asyncio.run(main())


def break_next_step(engine) -> None:
    """The engine's next step raises RuntimeError("boom"); the steps after it run as before."""
    step = engine.step

    def broken_step():
        engine.step = step
        raise RuntimeError("boom")

    engine.step = broken_step


def greedy(max_tokens: int, prompt=(5, 6, 7)) -> EngineInput:
    return EngineInput(list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))


def test_outputs_reach_their_stream_until_finished(make_llm):
    async def body(client, engine):
        stream = await client.add([greedy(3), greedy(5, (9, 10))], "r")
        return [(index, output.finished, len(output.outputs[0].token_ids)) async for index, output in stream]

    seen = run(make_llm, body)
    assert [(i, n) for i, done, n in seen if done] == [(0, 3), (1, 5)]
    assert all(n >= 1 for _, _, n in seen)


def test_add_is_all_or_none(make_llm):
    async def body(client, engine):
        with pytest.raises(ValueError, match="out of range"):
            await client.add([greedy(3), greedy(3, (1, 10**6))], "bad")
        assert not engine.has_unfinished_requests() and client.num_reserved == 0
        return [o async for o in await client.add([greedy(2)], "good")]

    assert run(make_llm, body)[-1][1].finished


def test_abort_frees_the_cache_between_steps_and_ends_the_stream(make_llm):
    async def body(client, engine):
        cache = engine.scheduler.cache
        stream = await client.add([greedy(400)], "long")
        async for _, output in stream:
            assert cache.num_free_blocks < cache.num_blocks
            stream.abort()
        while engine.has_unfinished_requests():
            await asyncio.sleep(0.01)
        return output, cache.num_free_blocks == cache.num_blocks, client.num_reserved

    last, cache_full, reserved = run(make_llm, body)
    assert not last.finished and cache_full and reserved == 0


def test_requests_beyond_running_plus_queue_are_refused(make_llm):
    async def body(client, engine):
        held = await client.add([greedy(50), greedy(50)], "held")  # max_num_seqs 1 + max_queue 1
        with pytest.raises(QueueFullError, match="capacity"):
            await client.add([greedy(1)], "refused")
        held.abort()
        while client.num_reserved:  # the abort is applied at the next step boundary
            await asyncio.sleep(0.01)
        return [o async for o in await client.add([greedy(1)], "after")]

    assert run(make_llm, body, max_queue=1, max_num_seqs=1)[-1][1].finished


def test_a_failed_step_fails_its_requests_and_the_loop_goes_on(make_llm):
    async def body(client, engine):
        break_next_step(engine)
        with pytest.raises(RuntimeError, match="boom"):
            [o async for o in await client.add([greedy(3)], "first")]
        return [o async for o in await client.add([greedy(3)], "second")]

    assert run(make_llm, body)[-1][1].finished


def test_a_failed_step_spares_the_adds_queued_while_it_ran(make_llm):
    async def body(client, engine):
        step, queued = engine.step, threading.Event()

        def broken_step():
            queued.wait(timeout=30)  # fail only once "second" waits in the queue
            engine.step = step
            raise RuntimeError("boom")

        engine.step = broken_step
        first = await client.add([greedy(3)], "first")
        second = asyncio.ensure_future(client.add([greedy(3)], "second"))
        while not client._adds:
            await asyncio.sleep(0.001)
        queued.set()
        with pytest.raises(RuntimeError, match="boom"):
            [o async for o in first]
        return [o async for o in await second], client.num_reserved

    outputs, reserved = run(make_llm, body)
    assert outputs[-1][1].finished and reserved == 0


def test_a_lagging_consumer_gets_each_requests_latest_output_once():
    """Outputs are cumulative: two steps' outputs waiting together are one item a request, the later one."""

    def output(req_id: str, num_tokens: int, finished: bool = False) -> RequestOutput:
        completion = CompletionOutput(0, "", list(range(num_tokens)), "length" if finished else None)
        return RequestOutput(req_id, None, [5], [completion], finished)

    async def body():
        stream = RequestStream(owner=None, req_ids=["a", "b"])
        for item in (output("a", 1), output("b", 1), output("a", 2), output("b", 2, finished=True)):
            stream._put(item)
        first = [(i, len(o.outputs[0].token_ids), o.finished) async for i, o in _take(stream, 2)]
        stream._put(output("a", 3, finished=True))
        return first, [(i, len(o.outputs[0].token_ids), o.finished) async for i, o in stream]

    first, rest = asyncio.run(body())
    assert first == [(0, 2, False), (1, 2, True)]
    assert rest == [(0, 3, True)]


async def _take(stream, count: int):
    """The first `count` items of a stream's iteration (the stream stays usable)."""
    iterator = aiter(stream)
    for _ in range(count):
        yield await anext(iterator)


def held(client, engine, req_id: str) -> bool:
    """Whether the engine still holds req_id, or its core loop still routes it."""
    return req_id in engine._tracked or req_id in client.handle.core.sent


def test_an_add_whose_handler_left_before_its_answer_is_taken_back(make_llm):
    """A handler cancelled while its add is on its way to the engine (the client disconnected): the request must not
    run on (its answer aborts it) and its place under the bound is given back. A later add travels the same pipe,
    so once it is answered the first has been dealt with."""

    async def body(client, engine):
        add = asyncio.ensure_future(client.add([greedy(400)], "left"))
        while not client._adds:
            await asyncio.sleep(0)
        add.cancel()
        while client._adds:  # answered: the abort it calls for is sent before the next add
            await asyncio.sleep(0)
        probe = await client.add([greedy(1)], "probe")
        left_held = held(client, engine, "left-0")
        outputs = [o async for o in probe]
        return add.cancelled(), left_held, outputs[-1][1].finished, client.num_reserved

    assert run(make_llm, body) == (True, False, True, 0)


def test_an_add_cancelled_just_after_it_was_queued_is_aborted(make_llm):
    """The engine queued the request, then the handler was cancelled before it resumed (the answer and the
    cancellation cross): add() raises CancelledError and must abort the request it can no longer hand back, else it
    runs to its end for no one and holds its place under the bound."""

    async def body(client, engine):
        add = asyncio.ensure_future(client.add([greedy(400)], "late"))
        while not client._adds:
            await asyncio.sleep(0)
        pending = list(client._adds.values())[-1]
        while not pending.added.done():  # answered; add() resumes only at the loop's next turn
            await asyncio.sleep(0)
        add.cancel()
        with pytest.raises(asyncio.CancelledError):
            await add
        probe = await client.add([greedy(1)], "probe")  # the abort went the same way, before it
        late_held = held(client, engine, "late-0")
        outputs = [o async for o in probe]
        return late_held, outputs[-1][1].finished, client.num_reserved

    assert run(make_llm, body) == (False, True, 0)


def test_a_failed_steps_requests_leave_the_engine_before_their_streams_fail(make_llm):
    """A failed step's requests are aborted in the engine before their handlers
    hear of it: else they would run on to their end, unseen, with their pages and slots (the stream's error is
    the only sign the client gets). Long requests, so that one left running is still there when the error comes."""

    async def body(client, engine):
        break_next_step(engine)
        stream = await client.add([greedy(400), greedy(400, (9, 10))], "failed")
        with pytest.raises(RuntimeError, match="boom"):
            [o async for o in stream]
        return [held(client, engine, f"failed-{i}") for i in range(2)], client.num_reserved

    assert run(make_llm, body) == ([False, False], 0)


def test_compile_refusals_keep_their_kind_and_field(make_llm, monkeypatch):
    """compile() is how the server tells a bad constraint (400 naming the field: GrammarError.param) from a busy
    compile pool (429: CompilesBusy); from the engine process these cross the pipe as (kind, message, param), so each
    must come out as the same class, message and param as raised. A good constraint compiles."""
    from deltaserve.sampling_params import StructuredOutputsParams
    from deltaserve.structured import errors

    async def body(client, engine):
        await client.compile(StructuredOutputsParams(regex="[ab]{3}"))
        with pytest.raises(errors.GrammarError, match="parenthesis is not closed") as bad:
            await client.compile(StructuredOutputsParams(regex="a(b"))
        manager = engine.structured_outputs()
        release, compile_ = threading.Event(), manager._compile
        monkeypatch.setattr(manager, "_compile", lambda spec: release.wait(30) and compile_(spec))
        monkeypatch.setattr(errors, "MAX_COMPILES_IN_FLIGHT", 1)
        blocked = client.compile(StructuredOutputsParams(regex="[cd]{3}"))
        try:
            with pytest.raises(errors.CompilesBusy, match="1 constraints are compiling already"):
                await client.compile(StructuredOutputsParams(regex="[ef]{3}"))
        finally:
            release.set()
        await blocked
        return bad.value.param

    assert run(make_llm, body) == "regex"


def test_the_pipes_halves_forget_every_request_that_ended(make_llm):
    """The bookkeeping of a request on both sides of the pipe (the core's _Sent, the client's _Assembly) goes when it
    ends: finished, aborted, or failed with its step. A server runs for weeks: one entry left per request is a
    leak, and a child that still thinks a request routed would send its deltas to no one."""

    async def body(client, engine):
        core = client.handle.core
        [o async for o in await client.add([greedy(3)], "finished")]
        after_finish = (dict(client._assemblies), dict(core.sent))
        stream = await client.add([greedy(400)], "aborted")
        async for _ in stream:
            stream.abort()
        [o async for o in await client.add([greedy(1)], "probe")]  # the abort reached the child before it
        after_abort = (dict(client._assemblies), dict(core.sent))
        break_next_step(engine)
        with pytest.raises(RuntimeError, match="boom"):
            [o async for o in await client.add([greedy(400)], "failed")]
        return after_finish, after_abort, (dict(client._assemblies), dict(core.sent))

    assert run(make_llm, body) == (({}, {}),) * 3
