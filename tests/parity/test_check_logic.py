"""How check counts and classifies, on hand-made goldens and logits (no model)."""

from __future__ import annotations

import math

import pytest
import torch

from deltaserve.parity.backends import Greedy
from deltaserve.parity.check import check
from deltaserve.parity.golden import Golden, GoldenPrompt
from deltaserve.parity.logits import coarse_kl, top2, topk_logprobs


class FakeBackend:
    """Ours: teacher-forced logits [M, V] and a free-running greedy continuation per prompt."""

    def __init__(self, logits: torch.Tensor, free: list[int]):
        self.logits, self.free = logits, free

    def greedy(self, prompts, max_tokens):
        return [Greedy(self.free, top2(self.logits))]

    def teacher_forced(self, prompt, continuation):
        return self.logits


def golden_of(logits: torch.Tensor, topk: int) -> Golden:
    ids, logprobs = topk_logprobs(logits, topk)
    tokens = logits.argmax(-1).tolist()
    return Golden("m", "transformers", "float32", [GoldenPrompt([0], tokens, top2(logits), ids, logprobs)],
                  vocab_size=logits.shape[1], topk=topk)


REF = torch.tensor([[3.0, 1.0, 0.0, -1.0], [2.0, 1.99, 0.0, -1.0], [0.0, 4.0, 1.0, 0.0]])  # margins 2, 0.01, 3


def test_identical_logits_match_with_zero_kl():
    result = check(golden_of(REF, 4), FakeBackend(REF, [0, 0, 1]), tie_margin=0.05)
    assert result.prompts[0].match == 3 and result.prompts[0].tf_agree == 3 and not result.divergences
    assert result.prompts[0].kl == pytest.approx([0, 0, 0], abs=1e-6)


def test_flip_to_the_runner_up_under_the_tie_margin_is_a_near_tie():
    ours = REF.clone()
    ours[1, 1] = 2.01  # token 1 now beats token 0 where the golden's margin is 0.01
    result = check(golden_of(REF, 4), FakeBackend(ours, [0, 1, 1]), tie_margin=0.05)
    free, forced = result.divergences
    assert (free.free_running, free.token, free.golden_token, free.our_token) == (True, 1, 0, 1)
    assert not forced.free_running and forced.token == 1
    assert free.near_tie and forced.near_tie and free.golden_margin == pytest.approx(0.01, abs=1e-6)
    assert result.prompts[0].match == 1
    assert (result.exit_status(strict=True), result.exit_status(strict=False)) == (1, 0)
    assert check(golden_of(REF, 4), FakeBackend(ours, [0, 1, 1]), tie_margin=0.005).num_real == 2


def test_a_token_outside_the_golden_top_k_is_real():
    ours = REF.clone()
    ours[1, 3] = 5.0  # the golden's least likely token, not stored with topk=2
    result = check(golden_of(REF, 2), FakeBackend(ours, [0, 3, 1]), tie_margin=100.0)
    assert [d.gap for d in result.divergences] == [None, None] and result.num_real == 2
    assert result.exit_status(strict=False) == 1


def test_another_model_fails_on_top1_agreement_even_when_every_divergence_is_a_near_tie():
    ours = REF[:, [1, 0, 3, 2]]  # every argmax moves, and every gap is under the margin
    result = check(golden_of(REF, 4), FakeBackend(ours, [1, 1, 0]), tie_margin=100.0, max_kl=1e9)
    assert result.num_real == 0 and result.top1_agreement == 0
    assert result.exit_status(strict=False) == 1
    assert [r.split(" (")[-1] for r in result.failures(strict=False)] == ["--min-top1)"]


def test_kl_over_the_ceiling_fails_with_every_top1_agreeing():
    ours = REF * 4  # the same argmax everywhere, much sharper distributions
    result = check(golden_of(REF, 4), FakeBackend(ours, [0, 0, 1]), tie_margin=0.05, max_kl=0.2)
    assert result.top1_agreement == 1 and not result.divergences and result.kl_mean > 0.2
    assert [r.split(" (")[-1] for r in result.failures(strict=False)] == ["--max-kl)"]
    assert check(golden_of(REF, 4), FakeBackend(ours, [0, 0, 1]), 0.05, max_kl=10.0).exit_status(strict=False) == 0


def test_coarse_kl_is_exact_with_the_whole_vocabulary_and_a_lower_bound_without():
    gen = torch.Generator().manual_seed(0)
    p_logits, q_logits = torch.randn(5, 50, generator=gen), torch.randn(5, 50, generator=gen)
    p, q = p_logits.double().log_softmax(-1), q_logits.double().log_softmax(-1)
    exact = (p.exp() * (p - q)).sum(-1).tolist()
    assert coarse_kl(*topk_logprobs(p_logits, 50), q_logits) == pytest.approx(exact, rel=1e-5)
    coarse = coarse_kl(*topk_logprobs(p_logits, 10), q_logits)
    assert all(0 <= c <= e + 1e-9 for c, e in zip(coarse, exact)) and not math.isclose(sum(coarse), sum(exact))


def test_plot_marks_divergences(tmp_path):
    pytest.importorskip("matplotlib")
    from deltaserve.parity.plot import plot_margins

    ours = REF.clone()
    ours[1, 1] = 2.01
    golden = golden_of(REF, 4)
    plot_margins(golden, check(golden, FakeBackend(ours, [0, 1, 1]), 0.05), tmp_path / "margins.png")
    assert (tmp_path / "margins.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
