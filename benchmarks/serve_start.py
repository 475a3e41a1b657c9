"""Issue 26: `deltaserve serve` from the shell to its first `/health` 200, several starts in a row on one machine
(the first pays compile and tune; the later ones read the caches it left), with the start-up phases the server
logs.

    python benchmarks/serve_start.py                                   # the demo model, this machine's device
    python benchmarks/serve_start.py --config benchmarks/configs/kimi-linear-48b-a3b.json --device cuda --starts 2

A --config model is served with dummy weights and the synthetic Kimi tokenizer (as serve_bench.py does).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from serve_bench import REPO, free_port, stop, wait_healthy
from serve_workload import prepare_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: the bundled demo model)")
    p.add_argument("--config", default=None, help="a config.json, served with dummy weights")
    p.add_argument("--device", default=None)
    p.add_argument("--quantization", default=None, help="passed to serve (fp8: the 48B shape on an 80 GB card)")
    p.add_argument("--starts", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600, help="seconds a start may take")
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    if args.starts < 1:
        p.error("--starts must be at least 1")
    workdir = Path(tempfile.mkdtemp(prefix="serve-start-"))
    model_dir = prepare_model(args, workdir)
    cmd = ["serve", *(["--model", str(model_dir)] if args.model or args.config else [])]
    cmd += ["--load-format", "dummy"] if args.config else []
    cmd += ["--device", args.device] if args.device else []
    cmd += ["--quantization", args.quantization] if args.quantization else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    rows = []
    for i in range(args.starts):
        port, log = free_port(), workdir / f"start{i}.log"
        start = time.monotonic()
        with open(log, "w") as log_file:
            proc = subprocess.Popen([sys.executable, "-m", "deltaserve.entrypoints.cli", *cmd, "--port", str(port)],
                                    stdout=log_file, stderr=subprocess.STDOUT, env=env)
            try:
                wait_healthy(proc, f"http://127.0.0.1:{port}", args.timeout, log)
                seconds = time.monotonic() - start
            finally:
                stop(proc, 60)
        phases = [line.strip() for line in log.read_text().splitlines() if "start-up:" in line or "autotuning:" in line]
        rows.append({"start": i + 1, "to_health_s": round(seconds, 2), "phases": phases})
        print(f"start {i + 1}: /health 200 after {seconds:.2f} s", *phases, sep="\n  ", flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"serve_command": cmd, "starts": rows}, indent=1))


if __name__ == "__main__":
    main()
