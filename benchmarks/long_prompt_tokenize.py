"""What tokenizing one long text prompt costs the server's event loop, for each kind of tokenizer: the time on the
calling thread (where the server ran it before 85a4a2f: every stream waited), and the longest the calling thread
waits for the GIL while the same text is tokenized in a worker thread (as the server now does from
serving.OFF_LOOP_CHARS characters). A stand-in for the event loop wakes every millisecond.

    python benchmarks/long_prompt_tokenize.py --chars 4200000

Tokenizers: "kimi", the tests' synthetic Kimi tokenizer (tiktoken ranks learned from sample text, Moonshot's split
pattern; the published one cannot be downloaded here), and "demo", the bundled demo model's tokenizer.json (the
tokenizers library; from deltaserve.tokenizer.hf.BATCH_ENCODE_CHARS characters through its encode_batch, which gives
up the GIL, and before that commit through encode, timed too).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from helpers.kimi_tokenizer import write_kimi_tokenizer  # noqa: E402

from deltaserve.entrypoints.llm import BUNDLED_MODEL  # noqa: E402
from deltaserve.tokenizer import load_tokenizer  # noqa: E402
from deltaserve.tokenizer.sample_text import SAMPLE_TEXT  # noqa: E402


def longest_wait(encode, text: str) -> tuple[float, float]:
    """(seconds the worker thread took, the calling thread's longest wait in seconds) for encode(text) in a thread."""
    done = threading.Event()
    worker = threading.Thread(target=lambda: (encode(text, add_special_tokens=True), done.set()))
    start = last = time.perf_counter()
    worker.start()
    longest = 0.0
    while not done.is_set():
        time.sleep(0.001)
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    worker.join()
    return time.perf_counter() - start, longest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chars", type=int, default=4_200_000, help="characters of text (~1M Kimi tokens at 4.2M)")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    kimi_dir = tempfile.mkdtemp()
    write_kimi_tokenizer(kimi_dir, num_ranks=30_000)
    text = (SAMPLE_TEXT * (args.chars // len(SAMPLE_TEXT) + 1))[:args.chars]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    print(f"commit {commit.strip() or '?'}, {args.chars} characters\n")
    print("| tokenizer | tokens | on the calling thread | in a worker thread | the calling thread's longest wait |")
    print("|---|---:|---:|---:|---:|")
    kimi, demo = load_tokenizer(Path(kimi_dir)), load_tokenizer(BUNDLED_MODEL)
    # the tokenizers library's encode, which the demo's tokenizer called for every text before (it keeps the GIL)
    demo_before = lambda text, add_special_tokens: demo._tokenizer.encode(  # noqa: E731
        text, add_special_tokens=add_special_tokens).ids
    for name, encode in (("kimi", kimi.encode), ("demo", demo.encode), ("demo, its encode before", demo_before)):
        for _ in range(args.runs):
            start = time.perf_counter()
            num_tokens = len(encode(text, add_special_tokens=True))
            on_loop = time.perf_counter() - start
            took, wait = longest_wait(encode, text)
            print(f"| {name} | {num_tokens:,} | {on_loop:.2f} s | {took:.2f} s | {wait * 1e3:.0f} ms |", flush=True)


if __name__ == "__main__":
    main()
