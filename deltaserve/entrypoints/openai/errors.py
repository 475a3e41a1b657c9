"""Errors in OpenAI's shape and with OpenAI's statuses: {"error": {"message", "type", "param", "code"}}.

Handlers turn every failure into that shape: our own OpenAIError, pydantic's validation errors (400, not
FastAPI's 422), routing errors (404, 405), a body nested past Python's recursion limit (400) and anything
unexpected (500, logged with its traceback)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from deltaserve.entrypoints.openai.protocol import MAX_STOP, STRUCTURED_CONSTRAINTS

log = logging.getLogger("deltaserve")

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 503: "service_unavailable"}
# fields whose type is a union: pydantic reports one error per member, so say what the field takes instead
UNION_HINTS = {"prompt": "must be a string, a list of strings, a list of token ids or a list of token-id lists",
               "stop": f"must be a non-empty string or a list of at most {MAX_STOP} non-empty strings",
               "content": "must be a string or a list of {\"type\": \"text\", \"text\": ...} parts",
               "tool_choice": "must be a string or an object"}
# objects that refuse unknown keys (an ignored key would leave the output free of what it asked for): what they take
EXTRA_HINTS = {"structured_outputs": f"; the output would not follow it. structured_outputs takes one of "
                                     f"{', '.join(STRUCTURED_CONSTRAINTS)} and vLLM's options "
                                     "disable_any_whitespace, disable_additional_properties and disable_fallback"}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param, "invalid_value" if param else None)


def install_handlers(app: FastAPI, on_error) -> None:
    """on_error(status) is told of every error response (for metrics)."""

    def respond(status: int, body: dict, headers=None) -> JSONResponse:
        on_error(status)
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, exc: OpenAIError):
        return respond(exc.status, exc.body(), exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param = describe_validation(exc.errors())
        return respond(400, error_body(400, message, param, "invalid_value" if param else None))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        return respond(exc.status_code, error_body(exc.status_code, str(exc.detail)), exc.headers)

    @app.exception_handler(RecursionError)
    async def _too_deep(request: Request, exc: RecursionError):
        # the body parsed (json's own limit is deeper), then a walk over it (the chat template's, the tools') ran
        # out of Python's stack: the client's to fix, not a server error with a thousand-frame traceback
        return respond(400, error_body(400, "request nests objects or lists too deeply to process (Python's "
                                            "recursion limit); flatten tool parameters and message contents"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error serving %s %s", request.method, request.url.path)
        return respond(500, error_body(500, f"internal server error ({type(exc).__name__}); see the server log"))


def describe_validation(errors) -> tuple[str, str | None]:
    """(message, param) for the first of pydantic's errors, with the field path written as OpenAI does."""
    if not errors:
        return "invalid request body", None
    error = errors[0]
    if error.get("type") == "json_invalid":
        return f"request body is not valid JSON: {error.get('ctx', {}).get('error', error['msg'])}", None
    path = [p for p in error["loc"] if p != "body"]
    fields = [p for p in path if isinstance(p, int) or _is_field_name(p)]
    param = _param(fields)
    if not param:
        if error.get("type") in ("model_type", "model_attributes_type", "dict_type"):
            return "request body must be a JSON object of the request's fields", None
        return f"request body: {error['msg']}", None
    union_field = next((p for p in reversed(fields) if isinstance(p, str)), None)
    if union_field in UNION_HINTS and len(fields) != len(path):
        return f"'{param}' {UNION_HINTS[union_field]}", param
    if error.get("type") == "missing":
        return f"'{param}' is required", param
    if error.get("type") == "extra_forbidden":
        return f"'{param}' is not a field this server reads{EXTRA_HINTS.get(fields[0], '')}", param
    return f"'{param}': {error['msg']}{_got(error)}", param


def _is_field_name(part) -> bool:
    """Pydantic puts union member tags ('str', 'list[int]', 'function-after[...]') into locations too."""
    return isinstance(part, str) and part.isidentifier() and part not in ("str", "int", "float", "bool", "list",
                                                                           "dict", "TextPart", "ResponseFormat")


def _param(fields) -> str:
    out = ""
    for part in fields:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def _got(error) -> str:
    value = error.get("input")
    if isinstance(value, (dict, list)) or value is None:
        return ""
    text = repr(value)
    return f" (got {text[:60] + '...' if len(text) > 60 else text})"
