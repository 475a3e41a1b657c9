"""What tokenizing one long text prompt costs the server's event loop: the Kimi tokenizer's time on the calling
thread (where the server ran it before), and the longest the calling thread then waits for the GIL while the same
text is tokenized in a worker thread (as the server now does from serving.OFF_LOOP_CHARS characters).

    python benchmarks/long_prompt_tokenize.py --chars 4200000 --ranks 30000

The tokenizer is the synthetic Kimi tokenizer of the tests (tiktoken ranks learned from sample text, Moonshot's
split pattern), since the published one cannot be downloaded here.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers.kimi_tokenizer import write_kimi_tokenizer  # noqa: E402

from deltaserve.tokenizer import load_tokenizer  # noqa: E402
from deltaserve.tokenizer.sample_text import SAMPLE_TEXT  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chars", type=int, default=4_200_000, help="characters of text (~1M tokens at 4.2M)")
    parser.add_argument("--ranks", type=int, default=30_000, help="the synthetic tokenizer's ranks")
    args = parser.parse_args()
    folder = tempfile.mkdtemp()
    write_kimi_tokenizer(folder, num_ranks=args.ranks)
    tokenizer = load_tokenizer(folder)
    text = (SAMPLE_TEXT * (args.chars // len(SAMPLE_TEXT) + 1))[:args.chars]
    start = time.perf_counter()
    num_tokens = len(tokenizer.encode(text, add_special_tokens=True))
    on_loop = time.perf_counter() - start
    done = threading.Event()
    worker = threading.Thread(target=lambda: (tokenizer.encode(text, add_special_tokens=True), done.set()))
    start = last = time.perf_counter()
    worker.start()
    gaps = []
    while not done.is_set():  # a stand-in for the event loop: wakes every millisecond when it gets the GIL
        time.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    worker.join()
    print(f"{args.chars} characters, {num_tokens} tokens: {on_loop:.2f} s on the calling thread; in a worker thread "
          f"{time.perf_counter() - start:.2f} s, the calling thread's longest wait {max(gaps) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
