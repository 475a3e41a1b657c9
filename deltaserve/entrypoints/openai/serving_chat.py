"""POST /v1/chat/completions: messages through the model's chat template, n choices, whole or streamed.

The assistant message of a choice is built by `_message` (and its stream deltas by `_delta`); tool calling,
when it comes, parses the choice's text there. Until then a request with tools is accepted only with
tool_choice 'none' (the tools are still shown to the model through the template).
"""

from __future__ import annotations

import time
import uuid

from fastapi import Request

from deltaserve.core.async_engine import EngineInput
from deltaserve.core.outputs import RequestOutput
from deltaserve.entrypoints.openai.errors import bad_request
from deltaserve.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from deltaserve.entrypoints.openai.serving import ServingContext, json_logprob, respond_or_gone, usage


class ChatServing:
    def __init__(self, ctx: ServingContext):
        self.ctx = ctx

    async def create(self, body: ChatCompletionRequest, request: Request):
        ctx = self.ctx
        ctx.check_model(body.model)
        _check_unsupported(body)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        ctx.check_max_tokens(max_tokens, param)
        ctx.check_fanout(body.n)
        text = ctx.render_chat([_template_message(m) for m in body.messages], body.tools)
        ids = ctx.encode(text, "messages")
        max_tokens = ctx.default_max_tokens(len(ids)) if max_tokens is None else max_tokens
        ctx.check_length(len(ids), max_tokens, "messages")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        inputs = [EngineInput(ids, params, text) for params in ctx.sampling_params(body, max_tokens, logprobs)]
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream, watcher = await ctx.start(inputs, request_id, request)
        meta = dict(id=request_id, created=int(time.time()), model=ctx.config.served_model_name)
        if body.stream:
            return ctx.sse(self._chunks(body, stream, meta), stream, watcher)
        return await respond_or_gone(self._whole(body, stream, watcher, meta))

    async def _whole(self, body: ChatCompletionRequest, stream, watcher, meta: dict) -> dict:
        outputs = await self.ctx.collect(stream, watcher)
        choices = []
        for index, output in enumerate(outputs):
            completion = output.outputs[0]
            logprobs = self._logprobs(output, 0, body.top_logprobs or 0) if body.logprobs else None
            choices.append({"index": index, "message": _message(completion.text), "logprobs": logprobs,
                            "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason})
        completion_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        return {**meta, "object": "chat.completion", "choices": choices,
                "usage": usage(len(outputs[0].prompt_token_ids), completion_tokens)}

    async def _chunks(self, body: ChatCompletionRequest, stream, meta: dict):
        """A role chunk per choice, content deltas (the last with finish_reason), then the usage chunk if asked."""
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        extra = {"usage": None} if include_usage else {}
        chunk = {**meta, "object": "chat.completion.chunk"}
        for index in range(body.n):
            yield {**chunk, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}], **extra}
        sent_chars, sent_tokens = [0] * body.n, [0] * body.n
        final: dict[int, RequestOutput] = {}
        async for index, output in stream:
            completion = output.outputs[0]
            text = completion.text[sent_chars[index]:]
            if not (text or output.finished):
                continue  # the detokenizer holds back a partial character: these tokens go with the next chunk
            logprobs = self._logprobs(output, sent_tokens[index], body.top_logprobs or 0) if body.logprobs else None
            sent_chars[index], sent_tokens[index] = len(completion.text), len(completion.token_ids)
            choice = {"index": index, "delta": _delta(text) if text else {}, "logprobs": logprobs,
                      "finish_reason": completion.finish_reason}
            if output.finished:
                final[index] = output
                choice["stop_reason"] = completion.stop_reason
            yield {**chunk, "choices": [choice], **extra}
        if include_usage and final:
            completion_tokens = sum(len(o.outputs[0].token_ids) for o in final.values())
            prompt_tokens = len(next(iter(final.values())).prompt_token_ids)
            yield {**chunk, "choices": [], "usage": usage(prompt_tokens, completion_tokens)}

    def _logprobs(self, output: RequestOutput, start: int, num_top: int) -> dict:
        """OpenAI's chat logprobs of the output tokens from `start` on."""
        completion = output.outputs[0]
        content = []
        for token_id, entry in list(zip(completion.token_ids, completion.logprobs or []))[start:]:
            top = sorted(((t, lp) for t, lp in entry.items() if lp.rank <= num_top), key=lambda x: x[1].rank)
            content.append({**self._token(token_id, entry), "top_logprobs": [self._token(t, entry) for t, _ in top]})
        return {"content": content}

    def _token(self, token_id: int, entry: dict) -> dict:
        text = self.ctx.token_text(token_id, entry)
        return {"token": text, "logprob": json_logprob(entry[token_id].logprob),
                "bytes": list(text.encode("utf-8", "replace"))}


def _check_unsupported(body: ChatCompletionRequest) -> None:
    if body.response_format is not None and body.response_format.type != "text":
        raise bad_request(f"response_format type '{body.response_format.type}' is not supported: this server has no "
                          "constrained decoding; use 'text' (or leave response_format out)", "response_format")
    if body.tools and body.tool_choice != "none":
        raise bad_request("tool calling is not supported by this server yet; leave 'tools' out or send "
                          "tool_choice 'none'", "tools")
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


def _message(text: str) -> dict:
    return {"role": "assistant", "content": text}


def _delta(text: str) -> dict:
    return {"content": text}
