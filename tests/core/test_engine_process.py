"""The engine process: outputs cross its pipe as deltas and come out whole, a start that fails says why in the
server's process, and a child that dies fails its requests and stops the client (the server answers 503)."""

from __future__ import annotations

import asyncio
import functools
import random

import pytest

from deltaserve import SamplingParams
from deltaserve.config import EngineConfig
from deltaserve.core.async_engine import EngineClient, EngineInput, EngineStoppedError, _Assembly
from deltaserve.core.engine_process import EngineProcess, _delta, _Sent
from deltaserve.core.outputs import CompletionOutput, Logprob, RequestOutput


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
