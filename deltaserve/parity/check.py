"""check: compare deltaserve with a golden, teacher-forced and free-running, and classify every divergence.

Teacher-forced: prompt + the golden continuation in one pass, so a divergence cannot cascade; per generated
position, top-1 agreement with the golden token and KL(reference || ours). Free-running: deltaserve's own
greedy decode; tokens equal to the golden's up to each prompt's first divergence count towards `match X/Y`.

A divergence (a free-running first divergence, or a teacher-forced top-1 disagreement) is a near-tie when the
reference's logit gap between its token and ours is under the tie margin: numerics of the size the regime
allows can flip it. Otherwise it is real: something computes a different model.

At a coarse regime's margin every divergence of a small model can be a near-tie, so a run also fails when the
teacher-forced top-1 agreement is under a floor or the mean KL over a ceiling: no rounding makes a different model."""

from __future__ import annotations

from dataclasses import dataclass

from deltaserve.parity.defaults import DEFAULT_MAX_KL, DEFAULT_MIN_TOP1
from deltaserve.parity.golden import Golden, GoldenPrompt
from deltaserve.parity.logits import coarse_kl, logit_gap


@dataclass
class Divergence:
    prompt: int  # index of the prompt in the golden
    token: int  # index among its output tokens
    golden_token: int
    our_token: int
    golden_margin: float  # the golden's top-2 margin at this token
    gap: float | None  # the golden's logit(golden_token) - logit(our_token); None if ours is outside its top-k
    near_tie: bool
    free_running: bool  # the free-running first divergence (else a teacher-forced disagreement)
    our_margin: float | None = None  # ours top-2 margin there (free-running only)


@dataclass
class PromptResult:
    num_tokens: int
    tf_agree: int  # teacher-forced positions whose argmax is the golden token
    kl: list[float] | None  # per position, None when the golden holds no reference log-probabilities
    divergences: list[Divergence]
    match: int  # free-running tokens equal to the golden's before the first divergence


@dataclass
class CheckResult:
    prompts: list[PromptResult]
    tie_margin: float
    min_top1: float = DEFAULT_MIN_TOP1  # the run fails under this teacher-forced top-1 agreement (a fraction)...
    max_kl: float = DEFAULT_MAX_KL  # ...or over this mean KL(golden || ours)
    tie_margin_from: str = ""  # what set the tie margin, for the report

    @property
    def divergences(self) -> list[Divergence]:
        return [d for p in self.prompts for d in p.divergences]

    @property
    def num_real(self) -> int:
        return sum(not d.near_tie for d in self.divergences)

    @property
    def top1_agreement(self) -> float:
        tokens = sum(p.num_tokens for p in self.prompts)
        return sum(p.tf_agree for p in self.prompts) / tokens if tokens else 1.0  # no token: nothing disagreed

    @property
    def kl_mean(self) -> float | None:
        """The mean over every generated position; None when the golden holds no reference log-probabilities."""
        kls = [k for p in self.prompts if p.kl for k in p.kl]
        return sum(kls) / len(kls) if kls else None

    def failures(self, strict: bool) -> list[str]:
        """Why the run fails, one phrase a reason; empty when it passes."""
        reasons = []
        if strict and self.divergences:
            reasons.append(f"{len(self.divergences)} divergences with --strict")
        elif self.num_real:
            reasons.append(f"{self.num_real} real divergences (golden gap over the tie margin {self.tie_margin:g})")
        if self.top1_agreement < self.min_top1:
            reasons.append(f"teacher-forced top-1 agreement {100 * self.top1_agreement:.2f}% under the floor "
                           f"{100 * self.min_top1:g}% (--min-top1)")
        if self.kl_mean is not None and self.kl_mean > self.max_kl:
            reasons.append(f"KL mean {self.kl_mean:.3e} over the ceiling {self.max_kl:g} (--max-kl)")
        return reasons

    def exit_status(self, strict: bool) -> int:
        """1 when the run fails (any divergence with strict, else any real one; agreement under the floor or KL
        over the ceiling); 0 otherwise."""
        return int(bool(self.failures(strict)))


def check(golden: Golden, backend, tie_margin: float, min_top1: float = DEFAULT_MIN_TOP1,
          max_kl: float = DEFAULT_MAX_KL, tie_margin_from: str = "") -> CheckResult:
    """backend: a DeltaserveBackend (or anything with its greedy / teacher_forced)."""
    max_tokens = max(len(p.output_token_ids) for p in golden.prompts)
    free = backend.greedy([p.prompt_token_ids for p in golden.prompts], max_tokens)
    results = []
    for i, (gp, ours) in enumerate(zip(golden.prompts, free)):
        logits = backend.teacher_forced(gp.prompt_token_ids, gp.output_token_ids)  # [M, V]
        results.append(_compare(i, gp, logits, ours, tie_margin))
    return CheckResult(results, tie_margin, min_top1, max_kl, tie_margin_from)


def _compare(index: int, gp: GoldenPrompt, logits, ours, tie_margin: float) -> PromptResult:
    golden_ids, argmax = gp.output_token_ids, logits.argmax(-1).tolist()
    divergences = [_divergence(index, gp, j, argmax[j], tie_margin, free_running=False)
                   for j in range(len(golden_ids)) if argmax[j] != golden_ids[j]]
    match = next((j for j, (a, b) in enumerate(zip(golden_ids, ours.output_token_ids)) if a != b), len(golden_ids))
    if match < len(golden_ids):
        first = _divergence(index, gp, match, ours.output_token_ids[match], tie_margin, free_running=True)
        first.our_margin = ours.top2[match][2]
        divergences.insert(0, first)
    kl = coarse_kl(gp.ref_topk_ids, gp.ref_topk_logprobs, logits) if gp.ref_topk_ids else None
    return PromptResult(len(golden_ids), sum(a == b for a, b in zip(argmax, golden_ids)), kl, divergences, match)


def _divergence(index: int, gp: GoldenPrompt, j: int, ours: int, tie_margin: float, free_running: bool):
    golden_token, (_, runner_up, margin) = gp.output_token_ids[j], gp.top2[j]
    gap = margin if ours == runner_up else None
    if gap is None and gp.ref_topk_ids:
        gap = logit_gap(gp.ref_topk_ids[j], gp.ref_topk_logprobs[j], golden_token, ours)
    near_tie = gap is not None and gap < tie_margin
    return Divergence(index, j, golden_token, ours, margin, gap, near_tie, free_running)
