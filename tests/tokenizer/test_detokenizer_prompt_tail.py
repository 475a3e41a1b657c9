"""A prompt that ends inside a character: its bytes become output text only if the output finishes the character."""

from deltaserve.tokenizer import IncrementalDetokenizer


def _prompt_ending_inside_a_character(byte_ids) -> list[int]:
    return [byte_ids[b] for b in "x🙂".encode()[:3]]  # "x" and the first two of the emoji's four bytes


def test_no_output_gives_no_text(tokenizer, byte_ids):
    detok = IncrementalDetokenizer(tokenizer, _prompt_ending_inside_a_character(byte_ids))
    assert detok.finish() == "" and detok.output_text == ""


def test_output_that_does_not_continue_the_character_keeps_only_its_own_text(tokenizer, byte_ids):
    detok = IncrementalDetokenizer(tokenizer, _prompt_ending_inside_a_character(byte_ids))
    deltas = [detok.push([byte_ids[ord(c)]]) for c in "ok"] + [detok.finish()]
    assert "".join(deltas) == detok.output_text == "ok" == tokenizer.decode([byte_ids[ord(c)] for c in "ok"])
