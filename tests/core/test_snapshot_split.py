"""Prefix caching's KDA saves inside a prefill chunk (forward_batch.SnapshotSplit): the KDA layers run a step's
prefill in two passes and copy each split sequence's state between them, so a prompt is never cut into two steps for
its snapshot. Checked on the small model in float32 on the CPU against its slow twin (helpers/snapshot_split.py; the
GPU's kernels: tests/gpu/test_gpu_prefix_caching.py)."""

import pytest
from helpers.checkpoints import SMALL_RAW_CONFIG
from helpers.snapshot_split import check_split_step

from deltaserve.config import ModelConfig


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_split_step_saves_the_heads_states_and_computes_what_the_whole_step_does(seed):
    check_split_step(ModelConfig.from_dict(SMALL_RAW_CONFIG), seed)


@pytest.mark.parametrize("lengths", [[70], [1, 1, 40]], ids=["a lone prompt", "after two one-token chunks"])
def test_a_lone_split_prompt_runs_its_passes_on_views_in_order(lengths):
    """One prefill sequence, split: both passes take slices of the tokens and no reordering is needed."""
    check_split_step(ModelConfig.from_dict(SMALL_RAW_CONFIG), 3, lengths=lengths)


def test_heads_and_tails_whose_order_is_its_own_inverse_are_still_put_back():
    """A split sequence's tail as long as the sequence after it: the passes' order swaps two blocks of rows, a
    permutation equal to its inverse but not the identity (a check of `order == inverse` once took it for one)."""
    check_split_step(ModelConfig.from_dict(SMALL_RAW_CONFIG), 4, lengths=[20, 8], cuts={0: 12})
