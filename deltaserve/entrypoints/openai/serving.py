"""What the completions and chat endpoints share: limits checked before tokenizing, sampling parameters,
handing requests to the EngineClient, watching for a client that leaves, and server-sent events."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from deltaserve.core.async_engine import EngineClient, EngineInput, EngineStoppedError, QueueFullError, RequestStream
from deltaserve.core.outputs import RequestOutput
from deltaserve.entrypoints.chat_tools import ChatPrompt, ToolRequestError, render_chat_prompt
from deltaserve.entrypoints.openai.errors import OpenAIError, bad_request, error_body
from deltaserve.entrypoints.openai.protocol import GUIDED_FIELDS, SamplingFields
from deltaserve.entrypoints.openai.request_body import read_body
from deltaserve.sampling_params import GENERATION_CONFIG_FIELDS, ParamError, SamplingParams, StructuredOutputsParams
from deltaserve.tokenizer import ChatTemplateError

log = logging.getLogger("deltaserve")


# a text prompt this long or longer is tokenized in one of TOKENIZE_THREADS worker threads (the tokenizers give up the
# GIL while they encode a long text), so the event loop keeps streaming the other requests' tokens meanwhile; a
# shorter one holds the loop for about a millisecond, a few times the hand-off to a thread
OFF_LOOP_CHARS = 1 << 13
TOKENIZE_THREADS = 2  # long prompts tokenized (or chats rendered) at once, at most (each holds its text meanwhile)
# large bodies parsed and large responses rendered at once, at most: threads of their own, so that a long prompt's
# tokenizing (which gives up the GIL) does not queue behind seconds of JSON work (which holds it)
BULK_THREADS = 2
OFF_LOOP_ITEMS = 256  # a chat with this many messages and tools or more is rendered in a thread
OFF_LOOP_ENTRIES = 1 << 14  # a response of this many logprob entries or more is built and rendered in a thread
RENDER_PIECE = 1 << 14  # values of a long list rendered as JSON in one call
# the request body's default limit: BODY_BYTES_A_TOKEN for each token of the model's length (a prompt that fills the
# context fits as JSON token ids, at most 8 bytes each with a space, or as typical text, escaped or not) plus 1 MiB
# for the rest of the body, at least MIN_BODY_BYTES
BODY_BYTES_A_TOKEN = 16
MIN_BODY_BYTES = 4 << 20
MIN_ECHO_LOGPROBS = 1 << 20
TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")  # a logit_bias key: a token id in decimal (int64 tensors hold it)


def echo_logprobs_limit(max_model_len: int) -> int:
    """The most prompt logprob entries (prompt tokens x n x (logprobs + 1)) one completions request may ask for with
    echo: a prompt of the model's whole context with logprobs 1 fits (lm-eval's loglikelihood), and never less than
    MIN_ECHO_LOGPROBS. Each entry is built and rendered on the event loop (a few microseconds: BENCHMARKS.md), and a
    small body of token ids could otherwise ask for millions (a 0.15 MiB body made a 110 MB response)."""
    return max(MIN_ECHO_LOGPROBS, 2 * max_model_len)


def body_limit(max_model_len: int) -> int:
    """The request body's limit in bytes when --max-body-bytes is not given: a prompt of the model's whole
    context fits (a 1M-token context: 17 MiB), and never less than MIN_BODY_BYTES."""
    return max(MIN_BODY_BYTES, BODY_BYTES_A_TOKEN * max_model_len + (1 << 20))


# OpenAI's defaults of the sampling fields a model folder's generation_config.json may set, which are SamplingParams'
OPENAI_SAMPLING = {name: getattr(SamplingParams(), name) for name in GENERATION_CONFIG_FIELDS}


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    max_body_bytes: int | None = None  # None: body_limit of the engine's model length
    max_queue: int = 256  # engine requests that may wait beyond the max_num_seqs running ones
    default_seed: int | None = None  # for requests that send no seed (the serve command's --seed)
    # sampling fields a request leaves out take these (the model folder's generation_config.json, as vLLM applies
    # it: sampling_params.generation_defaults), else OpenAI's (temperature 1, top_p 1, no top_k, min_p or penalty)
    sampling_defaults: dict = field(default_factory=dict)


class ClientGone(Exception):
    """The client disconnected before its non-streaming answer was ready."""


class ServingContext:
    def __init__(self, async_engine: EngineClient, config: ServerConfig):
        self.async_engine = async_engine
        self.config = config
        self.tokenizer = async_engine.info.tokenizer
        self.max_model_len = async_engine.info.max_model_len
        self.cache_tokens = async_engine.info.cache_tokens
        self.max_token_bytes = _longest_token_bytes(self.tokenizer)
        self._tokenize_pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="deltaserve-tokenize")
        self._bulk_pool = ThreadPoolExecutor(BULK_THREADS, thread_name_prefix="deltaserve-bulk")

    def close(self) -> None:
        """Let the worker threads go: a prompt being tokenized or a body being parsed finishes, queued ones are
        dropped (the server is stopping; their requests end with it)."""
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self._bulk_pool.shutdown(wait=False, cancel_futures=True)

    def token_text(self, token_id: int, entry: dict | None) -> str:
        """A token as logprobs show it: its text, or token_id:N for a model without a tokenizer."""
        logprob = entry.get(token_id) if entry else None
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"token_id:{token_id}"

    def token_bytes(self, token_id: int, text: str) -> bytes:
        """The bytes a token adds to the text (part of a character for some byte-level tokens, whose text is then
        U+FFFD): OpenAI's logprobs `bytes`, which joined rebuild the text. text's UTF-8 for a model without a
        tokenizer, or an id the vocabulary lacks."""
        raw = self.tokenizer.id_to_bytes(token_id) if self.tokenizer is not None else b""
        return raw or text.encode("utf-8", "replace")

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.served_model_name:
            raise OpenAIError(404, f"The model '{name}' does not exist; this server serves "
                                   f"'{self.config.served_model_name}' (GET /v1/models)", "model", "model_not_found")

    def check_request(self, body: SamplingFields) -> None:
        """What both endpoints refuse before any tokenizing: another model, unsupported fields."""
        self.check_model(body.model)
        if body.stream_options is not None and not body.stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
        for name, kind in GUIDED_FIELDS.items():
            if getattr(body, name) is not None:
                raise bad_request(f"'{name}' is vLLM's old name, which this server does not read; send "
                                  f"\"structured_outputs\": {{\"{kind}\": ...}} instead", name)

    def response_meta(self, request_id: str) -> dict:
        """The id, created, model and system_fingerprint fields that every response and chunk of a request carries
        (the fingerprint null: OpenAI's API lists the field; there is no backend configuration to fingerprint)."""
        return dict(id=request_id, created=int(time.time()), model=self.config.served_model_name,
                    system_fingerprint=None)

    def need_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise bad_request(f"{what} needs a tokenizer and this model folder has none; send token ids as "
                              "'prompt' to /v1/completions instead")
        return self.tokenizer

    async def encode(self, text: str, param: str, add_special_tokens: bool) -> list[int]:
        """Token ids of a text prompt (add_special_tokens: the tokenizer's BOS before it; encode_prompt); a text
        that cannot fit the context is refused before it is tokenized. A text of OFF_LOOP_CHARS or more is
        tokenized in a worker thread, off the event loop."""
        tokenizer = self.need_tokenizer("a text prompt")
        try:
            num_bytes = len(text.encode("utf-8"))
        except UnicodeEncodeError as e:
            raise bad_request(f"'{param}' holds an unpaired UTF-16 surrogate at character {e.start}; "
                              "send valid Unicode text", param) from e
        min_tokens = -(-num_bytes // self.max_token_bytes)  # no token covers more than max_token_bytes bytes
        if min_tokens >= self.max_model_len:
            raise bad_request(f"'{param}' is {num_bytes} bytes, at least {min_tokens} tokens, and this model's "
                              f"maximum context length is {self.max_model_len} tokens; shorten it", param)
        if len(text) < OFF_LOOP_CHARS:
            return tokenizer.encode_prompt(text, add_special_tokens)
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, tokenizer.encode_prompt, text,
                                                                add_special_tokens)

    async def render_chat(self, messages: list, as_dict, tools: list[dict] | None, tool_choice,
                          parallel_tool_calls: bool = True) -> ChatPrompt:
        """The prompt text of messages (each made a template's dict by as_dict), and whether to read tool calls out
        of the output (tools with tool_choice "auto"). With OFF_LOOP_ITEMS or more messages and tools, both steps run
        in a worker thread: they are Python, and the event loop gets the GIL between their slices."""
        tokenizer = self.need_tokenizer("chat")

        def render() -> ChatPrompt:
            return render_chat_prompt(tokenizer, [as_dict(m) for m in messages], tools, tool_choice,
                                      parallel_tool_calls=parallel_tool_calls)

        try:
            if len(messages) + len(tools or ()) < OFF_LOOP_ITEMS:
                return render()
            return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, render)
        except ToolRequestError as e:
            raise bad_request(str(e), e.param) from e
        except ChatTemplateError as e:
            raise bad_request(f"the chat template cannot render these messages: {e}", "messages") from e

    async def read_body(self, request: Request, model: type[BaseModel]) -> BaseModel:
        """The request's JSON body as model; one of request_body.OFF_LOOP_BYTES or more is parsed and validated in a
        bulk worker thread (request_body.read_body)."""
        return await read_body(request, model, self._bulk_pool)

    async def respond(self, build: Callable[[], dict], entries: int) -> Response:
        """The JSON response that build() makes. One of OFF_LOOP_ENTRIES logprob entries or more is built and rendered
        in a bulk worker thread, its long lists about RENDER_PIECE values a call (render_json), so that the event loop
        gets the GIL between them (BENCHMARKS.md, "Bodies validated in pieces")."""
        if entries < OFF_LOOP_ENTRIES:
            return JSONResponse(build())
        body = await asyncio.get_running_loop().run_in_executor(self._bulk_pool, lambda: render_json(build()))
        return Response(body, media_type="application/json")

    def check_length(self, num_prompt_tokens: int, max_tokens: int, param: str) -> None:
        if num_prompt_tokens + max_tokens > self.max_model_len or num_prompt_tokens >= self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {param}, {max_tokens} in the "
                f"completion). Please reduce the length of the {param} or the completion.", param)

    def check_max_tokens(self, max_tokens: int | None, param: str) -> None:
        """Before tokenizing: a max_tokens that no prompt could go with."""
        if max_tokens is not None and max_tokens >= self.max_model_len:
            shown = max_tokens if max_tokens < 10**15 else f"{str(max_tokens)[:6]}... ({len(str(max_tokens))} digits)"
            raise bad_request(f"'{param}' = {shown} must be less than this model's maximum context length "
                              f"({self.max_model_len} tokens, which includes the prompt)", param)

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        return max(0, min(self.max_model_len, self.cache_tokens) - num_prompt_tokens)

    def check_echo_logprobs(self, num_prompt_tokens: int, n: int, logprobs: int) -> None:
        """Refuse an echo with logprobs whose prompt logprob entries pass echo_logprobs_limit."""
        entries, limit = num_prompt_tokens * n * (logprobs + 1), echo_logprobs_limit(self.max_model_len)
        if entries > limit:
            raise bad_request(f"echo with logprobs asks for {entries:,} prompt logprob entries ({num_prompt_tokens:,} "
                              f"prompt tokens x n {n} x (logprobs {logprobs} + 1)) and this server renders at most "
                              f"{limit:,} a request; lower logprobs or n, or send fewer prompt tokens a request",
                              "logprobs")

    def check_fanout(self, num_inputs: int) -> None:
        if num_inputs > self.async_engine.capacity:
            raise bad_request(f"this request needs {num_inputs} sequences (prompts x n) but the server runs at most "
                              f"{self.async_engine.capacity} at once; lower n or send fewer prompts", "n")

    def sampling_params(self, body: SamplingFields, max_tokens: int, logprobs: int | None = None,
                        prompt_logprobs: int | None = None,
                        structured: StructuredOutputsParams | None = None) -> list[SamplingParams]:
        """One SamplingParams per choice; with a seed, choice i uses seed + i so that choices differ."""
        seed = body.seed if body.seed is not None else self.config.default_seed
        given = {name: getattr(body, name) for name in GENERATION_CONFIG_FIELDS if getattr(body, name) is not None}
        fields = dict(
            max_tokens=max_tokens, **{**OPENAI_SAMPLING, **self.config.sampling_defaults, **given},
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0, stop_token_ids=body.stop_token_ids or [],
            stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or ()), ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            structured_outputs=structured, logit_bias=logit_bias(body.logit_bias),
            allowed_token_ids=body.allowed_token_ids)
        try:
            return [SamplingParams(seed=None if seed is None else seed + i, **fields) for i in range(body.n)]
        except ParamError as e:  # a request field of the same name (max_tokens was checked before, by its own)
            raise bad_request(str(e).removeprefix("SamplingParams."), e.field) from e

    async def start(self, inputs: list[EngineInput], request_id: str,
                    request: Request) -> tuple[RequestStream, asyncio.Task]:
        """Queue inputs; returns their stream and a task that aborts it when the client disconnects."""
        try:
            stream = await self.async_engine.add(inputs, request_id)
        except QueueFullError as e:
            raise OpenAIError(429, str(e), None, "queue_full", {"retry-after": "1"}) from e
        except EngineStoppedError as e:
            raise OpenAIError(503, str(e), None, "unavailable") from e
        except ValueError as e:  # a ParamError names the request's field (a prompt's token id out of range: prompt)
            raise bad_request(str(e), getattr(e, "field", None)) from e
        return stream, asyncio.get_running_loop().create_task(_abort_on_disconnect(request, stream))

    async def collect(self, stream: RequestStream, watcher: asyncio.Task) -> list[RequestOutput]:
        """Every request's final output, in input order (non-streaming)."""
        final: dict[int, RequestOutput] = {}
        try:
            async for index, output in stream:
                final[index] = output
        except EngineStoppedError as e:  # the engine died mid-request: unavailable, as a request after it is told
            raise OpenAIError(503, str(e), None, "unavailable") from e
        finally:
            stream.abort()
            watcher.cancel()
        if len(final) != len(stream.req_ids) or not all(o.finished for o in final.values()):
            raise ClientGone()
        return [final[i] for i in range(len(final))]

    def sse(self, events: AsyncIterator[dict], stream: RequestStream, watcher: asyncio.Task) -> StreamingResponse:
        async def body():
            try:
                try:
                    async for event in events:
                        yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
                except EngineStoppedError as e:  # headers are sent: in-band, as a request after it is told (503)
                    log.warning("stream ended: %s", e)
                    yield f"data: {json.dumps(error_body(503, str(e), None, 'unavailable'))}\n\n"
                except Exception as e:  # headers are sent: report in-band, as OpenAI does
                    log.exception("stream failed")
                    yield f"data: {json.dumps(error_body(500, f'the stream failed: {e}'))}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                stream.abort()
                watcher.cancel()

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", "x-accel-buffering": "no"})


async def respond_or_gone(make_response) -> Response:
    """Await a non-streaming response; a client that left gets nothing meaningful back (499, as nginx logs it)."""
    try:
        return await make_response
    except ClientGone:
        return Response(status_code=499)


def render_json(content) -> bytes:
    """content as JSONResponse renders it, byte for byte, with each long list rendered in pieces of about
    RENDER_PIECE values (its items, and their items a level down: a chat token's top logprobs); the lists and dicts
    above them are walked in Python, those inside a piece are not."""
    return _render(content).encode("utf-8")


_dumps = functools.partial(json.dumps, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


def _render(value) -> str:
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return "{" + ",".join(f"{_dumps(key)}:{_render(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list) and value:
        width = max(_width(item) for item in value[:8])  # values an item holds, by the first few
        step = RENDER_PIECE // width
        if len(value) > step > 0:
            return "[" + ",".join(_dumps(value[i:i + step])[1:-1] for i in range(0, len(value), step)) + "]"
        if isinstance(value[0], (dict, list)) or step == 0:  # a later item may hold a long list
            return "[" + ",".join(_render(item) for item in value) + "]"
    return _dumps(value)


def _width(item) -> int:
    """Values in item, counted to two levels (a logprob entry and its top logprobs)."""
    if not isinstance(item, (dict, list)):
        return 1
    inner = item.values() if isinstance(item, dict) else item
    return 1 + sum(len(v) if isinstance(v, (dict, list)) else 1 for v in inner)


async def _abort_on_disconnect(request: Request, stream: RequestStream) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    stream.abort()


def logit_bias(entries: dict[str, object] | None) -> dict[int, object] | None:
    """OpenAI's logit_bias, {"token id": bias}, keyed by token id (SamplingParams checks the values; the sampler clamps
    them to [-100, 100], as vLLM does); a key that is not a token id in decimal is a 400 naming it."""
    if not entries:
        return None
    bad = next((key for key in entries if not TOKEN_ID_KEY.fullmatch(key)), None)
    if bad is not None:
        raise bad_request(f"'logit_bias' key {bad!r:.40} is not a token id: keys are token ids written in decimal, "
                          "such as {\"1234\": -100}", "logit_bias")
    return {int(key): value for key, value in entries.items()}


def wants_usage(body: SamplingFields) -> bool:
    """Whether a stream ends with a usage chunk (and every chunk carries "usage": null before it)."""
    return body.stream_options is not None and body.stream_options.include_usage


def usage(outputs: list[RequestOutput], n: int) -> dict:
    """Token counts of outputs, n choices per prompt in order: each prompt counts once however many choices (its
    first choice's), and so do its prompt tokens that the prefix cache served (prompt_tokens_details.cached_tokens,
    0 when none were)."""
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs[::n])
    cached_tokens = sum(o.num_cached_tokens for o in outputs[::n])
    completion_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def json_logprob(value: float) -> float:
    """A logprob JSON can carry: -inf (a masked token) and NaN become -9999.0, as vLLM sends them."""
    return value if value > -9999.0 else -9999.0


def _longest_token_bytes(tokenizer) -> int:
    """The most bytes of text one token can stand for (special tokens by their written form)."""
    if tokenizer is None:
        return 1
    longest = max(len(tokenizer.id_to_bytes(i)) for i in range(tokenizer.vocab_size))
    specials = (len(tokenizer.decode([i]).encode()) for i in tokenizer.all_special_ids)
    return max(longest, *specials, 1)
