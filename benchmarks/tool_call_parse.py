"""Time the Kimi tool-call parser (deltaserve.tokenizer.tool_calls) on one whole output with many markers, as a
non-streamed chat response with tools reads it: stray call-end markers in plain content, and many complete calls.

    python benchmarks/tool_call_parse.py --markers 8000,32000 --calls 8000
"""

from __future__ import annotations

import argparse
import time

from deltaserve.tokenizer import tool_calls as tc


def parse_seconds(text: str) -> tuple[float, int]:
    parser = tc.ToolCallStreamParser()
    start = time.perf_counter()
    parser.push(text)
    parser.finish()
    return time.perf_counter() - start, len(parser.result().tool_calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--markers", default="8000,32000", help="stray end markers in plain content, comma-separated")
    parser.add_argument("--calls", type=int, default=8000, help="complete calls in one tool-call section")
    args = parser.parse_args()
    for n in map(int, args.markers.split(",")):
        seconds, _ = parse_seconds("x" + tc.CALL_END * n)
        print(f"{n:,} stray markers ({len(tc.CALL_END) * n / 1e3:.0f} kB): {seconds:.3f} s")
    calls = "".join(f'{tc.CALL_BEGIN}functions.f:{i}{tc.ARGUMENT_BEGIN}{{"a": {i}}}{tc.CALL_END}'
                    for i in range(args.calls))
    seconds, found = parse_seconds(tc.SECTION_BEGIN + calls + tc.SECTION_END)
    print(f"{args.calls:,} calls ({found:,} parsed): {seconds:.3f} s")


if __name__ == "__main__":
    main()
