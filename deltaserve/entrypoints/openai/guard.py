"""RequestGuard: the checks that need only headers and raw bytes, made before FastAPI parses anything.

In order: the API key on /v1 routes (401), the body size, from Content-Length and again while reading a
chunked body (413), and UTF-8 (400). The body it read is replayed to the app, and later receive() calls go
to the server, so a handler still hears the client disconnect. A client that leaves before its body is whole gets
nothing: its request never reaches the app (a cut JSON body may still parse, and would be queued and run).
Every response carries an `x-request-id` header, as OpenAI's do, to trace a request through proxies and clients'
logs: the client's own X-Request-Id when it sent a plain one, else a new id."""

from __future__ import annotations

import json
import re
import secrets
import uuid

from deltaserve.entrypoints.openai.errors import error_body


class RequestGuard:
    """Pure ASGI middleware; on_error(status) is told of every request it refuses."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, on_error=lambda status: None):
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.on_error = on_error

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        send = _with_request_id(send, _request_id(headers.get("x-request-id")))
        if self.api_key is not None and scope["path"].startswith("/v1") and not self._authorized(headers):
            return await self._refuse(send, 401, "missing or wrong API key: send the header "
                                                 "'Authorization: Bearer <key>' with the server's --api-key",
                                      "invalid_api_key", {"www-authenticate": "Bearer"})
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return await self._too_large(send)
        try:
            body = await self._read_body(receive)
        except _ClientLeft:
            return None
        if body is None:
            return await self._too_large(send)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as e:
            return await self._refuse(send, 400, f"request body is not valid UTF-8 (byte {e.start}); send JSON "
                                                 "encoded as UTF-8", "invalid_encoding")
        await self.app(scope, _replay(body, receive), send)

    def _authorized(self, headers: dict[str, str]) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), self.api_key.encode())

    async def _read_body(self, receive) -> bytes | None:
        """The whole body, None if over the limit; _ClientLeft if the client disconnected before it was whole."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                raise _ClientLeft
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_large(self, send):
        await self._refuse(send, 413, f"request body is larger than the server's limit of {self.max_body_bytes} "
                                      "bytes (--max-body-bytes); send a shorter prompt", "request_too_large")

    async def _refuse(self, send, status: int, message: str, code: str, extra_headers: dict | None = None):
        self.on_error(status)
        payload = json.dumps(error_body(status, message, None, code)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        headers += [(k.encode(), v.encode()) for k, v in (extra_headers or {}).items()]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


_PLAIN_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")  # what a client's X-Request-Id may be to be echoed


def _request_id(given: str | None) -> str:
    """The client's X-Request-Id when it is plain (letters, digits, . _ : -; at most 128), else a new one."""
    return given if given is not None and _PLAIN_ID.fullmatch(given) else f"req-{uuid.uuid4().hex}"


def _with_request_id(send, request_id: str):
    """send(), with x-request-id added to the response's headers (replacing any the app set)."""
    header = (b"x-request-id", request_id.encode())

    async def sending(message):
        if message["type"] == "http.response.start":
            kept = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"x-request-id"]
            message = {**message, "headers": [*kept, header]}
        await send(message)

    return sending


class _ClientLeft(Exception):
    """The client disconnected before its body was whole."""


def _replay(body: bytes, receive):
    """A receive() that gives the body once, then the server's own."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
