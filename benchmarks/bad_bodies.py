"""What a request body with many bad items costs the server before any of our code runs: FastAPI parses the JSON
and validates it against the request models of deltaserve.entrypoints.openai.protocol on the event loop, so every
stream waits that long. Each case below gives one list-like field --items bad entries (and one valid body of that
many token ids for scale); a route of its own per request model answers as the server's do (a 400 from
errors.install_handlers), timed from the client's send to the answer.

    python benchmarks/bad_bodies.py --items 1000000

Before 5a6c6d5 the lists reported every bad item (once for each member of the union they are in); to time that,
check out its parent's deltaserve/entrypoints/openai/protocol.py (`git show 5a6c6d5^:...`) and run this again.
"""

from __future__ import annotations

import argparse
import json
import time

from fastapi import FastAPI
from fastapi.testclient import TestClient

from deltaserve.entrypoints.openai.errors import install_handlers
from deltaserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

USER = [{"role": "user", "content": "hi"}]


def cases(n: int) -> dict[str, tuple[str, dict]]:
    return {
        "valid: prompt of token ids": ("/c", {"prompt": list(range(n))}),
        "prompt: every id -1": ("/c", {"prompt": [-1] * n}),
        "prompt: the last id -1": ("/c", {"prompt": [5] * (n - 1) + [-1]}),
        "prompt: floats": ("/c", {"prompt": [1.5] * n}),
        "prompt: id lists of -1": ("/c", {"prompt": [[-1]] * n}),
        "stop_token_ids: -1": ("/c", {"prompt": "x", "stop_token_ids": [-1] * n}),
        "messages: ints": ("/chat", {"messages": [1] * n}),
        "content parts: ints": ("/chat", {"messages": [{"role": "user", "content": [1] * n}]}),
        "tools: ints": ("/chat", {"messages": USER, "tools": [1] * n}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=1_000_000, help="bad entries in the field of each case")
    args = parser.parse_args()
    app = FastAPI()
    install_handlers(app, on_error=lambda status: None)

    @app.post("/c")
    async def completion(body: CompletionRequest):
        return {"ok": True}

    @app.post("/chat")
    async def chat(body: ChatCompletionRequest):
        return {"ok": True}

    print(f"| case ({args.items:,} items) | body MB | status | client to answer, s |")
    print("|---|---:|---:|---:|")
    with TestClient(app) as client:
        for name, (path, body) in cases(args.items).items():
            raw = json.dumps(body).encode()
            start = time.perf_counter()
            response = client.post(path, content=raw, headers={"content-type": "application/json"})
            elapsed = time.perf_counter() - start
            print(f"| {name} | {len(raw) / 1e6:.1f} | {response.status_code} | {elapsed:.2f} |", flush=True)


if __name__ == "__main__":
    main()
