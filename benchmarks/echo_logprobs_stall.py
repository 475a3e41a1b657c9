"""What a completions request with echo and logprobs costs the other streams: its prompt logprob entries (prompt
tokens x n x (logprobs + 1)) are built and rendered as JSON on the server's event loop. A thread pings /health every
10 ms meanwhile; the longest wait for an answer is how long every stream stalled. The server runs the demo model
(engine in its own process, as `deltaserve serve` runs it) with --max-model-len 4096, so the limit is
echo_logprobs_limit's floor (1,048,576 entries).

    python benchmarks/echo_logprobs_stall.py --entries 100000,1000000,5376000

A request asks for the entries given, rounded down to whole prompts: up to 8 prompts of up to 4,000 tokens, n
growing past them; the table prints what each asked for.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOGPROBS = 20
PROMPT_LEN = 4000


def ping(client, gaps: list[float], stop: threading.Event) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        client.get("/health")
        gaps.append(time.perf_counter() - start)
        time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", default="100000,1000000,5376000",
                        help="prompt logprob entries a request asks for, comma-separated (logprobs 20, 4,000-token "
                             "prompts, n fills the rest)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.http_server import start_server

    from deltaserve.entrypoints.llm import BUNDLED_MODEL

    server = start_server(BUNDLED_MODEL, max_model_len=PROMPT_LEN + 96, max_body_bytes=None, engine_process=True)
    print("| entries asked | prompts x n | status | response MB | request s | longest /health wait, s |")
    print("|---:|---|---:|---:|---:|---:|")
    try:
        with server.http() as client, server.http() as pinger:
            client.timeout = 600
            for entries in map(int, args.entries.split(",")):
                tokens = max(1, entries // (LOGPROBS + 1))
                prompts = max(1, min(8, tokens // PROMPT_LEN))
                n = max(1, tokens // (prompts * PROMPT_LEN))
                length = min(PROMPT_LEN, tokens // (prompts * n))
                body = {"model": "tiny", "prompt": [[5 + i % 100 for i in range(length)]] * prompts, "n": n,
                        "echo": True, "logprobs": LOGPROBS, "max_tokens": 1, "temperature": 0}
                gaps, stop = [], threading.Event()
                thread = threading.Thread(target=ping, args=(pinger, gaps, stop))
                thread.start()
                start = time.perf_counter()
                response = client.post("/v1/completions", json=body)
                elapsed = time.perf_counter() - start
                stop.set()
                thread.join()
                asked = prompts * n * length * (LOGPROBS + 1)
                print(f"| {asked:,} | {prompts} x {n} of {length:,} tokens | {response.status_code} | "
                      f"{len(response.content) / 1e6:.1f} | {elapsed:.2f} | {max(gaps):.2f} |", flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
