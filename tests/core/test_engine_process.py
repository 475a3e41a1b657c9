"""The engine process: outputs cross its pipe as deltas and come out whole, a start that fails says why in the
server's process, and a child that dies fails its requests and stops the client (the server answers 503)."""

from __future__ import annotations

import asyncio
import functools
import os
import random
import signal

import pytest

from deltaserve import SamplingParams
from deltaserve.config import EngineConfig
from deltaserve.core.async_engine import EngineClient, EngineInput, EngineStoppedError, _Assembly
from deltaserve.core.engine_process import EngineProcess, EngineThread, _delta, _Sent
from deltaserve.core.outputs import CompletionOutput, Logprob, RequestOutput
from deltaserve.sampling_params import StructuredOutputsParams


def _output(tokens: list[int], text: str, logprobs: bool, prompt_logprobs: list | None, finished: bool):
    entries = [{t: Logprob(-0.5 * t, 1, str(t))} for t in tokens] if logprobs else None
    completion = CompletionOutput(0, text, list(tokens), "length" if finished else None, None, entries,
                                  -sum(tokens) * 0.5 if logprobs else None)
    return RequestOutput("r", "p", [1, 2], [completion], finished, prompt_logprobs, {"arrival_time": 1.0}, 3)


@pytest.mark.parametrize("seed", range(6))
def test_deltas_rebuild_every_output_as_the_engine_made_it(seed):
    """Random steps of one request: lists that grow by 0-5 items a step, prompt logprobs that arrive over several
    chunks, with and without logprobs; and steps that only take items back (which the engine never outputs: it
    rewinds a step's own tokens before they leave it, but a delta would still say so)."""
    rng = random.Random(seed)
    logprobs = seed % 2 == 0
    tokens, text, prompt_logprobs = [], "", [None] if seed % 3 else None
    sent, assembly = _Sent(), _Assembly("p", [1, 2])
    for step in range(40):
        shrink = tokens and rng.random() < 0.15
        if shrink:
            del tokens[rng.randrange(len(tokens)):]
            text = text[:len(tokens)]
        new = [] if shrink else [rng.randrange(100) for _ in range(rng.randrange(6))]
        tokens += new
        text += "".join(chr(97 + t % 26) for t in new)
        if prompt_logprobs is not None and step < 4:
            prompt_logprobs.append({7: Logprob(-1.0, 1, "x")})
        expected = _output(tokens, text, logprobs, None if prompt_logprobs is None else list(prompt_logprobs),
                           step == 39)
        assert assembly.apply(_delta(expected, sent)) == expected


def _arguments(model: str, **options) -> tuple[str, EngineConfig]:
    return model, EngineConfig(device="cpu", threads=1, **options)


@pytest.mark.parametrize("model, options, words", [
    ("/nonexistent/model", {}, "/nonexistent"),
    ("/nonexistent/model", {"tensor_parallel_size": 2}, "tensor_parallel_size > 1"),
])
def test_a_start_that_fails_says_why_in_the_servers_process(model, options, words):
    process = EngineProcess(functools.partial(_arguments, model, **options))
    with pytest.raises(ValueError, match=words):
        process.info
    assert not process.process.is_alive()


def test_a_child_that_dies_fails_its_requests_and_stops_the_client(tiny_model):
    process = EngineProcess(functools.partial(_arguments, str(tiny_model), max_model_len=512))
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)

    async def main():
        client = EngineClient(process, max_queue=4)
        client.start()
        stream = await client.add([EngineInput([5, 6, 7], params)], "long")
        with pytest.raises(EngineStoppedError, match="engine stopped"):
            async for _, output in stream:
                if output.outputs[0].token_ids:
                    process.process.kill()
        assert not client.is_running and client.num_reserved == 0
        with pytest.raises(EngineStoppedError):
            await client.add([EngineInput([5], params)], "after")
        await client.shutdown()

    try:
        asyncio.run(asyncio.wait_for(main(), timeout=60))
    finally:
        process.close()


def test_the_child_ignores_ctrl_c(tiny_model):
    """Ctrl-C reaches the server's whole process group: the server drains its requests, then stops the child
    through the pipe. A child that died of the SIGINT would fail every request the drain was to finish."""
    process = EngineProcess(functools.partial(_arguments, str(tiny_model), max_model_len=512))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    async def main():
        client = EngineClient(process, max_queue=4)
        client.start()
        os.kill(process.process.pid, signal.SIGINT)  # the child is idle, blocked on its pipe: it wakes at once
        outputs = [o async for _, o in await client.add([EngineInput([5, 6, 7], params)], "after-ctrl-c")]
        alive = process.process.is_alive()
        await client.shutdown()
        return outputs[-1].finished, len(outputs[-1].outputs[0].token_ids), alive

    try:
        assert asyncio.run(asyncio.wait_for(main(), timeout=60)) == (True, 8, True)
    finally:
        process.close()


def test_a_child_that_dies_fails_the_adds_and_compiles_it_had_not_answered(tiny_model):
    """An add and a compile sent to a child that dies before it answers them (stopped with SIGSTOP, so that it
    cannot): both fail with EngineStoppedError (their handlers answer 503, never wait forever) and the add's place
    under the bound is given back."""
    process = EngineProcess(functools.partial(_arguments, str(tiny_model), max_model_len=512))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    async def main():
        client = EngineClient(process, max_queue=4)
        client.start()
        os.kill(process.process.pid, signal.SIGSTOP)
        add = asyncio.ensure_future(client.add([EngineInput([5, 6, 7], params)], "unanswered"))
        compiled = client.compile(StructuredOutputsParams(regex="[ab]{2}"))
        while not client._adds:
            await asyncio.sleep(0)
        reserved = client.num_reserved
        process.process.kill()
        with pytest.raises(EngineStoppedError, match="engine stopped"):
            await add
        with pytest.raises(EngineStoppedError, match="engine stopped"):
            await compiled
        state = reserved, client.num_reserved, client.is_running
        await client.shutdown()
        return state

    try:
        assert asyncio.run(asyncio.wait_for(main(), timeout=60)) == (1, 0, False)
    finally:
        process.close()


def test_a_message_that_does_not_pickle_fails_alone(make_llm):
    """A message that does not pickle fails its own request, and the writer thread lives on (else every later add
    would wait forever while /health answers 200): an add whose prompt cannot be pickled, and a JSON schema nested
    600 deep (the body parses; pickling it would recurse too deep), which the client refuses by its depth before
    sending it."""
    core = EngineThread(make_llm().engine)
    schema = {"type": "integer"}
    for _ in range(600):
        schema = {"type": "array", "items": schema}
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    async def main():
        client = EngineClient(core, max_queue=4)
        client.start()
        try:
            with pytest.raises(ValueError, match="cannot be sent to the engine"):
                await asyncio.wait_for(client.add([EngineInput([5, 6, 7], params, prompt=lambda: 0)], "bad"), 5)
            with pytest.raises(ValueError, match="deeper than 32"):
                await asyncio.wait_for(client.compile(StructuredOutputsParams(json=schema)), 5)
            stream = await asyncio.wait_for(client.add([EngineInput([5, 6, 7], params)], "after"), 5)
            assert client.num_reserved == 1
            return [o async for _, o in stream][-1].finished
        finally:
            await client.shutdown()

    try:
        assert asyncio.run(main())
    finally:
        core.close()


def test_a_compile_that_raises_other_than_valueerror_fails_alone(make_llm, monkeypatch):
    """A compile whose submit raises something other than a ValueError (a bug, a RecursionError in a parser) is
    answered with that error as a RuntimeError (a 500), and the core loop serves on: one request never ends the
    engine process."""
    engine = make_llm().engine
    core = EngineThread(engine)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    def broken_submit(spec):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(engine.structured_outputs(), "submit", broken_submit)

    async def main():
        client = EngineClient(core, max_queue=4)
        client.start()
        try:
            with pytest.raises(RuntimeError, match="recursion"):
                await client.compile(StructuredOutputsParams(regex="[ab]{2}"))
            assert client.is_running
            return [o async for _, o in await client.add([EngineInput([5, 6, 7], params)], "after")][-1].finished
        finally:
            await client.shutdown()

    assert asyncio.run(asyncio.wait_for(main(), timeout=60))


def test_the_child_ignores_a_sigterm_to_the_group(tiny_model):
    """systemd (KillMode=control-group), `kill -TERM -PGID` and tini -g send SIGTERM to the child too: it must
    live until the server has drained and stops it, as for Ctrl-C."""
    process = EngineProcess(functools.partial(_arguments, str(tiny_model), max_model_len=512))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    async def main():
        client = EngineClient(process, max_queue=4)
        client.start()
        try:
            os.kill(process.process.pid, signal.SIGTERM)
            return [o async for _, o in await client.add([EngineInput([5, 6, 7], params)], "after")][-1].finished
        finally:
            await client.shutdown()

    try:
        assert asyncio.run(asyncio.wait_for(main(), timeout=60))
    finally:
        process.close()
