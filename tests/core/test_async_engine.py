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
        step = engine.step

        def broken_step():
            engine.step = step
            raise RuntimeError("boom")

        engine.step = broken_step
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
