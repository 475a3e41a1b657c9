"""What `parity check` prints: a line per prompt with its divergences (the first MAX_LISTED of them), the totals,
the verdict and why, and `match X/Y` last."""

from __future__ import annotations

from deltaserve.parity.check import CheckResult, Divergence
from deltaserve.parity.golden import Golden

MAX_LISTED = 20  # divergence lines; a different model has one or two a token, and the counts below keep them all


def report_lines(golden: Golden, result: CheckResult, ours: str, strict: bool = False) -> list[str]:
    lines = [f"golden: {golden.reference} {golden.dtype} greedy on {golden.model}, {len(golden.prompts)} prompts, "
             f"{golden.num_tokens} tokens; checking {ours}"]
    listed = 0
    for i, p in enumerate(result.prompts):
        kl = f", KL mean {_mean(p.kl):.2e} max {max(p.kl):.2e}" if p.kl else ""
        lines.append(f"prompt {i}: match {p.match}/{p.num_tokens}; "
                     f"teacher-forced top-1 {p.tf_agree}/{p.num_tokens}{kl}")
        shown = p.divergences[:max(MAX_LISTED - listed, 0)]
        lines += [f"  {_describe(d)}" for d in shown]
        listed += len(shown)
    if len(result.divergences) > listed:
        lines.append(f"... {len(result.divergences) - listed} more divergences (the first {listed} listed)")
    lines += _totals(golden, result)
    failures = result.failures(strict)
    lines.append(f"verdict: FAIL: {'; '.join(failures)}" if failures else "verdict: pass")
    lines.append(f"match {sum(p.match for p in result.prompts)}/{golden.num_tokens}")
    return lines


def _describe(d: Divergence) -> str:
    where = "free-running: first divergence" if d.free_running else "teacher-forced: top-1 differs"
    gap = "" if d.gap == d.golden_margin else (
        ", ours outside its top-k" if d.gap is None else f", gap to ours {d.gap:.4g}")
    ours = "" if d.our_margin is None else f"; ours margin {d.our_margin:.4g}"
    kind = "near-tie" if d.near_tie else "REAL"
    return (f"{where} at token {d.token}: golden {d.golden_token}, ours {d.our_token}; "
            f"golden margin {d.golden_margin:.4g}{gap}{ours} -> {kind}")


def _totals(golden: Golden, result: CheckResult) -> list[str]:
    total = golden.num_tokens
    agree = sum(p.tf_agree for p in result.prompts)
    lines = [f"teacher-forced: top-1 agreement {agree}/{total} ({100 * agree / total:.2f}%)"]
    kls = [k for p in result.prompts if p.kl for k in p.kl]
    if kls:
        k = next(len(p.ref_topk_ids[0]) for p in golden.prompts if p.ref_topk_ids)
        over = "the whole vocabulary" if k == golden.vocab_size else f"the golden's top-{k} tokens + the rest as one"
        lines[-1] += f", KL(golden || ours) mean {_mean(kls):.3e} max {max(kls):.3e} (over {over})"
    else:
        lines[-1] += ", KL n/a (the golden holds no reference log-probabilities)"
    divergences = result.divergences
    lines.append(f"divergences: {len(divergences)} ({len(divergences) - result.num_real} near-tie, "
                 f"{result.num_real} real) at tie margin {result.tie_margin:g}"
                 + (f" ({result.tie_margin_from})" if result.tie_margin_from else ""))
    return lines


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)
