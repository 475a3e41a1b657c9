"""POST /v1/chat/completions: messages through the model's chat template, n choices, whole or streamed.

Each choice's text is read by a ChatOutputParser (entrypoints/chat_tools.py): with tools and tool_choice "auto",
the model's tool-call section becomes OpenAI `tool_calls`, streamed as OpenAI streams them, with finish_reason
"tool_calls"; "required" and a named function force a call (entrypoints/forced_tools.py). response_format and
vLLM's structured_outputs constrain the output too (openai/structured.py)."""

from __future__ import annotations

import uuid

from fastapi import Request
from fastapi.responses import Response

from deltaserve.core.async_engine import EngineInput
from deltaserve.core.outputs import RequestOutput
from deltaserve.entrypoints.chat_tools import ChatOutputParser, ChatPrompt, parse_chat_output
from deltaserve.entrypoints.openai.errors import bad_request
from deltaserve.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from deltaserve.entrypoints.openai.serving import ServingContext, json_logprob, respond_or_gone, usage, wants_usage
from deltaserve.entrypoints.openai.structured import compile_constraint, structured_spec


class ChatServing:
    def __init__(self, ctx: ServingContext):
        self.ctx = ctx

    async def create(self, body: ChatCompletionRequest, request: Request):
        ctx = self.ctx
        ctx.check_request(body)
        _check_unsupported(body)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        ctx.check_max_tokens(max_tokens, param)
        ctx.check_fanout(body.n)
        prompt = await ctx.render_chat(body.messages, _template_message, body.tools, body.tool_choice,
                                       body.parallel_tool_calls is not False)
        ids = await ctx.encode(prompt.text, "messages", body.add_special_tokens)
        max_tokens = ctx.default_max_tokens(len(ids)) if max_tokens is None else max_tokens
        ctx.check_length(len(ids), max_tokens, "messages")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        constraint = structured_spec(body, prompt.forced)
        if constraint is not None:
            await compile_constraint(ctx.async_engine, *constraint)
        inputs = [EngineInput(ids, params, prompt.text) for params in ctx.sampling_params(
            body, max_tokens, logprobs, structured=constraint[0] if constraint else None)]
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream, watcher = await ctx.start(inputs, request_id, request)
        meta = ctx.response_meta(request_id)
        if body.stream:
            return ctx.sse(self._chunks(body, stream, meta, prompt), stream, watcher)
        return await respond_or_gone(self._whole(body, stream, watcher, meta, prompt))

    async def _whole(self, body: ChatCompletionRequest, stream, watcher, meta: dict, prompt: ChatPrompt) -> Response:
        outputs = await self.ctx.collect(stream, watcher)

        def build() -> dict:
            choices = []
            for index, output in enumerate(outputs):
                completion = output.outputs[0]
                parser = parse_chat_output(completion.text, prompt.parse_tool_calls, prompt.forced)
                logprobs = self._logprobs(output, 0, body.top_logprobs or 0) if body.logprobs else None
                choices.append({"index": index, "message": parser.message(), "logprobs": logprobs,
                                "finish_reason": parser.finish_reason(completion.finish_reason),
                                "stop_reason": completion.stop_reason})
            return {**meta, "object": "chat.completion", "choices": choices, "usage": usage(outputs, body.n)}

        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        return await self.ctx.respond(build, tokens * ((body.top_logprobs or 0) + 1) if body.logprobs else 0)

    async def _chunks(self, body: ChatCompletionRequest, stream, meta: dict, prompt: ChatPrompt):
        """A role chunk per choice, a chunk per content or tool-call delta (the last with finish_reason), then the
        usage chunk if asked."""
        include_usage = wants_usage(body)
        extra = {"usage": None} if include_usage else {}
        chunk = {**meta, "object": "chat.completion.chunk"}
        for index in range(body.n):
            yield {**chunk, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}], **extra}
        parsers = [ChatOutputParser(prompt.parse_tool_calls, prompt.forced) for _ in range(body.n)]
        sent_chars, sent_tokens = [0] * body.n, [0] * body.n
        final: dict[int, RequestOutput] = {}
        async for index, output in stream:
            completion = output.outputs[0]
            deltas = parsers[index].push(completion.text[sent_chars[index]:])
            sent_chars[index] = len(completion.text)
            if output.finished:
                deltas += parsers[index].finish()
                final[index] = output
            elif not deltas:
                continue  # held back (half a character, or what may begin a tool-call marker): these tokens go later
            logprobs = self._logprobs(output, sent_tokens[index], body.top_logprobs or 0) if body.logprobs else None
            sent_tokens[index] = len(completion.token_ids)
            for choice in _stream_choices(index, deltas, logprobs, parsers[index], output):
                yield {**chunk, "choices": [choice], **extra}
        if include_usage and final:
            yield {**chunk, "choices": [], "usage": usage([final[i] for i in sorted(final)], body.n)}

    def _logprobs(self, output: RequestOutput, start: int, num_top: int) -> dict:
        """OpenAI's chat logprobs of the output tokens from `start` on."""
        completion = output.outputs[0]
        content = []
        for token_id, entry in zip(completion.token_ids[start:], (completion.logprobs or [])[start:]):
            top = sorted(((t, lp) for t, lp in entry.items() if lp.rank <= num_top), key=lambda x: x[1].rank)
            content.append({**self._token(token_id, entry), "top_logprobs": [self._token(t, entry) for t, _ in top]})
        return {"content": content}

    def _token(self, token_id: int, entry: dict) -> dict:
        text = self.ctx.token_text(token_id, entry)
        return {"token": text, "logprob": json_logprob(entry[token_id].logprob),
                "bytes": list(self.ctx.token_bytes(token_id, text))}


def _check_unsupported(body: ChatCompletionRequest) -> None:
    if body.top_logprobs and not body.logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs' set to true", "top_logprobs")


def _template_message(message: ChatMessage) -> dict:
    """A message as chat templates expect it: text parts joined, 'developer' read as 'system'."""
    out = message.model_dump(exclude_none=True)
    if message.role == "developer":
        out["role"] = "system"
    if isinstance(message.content, list):
        out["content"] = "".join(part.text for part in message.content)
    return out


def _stream_choices(index: int, deltas: list[dict], logprobs: dict | None, parser: ChatOutputParser,
                    output: RequestOutput) -> list[dict]:
    """A stream choice per delta (one empty delta if none): the new tokens' logprobs on the first,
    finish_reason on the last once the output is finished."""
    choices = [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None} for delta in deltas or [{}]]
    choices[0]["logprobs"] = logprobs
    if output.finished:
        completion = output.outputs[0]
        choices[-1].update(finish_reason=parser.finish_reason(completion.finish_reason),
                           stop_reason=completion.stop_reason)
    return choices
