"""RequestGuard alone, in front of an app that echoes the body's size: the body limit holds at its exact edge, by
Content-Length and by the bytes a chunked body delivers; a body cut short by the client leaving never reaches the
app."""

from __future__ import annotations

import asyncio
import json

import pytest

from deltaserve.entrypoints.openai.guard import RequestGuard

LIMIT = 100


async def _echo_size(scope, receive, send):
    message = await receive()
    payload = str(len(message["body"])).encode()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": payload})


def _post(chunks: list[bytes], content_length: int | None, cut: bool = False) -> tuple[int, bytes] | None:
    """The guard's status and body for a POST whose body arrives in `chunks` (one http.request message each); cut:
    the client leaves after them (None: nothing was sent back)."""
    headers = [] if content_length is None else [(b"content-length", str(content_length).encode())]
    scope = {"type": "http", "path": "/v1/completions", "headers": headers}
    messages = [{"type": "http.request", "body": c, "more_body": cut or i < len(chunks) - 1}
                for i, c in enumerate(chunks)]
    sent = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(RequestGuard(_echo_size, None, LIMIT)(scope, receive, send))
    return (sent[0]["status"], sent[1]["body"]) if sent else None


@pytest.mark.parametrize("size, status", [(LIMIT - 1, 200), (LIMIT, 200), (LIMIT + 1, 413)])
def test_body_limit_by_content_length(size, status):
    got, body = _post([b"x" * size], content_length=size)
    assert got == status
    if status == 200:
        assert body == str(size).encode()
    else:
        assert json.loads(body)["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("size, status", [(LIMIT, 200), (LIMIT + 1, 413)])
def test_body_limit_by_chunks(size, status):
    half = size // 2
    got, _ = _post([b"x" * half, b"x" * (size - half)], content_length=None)
    assert got == status


def test_a_body_cut_short_by_the_client_leaving_never_reaches_the_app():
    """Content-Length promised more than came before the disconnect: the JSON sent may parse on its own, but the
    request was never whole, so it is neither answered nor run."""
    assert _post([b'{"prompt": "hi"}'], content_length=40, cut=True) is None
    assert _post([b'{"prompt": "hi"}'], content_length=16) == (200, b"16")
