"""What one large request costs the other streams on the server's event loop: a thread pings /health every 10 ms
while it runs, and the longest wait for an answer is how long every stream stalled. Two kinds:

- completions with echo and logprobs: the prompt logprob entries (prompt tokens x n x (logprobs + 1)) are built and
  rendered as JSON on the loop; --entries asks for about that many (up to 8 prompts of up to 4,000 tokens, n growing
  past them; the table prints what each asked for). The limit here is echo_logprobs_limit's floor (1,048,576).
- chat with many messages: the body is validated (in a thread, in pieces, past OFF_LOOP_BYTES), then the messages
  are rendered by the chat template and the prompt tokenized (in a thread past OFF_LOOP_ITEMS and OFF_LOOP_CHARS);
  --messages gives their counts.
- bodies of many small items, each as large as the body limit allows (--bodies: names from SHAPES).
- a long text prompt sent while two such bodies are parsed (--beside: names from SHAPES): how long it waited for
  them, when its tokenizing shared their worker threads.

The server runs the demo model (engine in its own process, as `deltaserve serve` runs it) with a 4,096-token context
and the body limit it gets at a 1M-token context (17 MiB).

    python benchmarks/loop_stall.py --entries 100000,1000000,5376000 --messages 140000,600000 --bodies all
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOGPROBS = 20
PROMPT_LEN = 4000
USER = {"role": "user"}
LONG_TEXT = 12_000  # characters of --beside's text prompt: over serving.OFF_LOOP_CHARS, within the 4,096-token context
# bodies of many small items, by the item and how many fit in a body of `size` bytes
SHAPES = {
    "messages of a role alone": lambda size: ("/v1/chat/completions", {"messages": [USER] * (size // 18)}),
    "one message of many parts": lambda size: ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": [{"type": "text", "text": ""}] * (size // 31)}]}),
    "4096 messages of many parts": lambda size: ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": [{"type": "text", "text": ""}] * (size // 4096 // 31)}] * 4096}),
    "tools of {}": lambda size: ("/v1/chat/completions", {"messages": [USER], "tools": [{}] * (size // 4)}),
    "prompt of token ids": lambda size: ("/v1/completions", {"prompt": [7] * (size // 3)}),
    "prompt of one-token lists": lambda size: ("/v1/completions", {"prompt": [[7]] * (size // 5)}),
    "prompt of two token-id lists": lambda size: ("/v1/completions", {"prompt": [[7] * (size // 6)] * 2}),
}


def ping(client, gaps: list[float], stop: threading.Event) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        client.get("/health")
        gaps.append(time.perf_counter() - start)
        time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", default="100000,1000000,5376000",
                        help="prompt logprob entries a request asks for, comma-separated ('' for none)")
    parser.add_argument("--messages", default="140000,600000",
                        help="messages in a chat request, comma-separated ('' for none)")
    parser.add_argument("--bodies", default="", help=f"'all' or names from {list(SHAPES)}, comma-separated")
    parser.add_argument("--beside", default="", help="names from SHAPES: a long text prompt sent while two bodies "
                                                     "of that shape are parsed, comma-separated")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.http_server import start_server

    from deltaserve.entrypoints.llm import BUNDLED_MODEL
    from deltaserve.entrypoints.openai.serving import body_limit

    server = start_server(BUNDLED_MODEL, max_model_len=PROMPT_LEN + 96, max_body_bytes=body_limit(1 << 20),
                          engine_process=True)
    print("| request | body MB | status | response MB | request s | longest /health wait, s |")
    print("|---|---:|---:|---:|---:|---:|")
    try:
        with server.http() as client, server.http() as pinger:
            client.timeout = 600
            for entries in [int(e) for e in args.entries.split(",") if e]:
                tokens = max(1, entries // (LOGPROBS + 1))
                prompts = max(1, min(8, tokens // PROMPT_LEN))
                n = max(1, tokens // (prompts * PROMPT_LEN))
                length = min(PROMPT_LEN, tokens // (prompts * n))
                body = {"model": "tiny", "prompt": [[5 + i % 100 for i in range(length)]] * prompts, "n": n,
                        "echo": True, "logprobs": LOGPROBS, "max_tokens": 1, "temperature": 0}
                asked = prompts * n * length * (LOGPROBS + 1)
                timed(client, pinger, "/v1/completions", body, f"echo, logprobs {LOGPROBS}: {asked:,} entries "
                                                                f"({prompts} x n {n} of {length:,} tokens)")
            for count in [int(m) for m in args.messages.split(",") if m]:
                messages = [{"role": ("user", "assistant")[i % 2], "content": "hi"} for i in range(count)]
                body = {"model": "tiny", "messages": messages, "max_tokens": 1}
                timed(client, pinger, "/v1/chat/completions", body, f"chat of {count:,} messages")
            for name in SHAPES if args.bodies == "all" else [b for b in args.bodies.split(",") if b]:
                path, body = SHAPES[name](server.app.state.max_body_bytes - 256)
                timed(client, pinger, path, {"model": "tiny", "max_tokens": 1, **body}, name)
            for name in [b for b in args.beside.split(",") if b]:
                path, body = SHAPES[name](server.app.state.max_body_bytes - 256)
                beside(server, client, path, {"model": "tiny", "max_tokens": 1, **body}, name)
    finally:
        server.stop()


def timed(client, pinger, path: str, body: dict, name: str) -> None:
    raw = json.dumps(body).encode()
    gaps, stop = [], threading.Event()
    thread = threading.Thread(target=ping, args=(pinger, gaps, stop))
    thread.start()
    start = time.perf_counter()
    response = client.post(path, content=raw, headers={"content-type": "application/json"})
    elapsed = time.perf_counter() - start
    stop.set()
    thread.join()
    print(f"| {name} | {len(raw) / 1e6:.1f} | {response.status_code} | {len(response.content) / 1e6:.1f} | "
          f"{elapsed:.2f} | {max(gaps):.2f} |", flush=True)


def beside(server, client, path: str, body: dict, name: str) -> None:
    """A text prompt of LONG_TEXT characters (tokenized in a worker thread) sent 0.3 s after two bodies of a shape
    (parsed in worker threads), and alone before them: its request seconds each way, its prompt cached both times."""
    raw = json.dumps(body).encode()
    text = {"model": "tiny", "prompt": "the " * (LONG_TEXT // 4), "max_tokens": 1, "temperature": 0}
    client.post("/v1/completions", json=text)  # its prefill: later sends are served from the prefix cache
    alone = time.perf_counter()
    client.post("/v1/completions", json=text)
    alone = time.perf_counter() - alone
    big, codes = [], []

    def send() -> None:
        with server.http(timeout=600) as own:
            start = time.perf_counter()
            codes.append(own.post(path, content=raw, headers={"content-type": "application/json"}).status_code)
            big.append(time.perf_counter() - start)

    threads = [threading.Thread(target=send) for _ in range(2)]
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    start = time.perf_counter()
    status = client.post("/v1/completions", json=text).status_code
    elapsed = time.perf_counter() - start
    for thread in threads:
        thread.join()
    print(f"| {LONG_TEXT:,}-character prompt beside two bodies of {name} ({len(raw) / 1e6:.1f} MB) | {status} | "
          f"alone {alone:.2f} s, beside {elapsed:.2f} s | the bodies {min(big):.2f}-{max(big):.2f} s, {codes} |",
          flush=True)


if __name__ == "__main__":
    main()
