"""Structured outputs on the OpenAI routes: response_format (json_object, json_schema), vLLM's structured_outputs
extra (json, regex, choice, grammar, json_object) and forced tool calls, read into one StructuredOutputsParams and
compiled before the request reaches the engine, so that a bad constraint is a 400 naming what is wrong (and a slow
one waits in its handler while the engine steps the others)."""

from __future__ import annotations

import asyncio

from deltaserve.core.async_engine import EngineClient, EngineStoppedError
from deltaserve.entrypoints.forced_tools import ForcedTools
from deltaserve.entrypoints.openai.errors import OpenAIError, bad_request
from deltaserve.entrypoints.openai.protocol import SamplingFields
from deltaserve.sampling_params import ParamError, StructuredOutputsParams
from deltaserve.structured import GrammarError, StructuredOutputsUnavailable, errors

# where in the request a constraint's error is (its field, then the kind of constraint: json, regex, ...)
_WHERE = {"structured_outputs": "{param}.{kind}", "response_format": "response_format.json_schema.schema",
          "tools": "tools"}


def structured_spec(body: SamplingFields, forced: ForcedTools | None = None) -> tuple[StructuredOutputsParams, str] \
        | None:
    """The request's constraint and the field it came from; None for a free request. At most one source."""
    fmt = body.response_format if body.response_format is not None and body.response_format.type != "text" else None
    sources = [name for name, given in (("response_format", fmt), ("structured_outputs", body.structured_outputs),
                                        ("tool_choice", forced)) if given is not None]
    if len(sources) > 1:
        raise bad_request(f"{' and '.join(sources)} both constrain the output; send only one of them", sources[1])
    if forced is not None:
        return StructuredOutputsParams(json=forced.schema), "tools"
    if fmt is not None:
        return _response_format(fmt), "response_format"
    if body.structured_outputs is not None:
        try:
            fields = body.structured_outputs.model_dump(exclude_none=True, by_alias=True)  # its arguments, by name
            return StructuredOutputsParams(**fields), "structured_outputs"
        except ParamError as e:
            where = "structured_outputs" + (f".{e.field}" if e.field else "")
            raise bad_request("structured_outputs" + str(e).removeprefix("StructuredOutputsParams"), where) from e
    return None


def _response_format(fmt) -> StructuredOutputsParams:
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise bad_request("response_format.json_schema.schema is missing: a response_format of type 'json_schema' "
                          "needs the JSON schema the output must match", "response_format.json_schema")
    return StructuredOutputsParams(json=fmt.json_schema.schema_)


# How long a handler waits for its constraint's compile. The compile itself is stopped at COMPILE_TIMEOUT_S (its
# future then fails with CompileTimeout: a 400 to simplify the constraint); past this wait it is still queued behind
# other constraints' compiles, which is no fault of its own (a 429 to retry; it compiles on, into the cache).
QUEUE_WAIT_FACTOR = 2


async def compile_constraint(async_engine: EngineClient, spec: StructuredOutputsParams, param: str) -> None:
    """Compile spec on the engine's grammar pool (cached) and wait for it here, off the engine's step; a 400 naming
    the field when the constraint cannot be used, its compile took longer than COMPILE_TIMEOUT_S, or xgrammar is not
    installed; a 429 when it waited behind other compiles past QUEUE_WAIT_FACTOR times that."""
    waited = QUEUE_WAIT_FACTOR * errors.COMPILE_TIMEOUT_S
    try:  # shielded: a timeout leaves the compile running, for the cache
        future = async_engine.compile(spec)  # what needs no xgrammar may be refused at once
        await asyncio.wait_for(asyncio.shield(future), waited)
    except TimeoutError:
        future.add_done_callback(_retrieve)  # its end is the cache's; its error, if any, read so none is logged
        raise OpenAIError(429, f"the constraint has waited {waited:g} s behind other constraints' compiles; retry "
                               "shortly (it compiles on, and a compiled constraint is cached)", param,
                          "compiles_busy", {"retry-after": "5"}) from None
    except errors.CompilesBusy as e:
        raise OpenAIError(429, str(e), param, "compiles_busy", {"retry-after": "1"}) from e
    except EngineStoppedError as e:
        raise OpenAIError(503, str(e), None, "unavailable") from e
    except StructuredOutputsUnavailable as e:
        raise bad_request(str(e), param) from e
    except GrammarError as e:
        where = _WHERE.get(param, "{param}").format(param=param, kind=e.param)
        raise bad_request(f"{where}: {str(e).removeprefix(e.param + ': ')}", where) from e
    except ValueError as e:
        raise bad_request(str(e), param) from e


def _retrieve(future) -> None:
    if not future.cancelled():
        future.exception()
