"""Issue 26's start-up times: each command in a new process, shell to exit, several runs; the median, min and max.

    python benchmarks/startup.py --runs 7
    PYTHONPATH=/path/to/other/checkout python benchmarks/startup.py --runs 7      # the same for another tree

The commands run as the console script does (`python -m deltaserve.entrypoints.cli`), so the tree measured is the
one `import deltaserve` finds; `import torch` alone is the floor under any command that runs a model. `generate`
is the README's first command (the demo model on the CPU, 32 tokens): its process exits right after the last
token is printed, so shell to exit is shell to last token plus the exit.
Runs alternate between the commands, so that a busy machine slows them alike.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

CLI = ["-m", "deltaserve.entrypoints.cli"]
COMMANDS = {
    "python -c 'import torch' (the floor)": ["-c", "import torch"],
    "deltaserve --help": [*CLI, "--help"],
    "deltaserve generate (demo model, CPU, 32 tokens)": [*CLI, "generate", "--prompt", "Once upon a time",
                                                         "--max-tokens", "32"],
}


def time_once(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, *argv], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def tree_and_commit() -> tuple[str, str]:
    """The folder that `import deltaserve` finds in a child process, and its commit."""
    code = "import deltaserve, os; print(os.path.dirname(deltaserve.__file__))"
    folder = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()
    commit = subprocess.run(["git", "-C", folder, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    return str(Path(folder).parent), commit or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    tree, commit = tree_and_commit()
    for argv in COMMANDS.values():  # one unmeasured run each: the OS's file cache, cpu_gemv's one-time build
        time_once(argv)
    seconds = {name: [] for name in COMMANDS}
    for _ in range(args.runs):
        for name, argv in COMMANDS.items():
            seconds[name].append(time_once(argv))
    print(f"{datetime.date.today()}, {platform.processor() or platform.machine()}, {tree} at {commit}, "
          f"{args.runs} runs")
    print(f"{'command':<52} {'median s':>9} {'min s':>7} {'max s':>7}")
    for name, values in seconds.items():
        print(f"{name:<52} {statistics.median(values):>9.2f} {min(values):>7.2f} {max(values):>7.2f}")


if __name__ == "__main__":
    main()
