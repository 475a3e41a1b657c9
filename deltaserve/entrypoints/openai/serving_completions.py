"""POST /v1/completions: prompts (text or token ids) x n choices, whole or streamed, with OpenAI's logprobs.

Choice index = prompt index * n + choice, as OpenAI numbers them. echo puts the prompt before the text and,
with logprobs, the prompt's logprobs before the completion's (the first prompt token has none): with
max_tokens 0 that is the prompt-scoring request that lm-eval's loglikelihood tasks send."""

from __future__ import annotations

import codecs
import uuid

from fastapi import Request
from fastapi.responses import Response

from deltaserve.core.async_engine import EngineInput
from deltaserve.core.outputs import RequestOutput
from deltaserve.entrypoints.openai.errors import bad_request
from deltaserve.entrypoints.openai.protocol import CompletionRequest
from deltaserve.entrypoints.openai.serving import ServingContext, json_logprob, respond_or_gone, usage, wants_usage
from deltaserve.entrypoints.openai.structured import compile_constraint, structured_spec


class CompletionServing:
    def __init__(self, ctx: ServingContext):
        self.ctx = ctx

    async def create(self, body: CompletionRequest, request: Request):
        ctx = self.ctx
        ctx.check_request(body)
        _check_unsupported(body)
        ctx.check_max_tokens(body.max_tokens, "max_tokens")
        listed = _listed(body.prompt)
        ctx.check_fanout(len(listed) * body.n)  # before tokenizing: thousands of prompts cost the loop
        prompts = await self._tokenized(listed, body.add_special_tokens)
        if body.echo and body.logprobs is not None:
            ctx.check_echo_logprobs(sum(len(ids) for _, ids in prompts), body.n, body.logprobs)
        constraint = structured_spec(body)
        if constraint is not None:
            await compile_constraint(ctx.async_engine, *constraint)
        inputs, echoes = [], []
        for text, ids in prompts:
            max_tokens = ctx.default_max_tokens(len(ids)) if body.max_tokens is None else body.max_tokens
            ctx.check_length(len(ids), max_tokens, "prompt")
            prompt_logprobs = body.logprobs if body.echo else None
            echo = self._echo_text(text, ids) if body.echo else ""  # decoded once for all of the prompt's choices
            for params in ctx.sampling_params(body, max_tokens, body.logprobs, prompt_logprobs,
                                              constraint[0] if constraint else None):
                inputs.append(EngineInput(ids, params, text))
                echoes.append(echo)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream, watcher = await ctx.start(inputs, request_id, request)
        meta = ctx.response_meta(request_id)
        if body.stream:
            return ctx.sse(self._chunks(body, stream, echoes, meta), stream, watcher)
        return await respond_or_gone(self._whole(body, stream, watcher, echoes, meta))

    async def _tokenized(self, prompts: list[str | list[int]], add_special_tokens: bool) \
            -> list[tuple[str | None, list[int]]]:
        """(text or None, token ids) of each prompt (add_special_tokens: the tokenizer's BOS before a text's)."""
        if not prompts or not all(prompts):  # no prompt, or an empty text or id list among them
            raise bad_request("'prompt' must not be empty: send text, or at least one token id", "prompt")
        return [(None, p) if isinstance(p, list) else (p, await self.ctx.encode(p, "prompt", add_special_tokens))
                for p in prompts]

    def _echo_text(self, text: str | None, ids: list[int]) -> str:
        if text is not None:
            return text
        return self.ctx.tokenizer.decode(ids) if self.ctx.tokenizer is not None else ""

    async def _whole(self, body: CompletionRequest, stream, watcher, echoes: list[str], meta: dict) -> Response:
        outputs = await self.ctx.collect(stream, watcher)

        def build() -> dict:
            choices = []
            for index, (output, echo) in enumerate(zip(outputs, echoes)):
                completion = output.outputs[0]
                logprobs = None
                if body.logprobs is not None:
                    parts = [(_prompt_scored(output), _TextOffsets(self.ctx, 0, echo=True))] if body.echo else []
                    parts.append((_output_scored(output, 0), _TextOffsets(self.ctx, len(echo))))
                    logprobs = _logprobs(parts, self.ctx.token_text)
                choices.append({"index": index, "text": echo + completion.text, "logprobs": logprobs,
                                "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason})
            return {**meta, "object": "text_completion", "choices": choices, "usage": usage(outputs, body.n)}

        scored = sum(len(o.prompt_token_ids) * body.echo + len(o.outputs[0].token_ids) for o in outputs)
        return await self.ctx.respond(build, 0 if body.logprobs is None else scored * (body.logprobs + 1))

    async def _chunks(self, body: CompletionRequest, stream, echoes: list[str], meta: dict):
        """One chunk per choice that gained text (the echo comes with its first), then the usage chunk if asked."""
        sent_chars = [None] * len(echoes)  # output text sent per choice; None before its first chunk
        sent_tokens = [0] * len(echoes)
        offsets: list[_TextOffsets | None] = [None] * len(echoes)  # each choice's output tokens' offsets
        final: dict[int, RequestOutput] = {}
        include_usage = wants_usage(body)
        async for index, output in stream:
            completion = output.outputs[0]
            first = sent_chars[index] is None
            prefix = echoes[index] if first else ""
            text = prefix + completion.text[sent_chars[index] or 0:]
            if not (text or output.finished):
                continue  # the detokenizer holds back a partial character: these tokens go with the next chunk
            logprobs = None
            if body.logprobs is not None:
                if first:
                    offsets[index] = _TextOffsets(self.ctx, len(prefix))
                parts = [(_prompt_scored(output), _TextOffsets(self.ctx, 0, echo=True))] if first and body.echo else []
                parts.append((_output_scored(output, sent_tokens[index]), offsets[index]))
                logprobs = _logprobs(parts, self.ctx.token_text)
            sent_chars[index], sent_tokens[index] = len(completion.text), len(completion.token_ids)
            if output.finished:
                final[index] = output
            yield {**meta, "object": "text_completion", "choices": [
                {"index": index, "text": text, "logprobs": logprobs, "finish_reason": completion.finish_reason,
                 "stop_reason": completion.stop_reason}], **({"usage": None} if include_usage else {})}
        if include_usage:
            yield {**meta, "object": "text_completion", "choices": [],
                   "usage": usage([final[i] for i in sorted(final)], body.n)}


def _check_unsupported(body: CompletionRequest) -> None:
    if body.suffix:
        raise bad_request("'suffix' is not supported by this server", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("'best_of' other than n is not supported by this server", "best_of")


def _listed(prompt) -> list[str | list[int]]:
    """The prompts of a request's prompt field: a text or a list of token ids (the schema made them all ints) is
    one."""
    return [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt


def _prompt_scored(output: RequestOutput) -> list[tuple[int, dict | None]]:
    """(prompt token id, its logprob entry); the first token has none."""
    return _scored(output.prompt_token_ids, output.prompt_logprobs, 0)


def _output_scored(output: RequestOutput, start: int) -> list[tuple[int, dict | None]]:
    """(output token id, its logprob entry) from the start-th output token on."""
    completion = output.outputs[0]
    return _scored(completion.token_ids, completion.logprobs, start)


def _scored(token_ids: list[int], entries: list[dict | None] | None, start: int) -> list[tuple[int, dict | None]]:
    """token_ids[start:] each with its entry, None past the end of entries."""
    entries = entries or []
    return [(token_ids[i], entries[i] if i < len(entries) else None) for i in range(start, len(token_ids))]


class _TextOffsets:
    """Where each of a run of tokens starts in the response's text, in characters from `start`: the characters the
    earlier tokens' bytes decode to. A character split over several byte-level tokens counts once, when whole (each
    of those tokens starts where the character does). Special tokens add none to the output, as it is detokenized,
    and their text to an echoed prompt (echo: the prompt's own text, or its ids decoded, keeps them). Counting each
    token's own text instead ran past the text's end (U+FFFD for each part of a character) and, over a stream's
    chunks, went backwards."""

    def __init__(self, ctx: ServingContext, start: int, echo: bool = False):
        self._ctx = ctx
        self._skip = ctx.tokenizer.all_special_ids if ctx.tokenizer is not None and not echo else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = start

    def take(self, token_id: int, text: str) -> int:
        """The offset of the next token, whose text (as logprobs show it) is text."""
        offset = self.chars
        if token_id not in self._skip:
            self.chars += len(self._utf8.decode(self._ctx.token_bytes(token_id, text)))
        return offset


def _logprobs(parts: list[tuple[list[tuple[int, dict | None]], _TextOffsets]], token_text) -> dict:
    """OpenAI's completions logprobs of (scored tokens, their offsets in the text) parts laid end to end."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for scored, offsets in parts:
        for token_id, entry in scored:
            text = token_text(token_id, entry)
            tokens.append(text)
            text_offset.append(offsets.take(token_id, text))
            token_logprobs.append(json_logprob(entry[token_id].logprob) if entry else None)
            top_logprobs.append({token_text(t, entry): json_logprob(lp.logprob) for t, lp in entry.items()}
                                if entry else None)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}
