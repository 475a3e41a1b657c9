"""Request bodies of the OpenAI API as pydantic models: the types and static ranges of every field.

Strict types (a string is never coerced to a number), unknown fields ignored as OpenAI's SDK may add new
ones. Checks that need the model (context length, tokenizer) are in the serving modules."""

from __future__ import annotations

import functools
import types
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deltaserve.sampling_params import MAX_LOGPROBS

MAX_N = 128  # choices per request, OpenAI's limit
MAX_STOP = 16  # stop strings per request
MAX_STOP_TOKEN_IDS = 1024  # stop token ids per request: each choice's SamplingParams checks them all
MAX_LOGIT_BIAS = 1024  # logit_bias entries per request, for the same reason
MAX_ALLOWED_TOKEN_IDS = 1024  # allowed_token_ids per request, likewise

INT32_MAX = 2**31 - 1  # bounds what reaches int64 tensors


def ListOf(item, **constraints):  # noqa: N802 (a type, named as one)
    """list[item] that stops at its first bad item. Pydantic otherwise reports every bad item, once for each member
    of a union it is in: a body of a million bad token ids made millions of errors, seconds of the server's event
    loop (BENCHMARKS.md, "Bodies with a million bad items")."""
    return Annotated[list[item], Field(fail_fast=True, **constraints)]


TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
TokenIds = ListOf(TokenId)
Stop = str | ListOf(Annotated[str, Field(min_length=1)], max_length=MAX_STOP) | None


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data):
        """A JSON null in a field that has a default but no None (`n`, `stream`, `echo`...) means the default, as
        OpenAI's API marks these fields nullable and its SDK sends None as null; a required field stays required."""
        if isinstance(data, dict):
            fields = _defaulted_not_nullable(cls)
            if any(data.get(key, 0) is None for key in fields):
                data = {key: value for key, value in data.items() if not (value is None and key in fields)}
        return data


@functools.cache
def _defaulted_not_nullable(model: type[BaseModel]) -> frozenset[str]:
    """The body keys (aliases included) of model's fields that have a default and whose type does not take None."""
    return frozenset(
        field.alias or name for name, field in model.model_fields.items()
        if not field.is_required() and not _takes_none(field.annotation)
    )


def _takes_none(annotation) -> bool:
    if annotation is None or annotation is type(None):
        return True
    if typing.get_origin(annotation) is Annotated:
        return _takes_none(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_takes_none(arg) for arg in typing.get_args(annotation))
    return False


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    """response_format.json_schema: OpenAI's {"name", "schema", "strict", "description"}."""

    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")  # `schema` would shadow pydantic's method
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


STRUCTURED_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputsFields(_Request):
    """vLLM's `structured_outputs` extra: exactly one constraint (checked with the request) and vLLM's options.

    An unknown key is refused, not ignored: vLLM's `structural_tag` or `whitespace_pattern` ignored would leave the
    output free of what the client asked for."""

    model_config = ConfigDict(extra="forbid")

    json_: dict | str | None = Field(None, alias="json")  # `json` would shadow pydantic's method
    regex: str | None = None
    choice: ListOf(str) | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's options, met either way (StructuredOutputsParams)
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    disable_fallback: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _unset_is_absent(cls, data):
        """A null key asks for nothing (a client that dumps vLLM's dataclass whole sends `"structural_tag": null`),
        nor do vLLM's internal `_backend` fields: dropped before unknown keys are refused."""
        if isinstance(data, dict):
            data = {key: value for key, value in data.items() if value is not None and not key.startswith("_backend")}
        return data


class SamplingFields(_Request):
    """What completions and chat share; None means OpenAI's default."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: Stop = None
    stop_token_ids: ListOf(TokenId, max_length=MAX_STOP_TOKEN_IDS) | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)  # vLLM's: outputs before EOS or a stop may end the output
    stream: bool = False
    stream_options: StreamOptions | None = None
    # {"token id": bias}: keys read by serving.logit_bias, values by SamplingParams, each naming the first bad one
    # (values typed here, a million bad ones made a million errors: pydantic's fail_fast is for lists only)
    logit_bias: Annotated[dict[str, Any], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    allowed_token_ids: ListOf(TokenId, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS) | None = None  # vLLM's
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsFields | None = None
    # vLLM's old names of structured_outputs' fields: read only to be refused (ignored, the output would be free)
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None


GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class CompletionRequest(SamplingFields):
    prompt: str | ListOf(str) | TokenIds | ListOf(TokenIds)
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's post-processor tokens (a BOS) before the prompt


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | ListOf(TextPart) | None = None
    name: str | None = None
    tool_calls: ListOf(dict) | None = None  # an assistant turn's earlier calls, rendered by the chat template
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: ListOf(ChatMessage, min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: ListOf(dict) | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    add_special_tokens: bool = False  # vLLM's: the template writes the BOS; True for a template that does not
