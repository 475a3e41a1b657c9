"""Plot MLA decode kernel rows: GB/s of latents read per launch, one sequence by context length (left) and the
batched rows (right), against the card's copy bandwidth and issue 24's 80% of it. Reads the JSON that
benchmarks/gpu/mla_decode_ab.py writes ({"copy_GBps", "rows": [{"batch", "context", "GBps": {launch: GB/s}}]}).

    python benchmarks/gpu/plot_mla_decode.py rows.json --out rows.png [--launches "before {}" "after {}"]
"""

from __future__ import annotations

import argparse
import json
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("json", help="mla_decode_ab.py's --json-out")
    parser.add_argument("--out", required=True, help="the PNG to write")
    parser.add_argument("--launches", nargs="*", help="the launches to draw, by their names in the JSON (default: all)")
    parser.add_argument("--title", default="MLA decode, GB/s of latents read")
    args = parser.parse_args()
    with open(args.json) as f:
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list) or not data["rows"]:
        print(f"{args.json}: expected an object with a non-empty 'rows' list (mla_decode_ab.py's output)",
              file=sys.stderr)
        return 2
    launches = args.launches or list(dict.fromkeys(k for row in data["rows"] for k in row["GBps"]))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    one = sorted((r for r in data["rows"] if r["batch"] == 1), key=lambda r: r["context"])
    many = [r for r in data["rows"] if r["batch"] > 1]
    color = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(launches)}  # one color a launch
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
    for name in launches:
        points = [(r["context"], r["GBps"][name]) for r in one if name in r["GBps"]]
        if points:
            left.plot(*zip(*points), marker="o", label=name, color=color[name])
    batched = [name for name in launches if any(name in r["GBps"] for r in many)]  # launches with batched rows
    width = 0.8 / max(len(batched), 1)
    for i, name in enumerate(batched):
        right.bar([j + i * width for j in range(len(many))], [r["GBps"].get(name, 0) for r in many], width, label=name,
                  color=color[name])
    right.set_xticks([j + width * (len(batched) - 1) / 2 for j in range(len(many))],
                     [f"{r['batch']} x {r['context']}" for r in many])
    copy = data.get("copy_GBps")
    for ax in (left, right):
        if copy:
            ax.axhline(copy, color="black", linestyle="--", linewidth=1, label="copy bandwidth")
            ax.axhline(0.8 * copy, color="gray", linestyle=":", linewidth=1, label="80% of copy")
        ax.set_ylabel("GB/s")
        ax.grid(alpha=0.3)
    left.set_xscale("log", base=2)
    left.set_xlabel("context tokens (one sequence)")
    right.set_xlabel("batch x context")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
