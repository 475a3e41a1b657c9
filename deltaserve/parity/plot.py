"""--plot: the golden's top-2 margin at every generated token, the tie margin, and where each divergence fell."""

from __future__ import annotations

from pathlib import Path

from deltaserve.parity.check import CheckResult
from deltaserve.parity.golden import Golden

_FLOOR = 1e-6  # margins of exactly 0 (a true tie) still show on the log axis


def require_matplotlib() -> None:
    """Fail before any model runs when --plot cannot be honoured."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'deltaserve[parity]'") from None


def plot_margins(golden: Golden, result: CheckResult, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for i, gp in enumerate(golden.prompts):
        ax.plot([max(m, _FLOOR) for _, _, m in gp.top2], lw=0.8, alpha=0.6, label=f"prompt {i}" if i < 10 else None)
    for kind, marker, color in (("near-tie", "o", "tab:orange"), ("real", "x", "tab:red")):
        points = [(d.token, max(d.golden_margin, _FLOOR)) for d in result.divergences
                  if d.near_tie == (kind == "near-tie")]
        if points:
            ax.scatter(*zip(*points), marker=marker, color=color, s=40, zorder=3, label=f"{kind} divergence")
    ax.axhline(result.tie_margin, color="gray", ls="--", lw=1, label=f"tie margin {result.tie_margin:g}")
    ax.set(yscale="log", xlabel="generated token", ylabel="golden top-2 logit margin",
           title=f"parity vs {golden.reference} {golden.dtype} golden")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
