"""kernels.token_bitmask against xgrammar's own apply_token_bitmask_inplace (its CPU kernel), at ragged shapes."""

import pytest
import torch

from deltaserve.kernels.token_bitmask import apply_token_bitmask, unpack_bitmask

xgr = pytest.importorskip("xgrammar", reason="the structured extra is part of the test extra")


@pytest.mark.parametrize("batch, vocab, rows", [(1, 32, [0]), (3, 31, [2]), (4, 33, [0, 3]), (5, 1000, [1, 2, 4]),
                                                (2, 4096, [0, 1])])
def test_masks_like_xgrammar(batch, vocab, rows):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(batch, vocab, generator=gen)
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), -(-vocab // 32)), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    expected = logits.clone()
    full = torch.full((batch, bitmask.shape[1]), -1, dtype=torch.int32)  # xgrammar's layout: a row per logits row
    full[rows] = bitmask
    xgr.apply_token_bitmask_inplace(expected, full, vocab_size=vocab, indices=rows)
    got = apply_token_bitmask(logits, bitmask, torch.tensor(rows))
    assert torch.equal(got, expected)
    assert not torch.equal(got, logits)  # a copy: the input is left alone
    assert torch.isinf(got).any()


def test_unpack_reads_bit_j_of_word_w_as_token_32w_plus_j():
    bitmask = torch.tensor([[1 - 2**31, 1 << 2]], dtype=torch.int32)  # bits 0 and 31 of word 0, bit 2 of word 1
    allowed = unpack_bitmask(bitmask, 40)[0]
    assert allowed.nonzero().flatten().tolist() == [0, 31, 34]


def test_a_bitmask_too_narrow_for_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match=r"expected int32 \[rows, >= 2\]"):
        apply_token_bitmask(torch.zeros(1, 33), torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0]))


def test_pack_is_the_inverse_of_unpack():
    from deltaserve.structured.backend import pack_bitmask

    allowed = torch.rand(70, generator=torch.Generator().manual_seed(0)) < 0.5
    packed = pack_bitmask(allowed.tolist())
    assert packed.dtype == torch.int32 and packed.shape == (3,)
    assert torch.equal(unpack_bitmask(packed[None], 70)[0], allowed)
